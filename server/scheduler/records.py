"""Mutable per-run, per-node and per-host records of the scheduler, with their transition tables.

Internal to the package: callers see only events, actions and snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from server.scheduler.events import NodeSpec, RunSpec


class InvalidTransition(RuntimeError):
    """A state change the transition table does not allow: a scheduler bug, never a caller error."""


class RunState(StrEnum):
    WAITING = "waiting"  # queued; no seqs yet
    ADMITTED = "admitted"  # every node has its seq; holds window room
    DONE = "done"  # finished ok, failed or cancelled; forgotten right after


class NodeState(StrEnum):
    WAITING = "waiting"  # its run is not admitted
    ASSIGNED = "assigned"  # has a seq, not sent (sequential mode: deps not finished)
    DISPATCHED = "dispatched"  # sent to its host
    STARTED = "started"  # host reported it started
    DONE = "done"  # finished ok
    DROPPED = "dropped"  # its run failed before it finished


RUN_TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    RunState.WAITING: frozenset({RunState.ADMITTED, RunState.DONE}),
    RunState.ADMITTED: frozenset({RunState.DONE}),
    RunState.DONE: frozenset(),
}

NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    NodeState.WAITING: frozenset({NodeState.ASSIGNED, NodeState.DROPPED}),
    NodeState.ASSIGNED: frozenset({NodeState.DISPATCHED, NodeState.DROPPED}),
    NodeState.DISPATCHED: frozenset({NodeState.STARTED, NodeState.DONE, NodeState.DROPPED}),
    NodeState.STARTED: frozenset({NodeState.DONE, NodeState.DROPPED}),
    NodeState.DONE: frozenset(),
    NodeState.DROPPED: frozenset(),
}

UNFINISHED = frozenset({NodeState.ASSIGNED, NodeState.DISPATCHED, NodeState.STARTED})


@dataclass(slots=True)
class NodeRecord:
    spec: NodeSpec
    dependents: tuple[int, ...]
    deps_left: int
    state: NodeState = NodeState.WAITING
    seq: int = 0
    ready_at: float | None = None  # when its last dep finished (admission time if it has none)
    dispatched_at: float | None = None
    started_at: float | None = None

    def to(self, new: NodeState) -> None:
        if new not in NODE_TRANSITIONS[self.state]:
            raise InvalidTransition(f"node {self.spec.index}: {self.state} -> {new}")
        self.state = new


@dataclass(frozen=True, slots=True)
class RunShape:
    """What a run's records take from its nodes alone (the same for every run of a program's plan:
    the dispatcher passes the same nodes tuple), made once per nodes tuple (`SchedulerBook`)."""

    nodes: tuple[NodeSpec, ...]
    dependents: tuple[tuple[int, ...], ...]
    deps_left: tuple[int, ...]
    islands: tuple[str, ...]  # first node's island first
    hosts: tuple[str, ...]  # in node order
    per_island: dict[str, int]

    @classmethod
    def of(cls, specs: tuple[NodeSpec, ...]) -> RunShape:
        # a gang run has a node per member host, hundreds, most with no deps: per node, little
        dependents: dict[int, list[int]] = {}
        per_island: dict[str, int] = {}
        for n in specs:
            for d in dict.fromkeys(n.deps) if len(n.deps) > 1 else n.deps:
                dependents.setdefault(d, []).append(n.index)
            per_island[n.island] = per_island.get(n.island, 0) + 1
        none: tuple[int, ...] = ()
        return cls(specs, tuple(tuple(dependents[n.index]) if n.index in dependents else none for n in specs),
                   tuple(len(set(n.deps)) if len(n.deps) > 1 else len(n.deps) for n in specs),
                   tuple(per_island), tuple(dict.fromkeys(n.host for n in specs)), per_island)


@dataclass(slots=True)
class RunRecord:
    spec: RunSpec
    order: int  # global submit order
    submitted_at: float
    nodes: list[NodeRecord]
    islands: tuple[str, ...]  # islands touched, first node's island first
    hosts: tuple[str, ...]  # hosts touched, in node order
    nodes_per_island: dict[str, int]
    state: RunState = RunState.WAITING
    admit_order: int = 0
    admitted_at: float | None = None
    nodes_left: int = 0
    wait_reason: str = ""

    @classmethod
    def create(cls, spec: RunSpec, order: int, now: float, shape: RunShape | None = None) -> RunRecord:
        """`shape`: `RunShape.of(spec.nodes)`, made here when not given (a caller may keep one
        per program: its runs share their nodes)."""
        shape = shape or RunShape.of(spec.nodes)
        nodes = [NodeRecord(n, dep, left) for n, dep, left in zip(spec.nodes, shape.dependents, shape.deps_left,
                                                                   strict=True)]
        return cls(spec, order, now, nodes, shape.islands, shape.hosts, dict(shape.per_island),
                   nodes_left=len(nodes))

    @property
    def run_id(self) -> int:
        return self.spec.run_id

    @property
    def client(self) -> str:
        return self.spec.client

    @property
    def policy_island(self) -> str:
        """The island whose policy orders this run: its first node's island."""
        return self.islands[0]

    def to(self, new: RunState) -> None:
        if new not in RUN_TRANSITIONS[self.state]:
            raise InvalidTransition(f"run {self.run_id}: {self.state} -> {new}")
        self.state = new


@dataclass(slots=True)
class HostRecord:
    name: str
    up: bool = True
    next_seq: int = 1
    progress_at: float = 0.0  # last time one of its nodes finished or was dropped, or it registered
    # seq -> (run_id, node_index) of unfinished nodes of admitted runs. Seqs are assigned increasing,
    # so insertion order is seq order and the first key is the host's head.
    live: dict[int, tuple[int, int]] = field(default_factory=dict)

    def head(self) -> tuple[int, int, int] | None:
        for seq, (run_id, index) in self.live.items():
            return seq, run_id, index
        return None


@dataclass(slots=True)
class Share:
    """A client's proportional-share account on one island.

    `used` is measured device time of finished nodes. Nodes still in flight are charged an estimate
    (the client's recent node time: a moving average, so that one slow first run does not inflate the
    estimate for long) so that a client is not picked again and again while its admitted work has not
    been billed yet; the estimate is replaced by the measurement on finish.
    """

    used: float = 0.0
    weight: float = 1.0
    node_time: float = 0.0  # moving average of its nodes' device time (`used` also moves on catch-up)
    period: int = 0  # the island's busy period in which it was last active
    done_nodes: int = 0
    inflight_nodes: int = 0

    def charge(self, busy_s: float) -> None:
        """A node of this client finished after `busy_s` of device time."""
        busy_s = max(busy_s, 0.0)
        self.used += busy_s
        self.node_time = busy_s if self.done_nodes == 0 else self.node_time + 0.2 * (busy_s - self.node_time)
        self.done_nodes += 1

    def vtime(self, unknown_node_time: float = 0.0) -> float:
        """Virtual time: (used + estimated in-flight use) / weight. A client none of whose nodes
        has finished in this busy period has no node time of its own yet: its nodes in flight
        are estimated at `unknown_node_time` (policy.typical_node_time)."""
        node_time = self.node_time if self.done_nodes else unknown_node_time
        return (self.used + self.inflight_nodes * node_time) / self.weight
