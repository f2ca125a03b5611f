"""The gang scheduler: a synchronous state machine, `handle(event) -> list[Action]`.

One `GangScheduler` orders every node of every run on every island. It does no I/O and reads no
clock; the controller feeds it events and turns its actions into RPCs.

Gang order and why it cannot deadlock
-------------------------------------
Each host executes the nodes it receives strictly in the order of its own consecutive sequence
numbers (1, 2, 3, ...), which only this scheduler assigns. A run is *admitted* atomically: in one
step every node of the run gets its seq on its host, in the run's topological node order, and no
other run is admitted in between. Hence, for any two admitted runs A (admitted first) and B, every
seq of A on a host is below every seq of B on that host, for every host they share: all hosts of
all islands see the admitted runs in one global order. Give each node the key (admission order of
its run, its index in the run). A node can wait only for (a) lower seqs on its host: an earlier run,
or an earlier node of its own run (topological order); (b) its deps: earlier nodes of its run;
(c) outputs of earlier runs of the same client, which were admitted before it because a client's
runs are admitted in submit order. Every wait points to a strictly smaller key, so the waits-for
graph has no cycle and nothing deadlocks, however runs, islands and hosts interleave. (A run that
reads outputs of *another client's* run is outside this argument and must not be submitted before
that run is admitted.) Communicating computations of one island therefore meet in the same order on
every device: the island's gang order is the restriction of the global order to it.

Dispatch
--------
Parallel (default): at admission every node is dispatched at once, before any predecessor ran.
Sequential (`RunSpec.sequential`): seqs are still given at admission, but a node is dispatched only
when all its deps finished (the TF-v1-style baseline); later seqs on a host wait behind it. All
nodes decided for one host within one `handle()` call leave as ONE `Dispatch`, in seq order.

Admission and time-multiplexing
-------------------------------
Each island admits at most `max_inflight_nodes` unfinished nodes (a run larger than that is
admitted when the island is empty). Waiting runs are queued per client in submit order; the heads
of those queues compete under the policy of their *first node's island* (fifo, priority or fair
share). The best candidate of an island either is admitted or blocks the others of that island
(no backfill) and reserves every island it touches for the rest of the pass, so a large or
multi-island run is never starved by smaller runs slipping past it. Admission is retried after
every event.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from server.scheduler.book import InvariantError, _describe, check_spec
from server.scheduler.events import (
    Action,
    Batch,
    CancelRun,
    ClientGone,
    Dispatch,
    Event,
    HangDetected,
    HostLost,
    HostUp,
    NodeFinished,
    NodeStarted,
    Policy,
    RunFinished,
    SetPolicy,
    Submit,
    Tick,
)
from server.scheduler.policy import catch_up
from server.scheduler.records import NodeRecord, NodeState, RunRecord
from server.scheduler.views import Views

__all__ = ["GangScheduler", "InvariantError", "Stall", "check_spec"]


class GangScheduler(Views):
    """Gang scheduler for every island of one controller. See the module docstring.

    Its modules, by noun: `book` (the records and the transitions that release, fail and finish
    runs), `admission` (admission and ordering), `views` (queries and `validate`), and this one
    (stimulus handling). Every stimulus is kept in a bounded history; with `debug` (default:
    `PATHWAYS_VALIDATE`) the state is validated after each, and an `InvariantError` carries it.
    """

    # ------------------------------------------------------------------------------------ stimulus

    def handle(self, event: Event) -> list[Action]:
        """Apply one event; return the actions it causes, `Dispatch`es last (one per host)."""
        self._stimuli.append(event)
        self._now = max(self._now, event.now)  # a late-stamped event must not move time back
        if isinstance(event, Batch):
            for sub in event.events:
                self._apply(sub)
        else:
            self._apply(event)
        self._admit()
        actions = self._actions
        new = tuple.__new__  # Dispatch(...) without its frame: one per host, hundreds for a gang run
        for host, nodes in self._outbox.items():
            if len(nodes) == 1:  # a gang run's member host: nothing to order
                actions.append(new(Dispatch, (host, (nodes[0],))))
            elif nodes:
                actions.append(Dispatch(host, tuple(sorted(nodes, key=lambda d: d.seq))))
        self._actions = []
        self._outbox = {}
        if self.debug:
            self.validate()
        return actions

    def _apply(self, event: Event) -> None:
        self._now = max(self._now, event.now)
        match event:
            case Submit():
                self._on_submit(event)
            case NodeStarted():
                self._on_node_started(event)
            case NodeFinished():
                self._on_node_finished(event)
            case HostUp():
                self._on_host_up(event)
            case HostLost():
                self._on_host_lost(event)
            case ClientGone():
                self._on_client_gone(event)
            case CancelRun():
                run = self._runs.get(event.run_id)
                if run is not None and run.client == event.client:  # over already, or not its own: nothing
                    self._fail(run, event.reason)
            case Tick():
                self._on_tick(event)
            case SetPolicy():
                self._policies[event.island] = Policy(event.policy)

    def _on_submit(self, event: Submit) -> None:
        spec = event.run
        if spec.run_id in self._runs or spec.run_id in self._finished:
            return  # duplicate
        shape, problem = self._shape(spec)
        if problem is not None or shape is None:
            self._remember_finished(spec.run_id)
            self._actions.append(RunFinished(spec.run_id, False, f"invalid run: {problem}", unstarted=True))
            return
        hosts = self._hosts
        down = self._down
        for name in shape.hosts if down and not down.isdisjoint(shape.hosts) else ():
            host = hosts.get(name)
            if host is not None and not host.up:
                node = next(n for n in spec.nodes if n.host == name)
                self._remember_finished(spec.run_id)
                error = (
                    f"host {node.host} is down: node {node.index} of program {spec.program} is placed on it"
                )
                self._actions.append(RunFinished(spec.run_id, False, error, unstarted=True))
                return
        if not spec.nodes:
            self._remember_finished(spec.run_id)
            self._actions.append(RunFinished(spec.run_id, True, ""))
            return
        self._submit_counter += 1
        run = RunRecord.create(spec, self._submit_counter, event.now, shape)
        island = run.policy_island
        shares = self._shares.setdefault(island, {})
        if self._active.get((island, spec.client), 0) == 0:
            active = {c for (i, c), n in self._active.items() if i == island and n > 0}
            if not active:
                self._periods[island] = self._periods.get(island, 0) + 1  # the island was idle
            catch_up(shares, spec.client, spec.weight, active, self._periods[island])
        else:
            self._share(island, spec.client).weight = spec.weight
        self._active[(island, spec.client)] = self._active.get((island, spec.client), 0) + 1
        self._runs[spec.run_id] = run
        self._queues.setdefault(spec.client, deque()).append(spec.run_id)
        if id(shape.nodes) not in self._shapes_hosted:  # records are never removed: made once per shape
            for name in shape.hosts:
                if name not in hosts:
                    self._host(name)
            self._shapes_hosted.add(id(shape.nodes))

    def _on_node_started(self, event: NodeStarted) -> None:
        node = self._live_node(event.run_id, event.node_index)
        if node is not None and node.state is NodeState.DISPATCHED:
            node.to(NodeState.STARTED)
            node.started_at = event.now

    def _on_node_finished(self, event: NodeFinished) -> None:
        node = self._live_node(event.run_id, event.node_index)
        if node is None or node.state not in (NodeState.DISPATCHED, NodeState.STARTED):
            return
        run = self._runs[event.run_id]
        share = self._share(node.spec.island, run.client)
        share.charge(event.busy_s)
        node.to(NodeState.DONE)
        self._release(run, node)
        run.nodes_left -= 1
        if not event.ok:
            self._fail(run, f"{_describe(node)} failed: {event.error}")
            return
        if run.nodes_left == 0:
            self._finish(run, RunFinished(run.run_id, True, ""))
            return
        for index in node.dependents:
            child = run.nodes[index]
            child.deps_left -= 1
            if child.deps_left == 0:
                child.ready_at = event.now
                if child.state is NodeState.ASSIGNED:
                    self._dispatch(run, child)

    def _on_host_up(self, event: HostUp) -> None:
        host = self._host(event.host)
        if host.live:
            reason = f"host {event.host} re-registered and lost its queue"
            self._fail_runs_on_host(event.host, reason, admitted_only=True)
        host.live.clear()
        host.up = True
        self._down.discard(event.host)
        host.next_seq = 1
        host.progress_at = event.now

    def _on_host_lost(self, event: HostLost) -> None:
        host = self._host(event.host)
        host.up = False
        self._down.add(event.host)
        self._fail_runs_on_host(event.host, f"host {event.host} lost", admitted_only=False)
        host.live.clear()

    def _on_client_gone(self, event: ClientGone) -> None:
        for run in [r for r in self._runs.values() if r.client == event.client]:
            self._fail(run, f"cancelled: client {event.client} disconnected")
        self._queues.pop(event.client, None)
        for shares in self._shares.values():
            shares.pop(event.client, None)

    def _on_tick(self, event: Tick) -> None:
        if self.hang_timeout_s is None:
            return
        while (hang := self._find_hang(event.now, self.hang_timeout_s)) is not None:
            run, node, message = hang
            self.stats.hangs_detected += 1
            self._actions.append(HangDetected(run.run_id, node.spec.index, node.spec.host, message, run.spec.job))
            self._fail(run, f"hang detected: {message}")

    def _find_hang(self, now: float, timeout: float) -> tuple[RunRecord, NodeRecord, str] | None:
        """The stuck node of the earliest-admitted stuck run."""
        found = [h for h in self._stuck_heads(now) if h.age_s > timeout]
        if not found:
            return None
        h = min(found, key=lambda f: (f.run.admit_order, f.node.spec.index))
        if h.started:
            message = f"{h.where} started it {h.age_s:.1f} s ago and it has not finished"
        else:
            message = f"{h.where} never started it"
        return h.run, h.node, message

    def _stuck_heads(self, now: float) -> list[_Head]:
        """Every host's head (its lowest unfinished seq) that could be stuck, with how long it has
        been so. Only a head whose deps all finished can be stuck: everything else waits on it."""
        out = []
        for name, host in self._hosts.items():
            head = host.head()
            if head is None:
                continue
            _, run_id, index = head
            run = self._runs[run_id]
            node = run.nodes[index]
            if node.deps_left > 0 or node.state is NodeState.ASSIGNED:
                continue
            where = f"node {index} of program {run.spec.program}: host {name}"
            if node.state is NodeState.STARTED and node.started_at is not None:
                out.append(_Head(name, run, node, True, now - node.started_at, where))
            elif node.state is NodeState.DISPATCHED:
                since = max(node.dispatched_at or 0.0, host.progress_at, node.ready_at or 0.0)
                out.append(_Head(name, run, node, False, now - since, where))
        return out

    def stalls(self, now: float, after_s: float) -> list[Stall]:
        """Gangs held back now, for the status view and `host list` (hang reporting before the
        hang timeout fails them): every host whose head has not started for `after_s`, or has
        run without finishing for the longer of `after_s` and half the hang timeout (a long
        computation is normal; one that is half way to the hang timeout is worth showing)."""
        started_after = max(after_s, (self.hang_timeout_s or 0.0) / 2)
        out = []
        for h in self._stuck_heads(now):
            if h.age_s < (started_after if h.started else after_s):
                continue
            what = "started it and it has not finished" if h.started else "has not started it"
            out.append(Stall(h.host, h.run.run_id, h.node.spec.index, h.run.spec.program, h.run.spec.job,
                             h.started, h.age_s, f"{h.where} {what} for {h.age_s:.1f} s"))
        return sorted(out, key=lambda s: (-s.for_s, s.host))


@dataclass(frozen=True, slots=True)
class _Head:
    host: str
    run: RunRecord
    node: NodeRecord
    started: bool
    age_s: float
    where: str


@dataclass(frozen=True, slots=True)
class Stall:
    """A host holding back a gang: its head node (of `run_id`) has not started, or not finished."""

    host: str
    run_id: int
    node_index: int
    program: str
    job: str | None
    started: bool
    for_s: float
    message: str
