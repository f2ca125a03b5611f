"""The scheduler's bookkeeping: its state, and the transitions that release, fail and finish runs.

`SchedulerBook` holds every record the scheduler keeps and the recent stimuli it handled; the
admission step (`admission`), the queries and invariants (`views`) and the stimulus handling
(`state.GangScheduler`) build on it.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from server.invariants import DEFAULT_HISTORY, InvariantError, Stimulus, validation_enabled
from server.scheduler.events import (
    Action,
    Batch,
    CancelRun,
    DispatchedNode,
    DropRun,
    Event,
    NodeFinished,
    NodeStarted,
    Policy,
    RunFinished,
    RunSpec,
    SkippedSeq,
    Submit,
)
from server.scheduler.records import (
    UNFINISHED,
    HostRecord,
    NodeRecord,
    NodeState,
    RunRecord,
    RunShape,
    RunState,
    Share,
)
from server.scheduler.stats import RunStats

_SHAPES = 1_024  # run shapes kept (one per program plan in use)
_FINISHED_MEMORY = 16_384  # finished run ids remembered so that a repeated Submit is ignored (~0.1 KiB each)
_NO_SHARES: dict[str, Share] = {}  # an island without accounts (`_share`; never written)


__all__ = ["InvariantError", "SchedulerBook", "check_spec"]


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


def _stimulus_text(event: Event) -> str:
    """One line for the stimulus history of an `InvariantError` (rendered only when one is raised)."""
    match event:
        case Submit(run=spec):
            mode = " sequential" if spec.sequential else ""
            hosts = sorted({n.host for n in spec.nodes})
            who = f"run {spec.run_id} ({spec.program}) client {spec.client}"
            return f"Submit {who}: {len(spec.nodes)} nodes on {hosts}{mode}"
        case NodeStarted():
            return f"NodeStarted run {event.run_id} node {event.node_index}"
        case NodeFinished():
            outcome = "ok" if event.ok else f"failed: {event.error}"
            return f"NodeFinished run {event.run_id} node {event.node_index} {outcome}"
        case CancelRun():
            return f"CancelRun run {event.run_id} client {event.client}: {event.reason}"
        case Batch(events=events):
            shown = "; ".join(_stimulus_text(e) for e in events[:8])
            more = f"; ... {len(events) - 8} more" if len(events) > 8 else ""
            return f"Batch of {len(events)}: {shown}{more}"
    return repr(event)


class SchedulerBook:
    """Every record of the gang scheduler (see `state` for what the scheduler does with them)."""

    def __init__(
        self,
        *,
        max_inflight_nodes: int = 256,
        hang_timeout_s: float | None = None,
        default_policy: Policy = Policy.FIFO,
        debug: bool | None = None,
    ) -> None:
        """`debug` (default: `PATHWAYS_VALIDATE` in the environment) validates after every stimulus."""
        if max_inflight_nodes < 1:
            raise ValueError("max_inflight_nodes must be at least 1")
        self.max_inflight_nodes = max_inflight_nodes
        self.hang_timeout_s = hang_timeout_s
        self.default_policy = default_policy
        self.debug = validation_enabled() if debug is None else debug
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
        # id(nodes tuple) -> the shape of runs with those nodes (their specs checked): a program's
        # runs share one tuple (the dispatcher's plan), so a gang run's per-node checks and
        # bookkeeping are made once per plan, not per run. Bounded; holding the tuple keeps the id.
        self._shapes: dict[int, RunShape] = {}
        self._shapes_hosted: set[int] = set()  # of those, the ones whose hosts all have records
        self._down: set[str] = set()  # hosts whose record says they are down (HostRecord.up False)
        self._actions: list[Action] = []
        # The recent stimuli, kept as the event objects themselves: one append per handle() on the
        # hot path; they are rendered to text only when an InvariantError needs its history.
        self._stimuli: deque[Event] = deque(maxlen=DEFAULT_HISTORY)
        self.stats = RunStats()  # read by the metrics endpoint

    def history(self) -> list[Stimulus]:
        """The recent stimuli, oldest first, as an `InvariantError` carries them."""
        return [Stimulus(e.now, _stimulus_text(e)) for e in self._stimuli]

    def _broken(self, message: str) -> InvariantError:
        return InvariantError(message, self.history())

    # --------------------------------------------------------------------------------- transitions

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
            self._finish(run, RunFinished(run.run_id, False, error, unstarted=True))
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
        self.stats.finished(result.ok, run.submitted_at, run.admitted_at, self._now)
        self._actions.append(result)

    def _fail_runs_on_host(self, host: str, reason: str, *, admitted_only: bool) -> None:
        """Fail the runs with a node on `host`, whose queue is gone (no DropRun is sent to it),
        and, when it is lost, the runs reading inputs it held."""
        for run in [r for r in self._runs.values() if host in r.hosts or host in r.spec.reads_from]:
            if admitted_only and run.state is not RunState.ADMITTED:
                continue
            node = next((n for n in run.nodes if n.spec.host == host), None)
            if node is None:
                if admitted_only:
                    continue  # a re-registration: the inputs it held may still be there
                error = f"{reason}: it held inputs of program {run.spec.program}"
            else:
                error = f"{reason}: it held {_describe(node)} of program {run.spec.program}"
            self._fail(run, error, lost_host=host)

    # ------------------------------------------------------------------------------------- helpers

    def _shape(self, spec: RunSpec) -> tuple[RunShape | None, str | None]:
        """The shape of runs with `spec`'s nodes, or why they cannot be scheduled (`check_spec`)."""
        shape = self._shapes.get(id(spec.nodes))
        if shape is not None and shape.nodes is spec.nodes:
            return shape, None if spec.weight > 0 else f"weight must be positive, got {spec.weight}"
        problem = check_spec(spec)
        if problem is not None:
            return None, problem
        if len(self._shapes) >= _SHAPES:
            self._shapes.clear()
            self._shapes_hosted.clear()
        shape = self._shapes[id(spec.nodes)] = RunShape.of(spec.nodes)
        return shape, None

    def _host(self, name: str) -> HostRecord:
        host = self._hosts.get(name)
        if host is None:
            host = self._hosts[name] = HostRecord(name, progress_at=self._now)
        return host

    def _share(self, island: str, client: str) -> Share:
        # made only when missing (a `setdefault` made a Share per call, ~4 a run; one line, as
        # tests/test_scale_costs.py counts them per gang member)
        return self._shares.get(island, _NO_SHARES).get(client) or self._new_share(island, client)

    def _new_share(self, island: str, client: str) -> Share:
        share = self._shares.setdefault(island, {})[client] = Share()
        return share

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

