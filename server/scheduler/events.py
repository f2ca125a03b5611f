"""Inputs and outputs of the gang scheduler: run specs, events (stimuli) and actions.

Everything here is an immutable value. Time is never read from a clock: every event that needs it
carries `now` (seconds, any monotonic origin chosen by the caller).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple


class Policy(StrEnum):
    """How an island interleaves the waiting runs of different clients."""

    FIFO = "fifo"
    PRIORITY = "priority"
    FAIR = "fair"


# --------------------------------------------------------------------------------------------- specs


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One compiled computation of a run, placed on `devices` of one island and executed by one host.

    `deps` are indices of earlier nodes of the same run whose outputs this node reads.
    """

    index: int
    host: str
    island: str
    devices: tuple[int, ...] = ()
    deps: tuple[int, ...] = ()
    label: str = ""


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One execution of a registered program. `nodes[i].index == i`, in topological order."""

    run_id: int
    program: str
    client: str
    job: str | None
    nodes: tuple[NodeSpec, ...]
    priority: int = 0
    weight: float = 1.0
    sequential: bool = False
    # hosts holding inputs of the run (futures of earlier runs) that run none of its nodes: the
    # run fails when one is lost, as when a host of its own is (its inputs never arrive)
    reads_from: tuple[str, ...] = ()


# -------------------------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Submit:
    run: RunSpec
    now: float


@dataclass(frozen=True, slots=True)
class NodeStarted:
    run_id: int
    node_index: int
    now: float


@dataclass(frozen=True, slots=True)
class NodeFinished:
    """A node completed (`ok`) or failed (`error`); `busy_s` is measured device time, charged to the
    run's client for proportional share."""

    run_id: int
    node_index: int
    ok: bool
    error: str
    busy_s: float
    now: float


@dataclass(frozen=True, slots=True)
class HostUp:
    """A host (re)registered: its queue is empty and its seq counter restarts at 1."""

    host: str
    now: float


@dataclass(frozen=True, slots=True)
class HostLost:
    host: str
    now: float


@dataclass(frozen=True, slots=True)
class ClientGone:
    client: str
    now: float


@dataclass(frozen=True, slots=True)
class CancelRun:
    """A client gives up a run of its own (an input it could not upload, pwctl/worker_client.py),
    or the controller gives up a client's run that reads an output of a run that failed before
    it started (server/controller/dispatch.py): it fails with `reason`, its nodes dropped on
    their hosts (as a lost host's runs are)."""

    client: str
    run_id: int
    reason: str
    now: float


@dataclass(frozen=True, slots=True)
class Tick:
    """Periodic; drives hang detection."""

    now: float


@dataclass(frozen=True, slots=True)
class SetPolicy:
    """Change an island's policy; `now` only orders it among other events."""

    island: str
    policy: Policy
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class Batch:
    """Several events applied in order with ONE admission pass at the end: a worker's report
    of many node completions, or a client's batch of runs, costs one pass, not one each; the
    runs cancelled together all fail before the next admission (none is admitted, then dropped)."""

    events: tuple[Submit | NodeStarted | NodeFinished | CancelRun, ...]
    now: float


Event = Submit | NodeStarted | NodeFinished | HostUp | HostLost | ClientGone | CancelRun | Tick | SetPolicy | Batch


# ------------------------------------------------------------------------------------------- actions


# The two made per node dispatched (hundreds per gang run) are named tuples: a frozen dataclass
# costs about three times as much to make (its __init__ goes through object.__setattr__).
class DispatchedNode(NamedTuple):
    run_id: int
    node_index: int
    seq: int


class Dispatch(NamedTuple):
    """Every node decided for `host` in one `handle()` call, in seq order: one batched enqueue."""

    host: str
    nodes: tuple[DispatchedNode, ...]


@dataclass(frozen=True, slots=True)
class RunFinished:
    """Emitted exactly once per submitted run: all nodes ok, or the first failure."""

    run_id: int
    ok: bool
    error: str = ""
    # failed before any of its nodes went to a worker (refused at submission, or failed while
    # waiting for admission): no worker will ever compute or fail its outputs (the controller then
    # cancels the session's runs submitted already that read them, and refuses those submitted
    # later: server/controller/dispatch.py)
    unstarted: bool = field(default=False, compare=False)


@dataclass(frozen=True, slots=True)
class SkippedSeq:
    """A seq given to a node that was never dispatched (sequential mode); the host must treat it as
    consumed, or its later seqs would wait for it forever."""

    host: str
    seq: int


@dataclass(frozen=True, slots=True)
class DropRun:
    """Tell `hosts` to fail their unfinished nodes of the run (their seqs count as done)."""

    run_id: int
    hosts: tuple[str, ...]
    reason: str
    skipped: tuple[SkippedSeq, ...] = ()


@dataclass(frozen=True, slots=True)
class HangDetected:
    run_id: int
    node_index: int
    host: str
    message: str
    job: str | None = None  # the run's job, whose log gets the message


Action = Dispatch | RunFinished | DropRun | HangDetected
