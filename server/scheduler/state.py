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

from collections import OrderedDict, deque

from server.scheduler.events import (
    Action,
    Batch,
    ClientGone,
    Dispatch,
    DispatchedNode,
    DropRun,
    Event,
    HangDetected,
    HostLost,
    HostUp,
    NodeFinished,
    NodeStarted,
    Policy,
    RunFinished,
    RunSpec,
    SetPolicy,
    SkippedSeq,
    Submit,
    Tick,
)
from server.scheduler.policy import catch_up, order_candidates, reason_behind
from server.scheduler.records import (
    UNFINISHED,
    HostRecord,
    NodeRecord,
    NodeState,
    RunRecord,
    RunState,
    Share,
)
from server.scheduler.snapshot import ClientUsage, HostView, IslandView, RunView, SchedulerSnapshot

_FINISHED_MEMORY = 16_384  # finished run ids remembered so that a repeated Submit is ignored (~0.1 KiB each)


class InvariantError(AssertionError):
    """`validate()` found the scheduler's state inconsistent."""


def check_spec(spec: RunSpec) -> str | None:
    """Why `spec` cannot be scheduled, or None."""
    if not spec.weight > 0:
        return f"weight must be positive, got {spec.weight}"
    for position, node in enumerate(spec.nodes):
        if node.index != position:
            return f"node at position {position} has index {node.index}; nodes must be in index order"
        if not node.host or not node.island:
            return f"node {position} has no host or island"
        for dep in node.deps:
            if not 0 <= dep < position:
                return f"node {position} depends on node {dep}, which is not an earlier node"
    return None


def _describe(node: NodeRecord) -> str:
    return f"node {node.spec.index} ({node.spec.label})" if node.spec.label else f"node {node.spec.index}"


class GangScheduler:
    """Gang scheduler for every island of one controller. See the module docstring."""

    def __init__(
        self,
        *,
        max_inflight_nodes: int = 256,
        hang_timeout_s: float | None = None,
        default_policy: Policy = Policy.FIFO,
        debug: bool = False,
    ) -> None:
        if max_inflight_nodes < 1:
            raise ValueError("max_inflight_nodes must be at least 1")
        self.max_inflight_nodes = max_inflight_nodes
        self.hang_timeout_s = hang_timeout_s
        self.default_policy = default_policy
        self.debug = debug
        self._now = 0.0
        self._runs: dict[int, RunRecord] = {}  # waiting and admitted runs, in submit order
        self._queues: dict[str, deque[int]] = {}  # client -> its waiting run ids, submit order
        self._hosts: dict[str, HostRecord] = {}
        self._inflight: dict[str, int] = {}  # island -> admitted unfinished nodes on it
        self._policies: dict[str, Policy] = {}
        self._shares: dict[str, dict[str, Share]] = {}  # island -> client -> account
        self._active: dict[tuple[str, str], int] = {}  # (policy island, client) -> live runs
        self._periods: dict[str, int] = {}  # island -> busy periods begun (fair-share accounting)
        self._finished: OrderedDict[int, None] = OrderedDict()
        self._submit_counter = 0
        self._admit_counter = 0
        self._outbox: dict[str, list[DispatchedNode]] = {}  # host -> nodes decided this call
        self._actions: list[Action] = []

    # ------------------------------------------------------------------------------------ stimulus

    def handle(self, event: Event) -> list[Action]:
        """Apply one event; return the actions it causes, `Dispatch`es last (one per host)."""
        self._now = max(self._now, event.now)  # a late-stamped event must not move time back
        if isinstance(event, Batch):
            for sub in event.events:
                self._apply(sub)
        else:
            self._apply(event)
        self._admit()
        actions = self._actions
        for host, nodes in self._outbox.items():
            if nodes:
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
            case Tick():
                self._on_tick(event)
            case SetPolicy():
                self._policies[event.island] = Policy(event.policy)

    def _on_submit(self, event: Submit) -> None:
        spec = event.run
        if spec.run_id in self._runs or spec.run_id in self._finished:
            return  # duplicate
        problem = check_spec(spec)
        if problem is not None:
            self._remember_finished(spec.run_id)
            self._actions.append(RunFinished(spec.run_id, False, f"invalid run: {problem}"))
            return
        for node in spec.nodes:
            host = self._hosts.get(node.host)
            if host is not None and not host.up:
                self._remember_finished(spec.run_id)
                error = (
                    f"host {node.host} is down: node {node.index} of program {spec.program} is placed on it"
                )
                self._actions.append(RunFinished(spec.run_id, False, error))
                return
        if not spec.nodes:
            self._remember_finished(spec.run_id)
            self._actions.append(RunFinished(spec.run_id, True, ""))
            return
        self._submit_counter += 1
        run = RunRecord.create(spec, self._submit_counter, event.now)
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
        for node in spec.nodes:
            self._host(node.host)

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
        host.next_seq = 1
        host.progress_at = event.now

    def _on_host_lost(self, event: HostLost) -> None:
        host = self._host(event.host)
        host.up = False
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
            self._actions.append(HangDetected(run.run_id, node.spec.index, node.spec.host, message))
            self._fail(run, f"hang detected: {message}")

    # --------------------------------------------------------------------------------- transitions

    def _admit(self) -> None:
        """Admit waiting runs while the best candidate of some island fits (see module docstring)."""
        while True:
            by_island: dict[str, list[RunRecord]] = {}
            for queue in self._queues.values():
                if queue:
                    head = self._runs[queue[0]]
                    by_island.setdefault(head.policy_island, []).append(head)
            reserved: dict[str, int] = {}
            admitted = False
            for island in sorted(by_island):
                policy = self._policy(island)
                shares = self._shares.get(island, {})
                ordered = order_candidates(policy, by_island[island], shares)
                first = ordered[0]
                blocked = self._blocked(first, reserved)
                if blocked is None:
                    self._admit_run(first)
                    admitted = True
                    break
                first.wait_reason = blocked
                for touched in first.islands:
                    reserved.setdefault(touched, first.run_id)
                for other in ordered[1:]:
                    other.wait_reason = reason_behind(policy, other, first, shares)
            if not admitted:
                return

    def _blocked(self, run: RunRecord, reserved: dict[str, int]) -> str | None:
        for island, count in run.nodes_per_island.items():
            inflight = self._inflight.get(island, 0)
            if inflight > 0 and inflight + count > self.max_inflight_nodes:
                return f"window full: {inflight} nodes in flight on island {island}"
        for island in run.islands:
            if island in reserved:
                return f"island {island} reserved for run {reserved[island]}"
        return None

    def _admit_run(self, run: RunRecord) -> None:
        queue = self._queues[run.client]
        if queue[0] != run.run_id:
            raise InvariantError(f"run {run.run_id} admitted ahead of run {queue[0]} of its client")
        queue.popleft()
        run.to(RunState.ADMITTED)
        self._admit_counter += 1
        run.admit_order = self._admit_counter
        run.admitted_at = self._now
        run.wait_reason = ""
        # The atomic step: every node's seq on its host, in topological (index) order.
        for node in run.nodes:
            host = self._hosts[node.spec.host]
            node.seq = host.next_seq
            host.next_seq += 1
            host.live[node.seq] = (run.run_id, node.spec.index)
            node.to(NodeState.ASSIGNED)
            if node.deps_left == 0:
                node.ready_at = self._now
            self._inflight[node.spec.island] = self._inflight.get(node.spec.island, 0) + 1
            self._share(node.spec.island, run.client).inflight_nodes += 1
        for node in run.nodes:
            if not run.spec.sequential or node.deps_left == 0:
                self._dispatch(run, node)

    def _dispatch(self, run: RunRecord, node: NodeRecord) -> None:
        node.to(NodeState.DISPATCHED)
        node.dispatched_at = self._now
        self._outbox.setdefault(node.spec.host, []).append(
            DispatchedNode(run.run_id, node.spec.index, node.seq)
        )

    def _release(self, run: RunRecord, node: NodeRecord) -> None:
        """Give back the node's window room and its place in its host's queue."""
        host = self._hosts[node.spec.host]
        host.live.pop(node.seq, None)
        host.progress_at = self._now
        self._inflight[node.spec.island] -= 1
        self._share(node.spec.island, run.client).inflight_nodes -= 1

    def _fail(self, run: RunRecord, error: str, lost_host: str | None = None) -> None:
        """Fail a waiting or admitted run: RunFinished, then DropRun to hosts holding its nodes."""
        if run.state is RunState.WAITING:
            self._queues[run.client].remove(run.run_id)
            self._finish(run, RunFinished(run.run_id, False, error))
            return
        hosts: dict[str, None] = {}
        skipped: list[SkippedSeq] = []
        for node in run.nodes:
            if node.state not in UNFINISHED:
                continue
            host = node.spec.host
            if node.state is NodeState.ASSIGNED or self._take_from_outbox(run.run_id, node):
                skipped.append(SkippedSeq(host, node.seq))
            node.to(NodeState.DROPPED)
            self._release(run, node)
            if host != lost_host:
                hosts[host] = None
        self._finish(run, RunFinished(run.run_id, False, error))
        skipped = [s for s in skipped if s.host != lost_host]
        if hosts:
            self._actions.append(DropRun(run.run_id, tuple(hosts), error, tuple(skipped)))

    def _take_from_outbox(self, run_id: int, node: NodeRecord) -> bool:
        """Unsend a node dispatched earlier in this same call (its run failed before the flush)."""
        pending = self._outbox.get(node.spec.host, [])
        for i, d in enumerate(pending):
            if d.run_id == run_id and d.node_index == node.spec.index:
                del pending[i]
                return True
        return False

    def _finish(self, run: RunRecord, result: RunFinished) -> None:
        run.to(RunState.DONE)
        for node in run.nodes:
            if node.state is NodeState.WAITING:
                node.to(NodeState.DROPPED)
        del self._runs[run.run_id]
        key = (run.policy_island, run.client)
        self._active[key] -= 1
        if self._active[key] == 0:
            del self._active[key]
        self._remember_finished(run.run_id)
        self._actions.append(result)

    def _fail_runs_on_host(self, host: str, reason: str, *, admitted_only: bool) -> None:
        """Fail the runs with a node on `host`, whose queue is gone (no DropRun is sent to it)."""
        for run in [r for r in self._runs.values() if host in r.hosts]:
            if admitted_only and run.state is not RunState.ADMITTED:
                continue
            node = next(n for n in run.nodes if n.spec.host == host)
            error = f"{reason}: it held {_describe(node)} of program {run.spec.program}"
            self._fail(run, error, lost_host=host)

    def _find_hang(self, now: float, timeout: float) -> tuple[RunRecord, NodeRecord, str] | None:
        """The stuck node of the earliest-admitted stuck run. Only a host's head (its lowest
        unfinished seq) whose deps all finished can be stuck: everything else waits on it."""
        found: list[tuple[int, int, RunRecord, NodeRecord, str]] = []
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
                age = now - node.started_at
                if age > timeout:
                    message = f"{where} started it {age:.1f} s ago and it has not finished"
                    found.append((run.admit_order, index, run, node, message))
            elif node.state is NodeState.DISPATCHED:
                since = max(node.dispatched_at or 0.0, host.progress_at, node.ready_at or 0.0)
                if now - since > timeout:
                    found.append((run.admit_order, index, run, node, f"{where} never started it"))
        if not found:
            return None
        _, _, run, node, message = min(found, key=lambda f: (f[0], f[1]))
        return run, node, message

    # ------------------------------------------------------------------------------------- helpers

    def _host(self, name: str) -> HostRecord:
        host = self._hosts.get(name)
        if host is None:
            host = self._hosts[name] = HostRecord(name, progress_at=self._now)
        return host

    def _share(self, island: str, client: str) -> Share:
        return self._shares.setdefault(island, {}).setdefault(client, Share())

    def _live_node(self, run_id: int, index: int) -> NodeRecord | None:
        run = self._runs.get(run_id)
        if run is None or run.state is not RunState.ADMITTED or not 0 <= index < len(run.nodes):
            return None
        return run.nodes[index]

    def _policy(self, island: str) -> Policy:
        return self._policies.get(island, self.default_policy)

    def _remember_finished(self, run_id: int) -> None:
        self._finished[run_id] = None
        if len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)

    # ------------------------------------------------------------------------------------- queries

    def policy(self, island: str) -> Policy:
        return self._policy(island)

    def is_live(self, run_id: int) -> bool:
        """Whether the run is waiting or admitted (not finished, not unknown)."""
        return run_id in self._runs

    def snapshot(self) -> SchedulerSnapshot:
        islands: set[str] = set(self._policies) | set(self._shares)
        islands |= {i for i, n in self._inflight.items() if n}
        for run in self._runs.values():
            islands.update(run.islands)
        views: list[IslandView] = []
        for island in sorted(islands):
            touching = [r for r in self._runs.values() if island in r.nodes_per_island]
            running = sorted(
                (r for r in touching if r.state is RunState.ADMITTED), key=lambda r: r.admit_order
            )
            waiting = [r for r in touching if r.state is RunState.WAITING]
            active = {c for (i, c) in self._active if i == island}
            clients = tuple(
                ClientUsage(c, s.used, s.weight, c in active)
                for c, s in sorted(self._shares.get(island, {}).items())
            )
            views.append(
                IslandView(
                    island=island,
                    policy=str(self._policy(island)),
                    inflight_nodes=self._inflight.get(island, 0),
                    max_inflight_nodes=self.max_inflight_nodes,
                    running=tuple(self._view(r) for r in running),
                    waiting=tuple(self._view(r) for r in waiting),
                    clients=clients,
                )
            )
        hosts = tuple(
            HostView(h.name, h.up, h.next_seq, len(h.live))
            for h in sorted(self._hosts.values(), key=lambda h: h.name)
        )
        return SchedulerSnapshot(self._now, tuple(views), hosts)

    def _view(self, run: RunRecord) -> RunView:
        reason = ""
        if run.state is RunState.WAITING:
            head = self._queues[run.client][0]
            reason = f"behind run {head} of the same client" if head != run.run_id else run.wait_reason
        spec = run.spec
        return RunView(
            run_id=spec.run_id,
            program=spec.program,
            client=spec.client,
            job=spec.job,
            priority=spec.priority,
            weight=spec.weight,
            sequential=spec.sequential,
            nodes_total=len(run.nodes),
            nodes_left=run.nodes_left,
            submitted_at=run.submitted_at,
            admitted_at=run.admitted_at,
            wait_reason=reason,
        )

    # ---------------------------------------------------------------------------------- invariants

    def validate(self) -> None:
        """Check every invariant; raise `InvariantError` on the first violation."""

        def check(ok: bool, message: str) -> None:
            if not ok:
                raise InvariantError(message)

        check(not self._outbox and not self._actions, "outbox not flushed")
        queued = [rid for q in self._queues.values() for rid in q]
        check(len(queued) == len(set(queued)), "a run is queued twice")
        check(not (set(self._runs) & set(self._finished)), "a run is both live and finished")
        for client, queue in self._queues.items():
            orders = [self._runs[rid].order for rid in queue]
            check(orders == sorted(orders), f"client {client}'s waiting runs are out of submit order")
            check(all(self._runs[rid].client == client for rid in queue), "run queued under wrong client")
        inflight: dict[str, int] = {}
        live: dict[str, dict[int, tuple[int, int]]] = {}
        active: dict[tuple[str, str], int] = {}
        seq_owner: dict[str, list[tuple[int, int]]] = {}  # host -> (seq, admit order)
        share_inflight: dict[tuple[str, str], int] = {}
        for run in self._runs.values():
            key = (run.policy_island, run.client)
            active[key] = active.get(key, 0) + 1
            check(run.state in (RunState.WAITING, RunState.ADMITTED), f"run {run.run_id} is {run.state}")
            if run.state is RunState.WAITING:
                check(run.run_id in queued, f"waiting run {run.run_id} is not queued")
                check(
                    all(n.state is NodeState.WAITING and n.seq == 0 for n in run.nodes),
                    f"waiting run {run.run_id} has assigned nodes",
                )
                continue
            check(run.run_id not in queued, f"run {run.run_id} is both waiting and admitted")
            left = 0
            per_host: dict[str, list[int]] = {}
            for node in run.nodes:
                spec = node.spec
                check(node.seq > 0, f"admitted node {run.run_id}/{spec.index} has no seq")
                check(node.state not in (NodeState.WAITING, NodeState.DROPPED), f"node state {node.state}")
                deps_left = len({d for d in spec.deps if run.nodes[d].state is not NodeState.DONE})
                check(node.deps_left == deps_left, f"node {run.run_id}/{spec.index} deps_left is wrong")
                if node.state is NodeState.ASSIGNED:
                    check(run.spec.sequential and deps_left > 0, f"node {run.run_id}/{spec.index} not sent")
                per_host.setdefault(spec.host, []).append(node.seq)
                seq_owner.setdefault(spec.host, []).append((node.seq, run.admit_order))
                if node.state in UNFINISHED:
                    left += 1
                    inflight[spec.island] = inflight.get(spec.island, 0) + 1
                    key = (spec.island, run.client)
                    share_inflight[key] = share_inflight.get(key, 0) + 1
                    live.setdefault(spec.host, {})[node.seq] = (run.run_id, spec.index)
            check(run.nodes_left == left, f"run {run.run_id} nodes_left {run.nodes_left} != {left}")
            for host_name, seqs in per_host.items():
                first = seqs[0]
                check(
                    seqs == list(range(first, first + len(seqs))),
                    f"run {run.run_id} seqs on {host_name}: {seqs}",
                )
        check(active == self._active, "active-client counts are wrong")
        for island, shares in self._shares.items():
            for client, share in shares.items():
                want = share_inflight.get((island, client), 0)
                check(share.inflight_nodes == want, f"client {client} in-flight count on island {island}")
        for island in set(inflight) | set(self._inflight):
            have, want = self._inflight.get(island, 0), inflight.get(island, 0)
            check(have == want, f"window accounting on island {island}: {have} != {want}")
        for name, host in self._hosts.items():
            check(host.live == live.get(name, {}), f"host {name}'s queue disagrees with its runs")
            keys = list(host.live)
            check(keys == sorted(keys), f"host {name}'s queue is out of seq order")
            owners = sorted(seq_owner.get(name, []))
            check(len({s for s, _ in owners}) == len(owners), f"duplicate seq on host {name}")
            check(all(s < host.next_seq for s, _ in owners), f"seq beyond counter on host {name}")
            admit = [a for _, a in owners]
            check(admit == sorted(admit), f"host {name}'s seqs disagree with the admission order")
        for name in live:
            check(name in self._hosts, f"unknown host {name}")
