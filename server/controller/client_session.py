"""One client's session state: its identity, its event queue, and the release barrier.

A release may not reach a worker before every run the client submitted earlier has finished: a
waiting run's enqueue has not been sent yet, and it may read the released buffer. The session
numbers its runs in submission order and holds each release until every earlier run closed.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from schemas.pathways.v1 import controller_pb2 as cpb

# Events queued for a client that does not read them (its stream's flow control holds them back)
# before its session is ended: a client far behind is broken, and its queue must not grow the
# controller without bound (issue 29, finding 2: idle sessions grew it to 1.1 GiB).
MAX_QUEUED = 10_000
# Outputs of the session's refused runs remembered (buffer id -> why it will never be computed;
# ~150 bytes each): a client pipelines its calls, so runs reading them may follow before it hears
# of the refusal (`ClientSession.never_computed`).
MAX_NEVER_COMPUTED = 65_536
# Programs whose registration this session was refused, remembered (program id -> why): a client
# pipelines calls behind a registration, and its resumed session re-registers every program at
# once, so a call of a refused program may come before the client read the refusal; its error
# then says why the program is unknown.
MAX_REFUSED_PROGRAMS = 256
# The runs carrying slice generations that a session's `RunsDone.last_run` is told after at the
# latest, when none is over meanwhile: its client keeps each run (its inputs with it) until told,
# to send it again should it be refused for its plan (pwctl replan.py), and a pipelining client
# whose runs do not end (a first step compiling, a frozen worker) would keep all it has in flight.
TELL_HANDLED_EVERY = 64


class Replan(str):
    """Why a run was refused before anything of it was admitted, its client to plan it anew and
    send it again (RunFinished.replan): it was planned on an older placement of its slices. Kept
    as the reason its outputs will never be computed (`never_made`), so that a run reading one is
    refused the same way."""

    __slots__ = ()


class RunRequest(Protocol):
    """What the dispatcher reads of a run to start (`Dispatcher.submit`): a client's
    `RunProgram`, or a `LocalRun`."""

    @property
    def run_id(self) -> int: ...
    @property
    def program_id(self) -> str: ...
    @property
    def input_ids(self) -> Sequence[int]: ...
    @property
    def output_ids(self) -> Sequence[int]: ...
    @property
    def input_homes(self) -> Sequence[str]: ...
    @property
    def slice_generations(self) -> Sequence[int]: ...


class LocalRun(NamedTuple):
    """A run made inside the controller (the IFRT proxy's, one per Execute:
    server/proxy/cluster_backend.py), handed to `SessionManager.run` as these fields of a
    `RunProgram`: no message built per call for the dispatcher to read back field by field."""

    run_id: int
    program_id: str
    input_ids: Sequence[int]
    output_ids: Sequence[int]
    input_homes: Sequence[str]
    slice_generations: Sequence[int] = ()


def planned_on_older(run: RunRequest, names: list[str], now: list[int]) -> Replan:
    """Why `run` is refused: its client planned it on older generations of its program's slices
    (`names`, in name order) than `now` (one moved since: a host lost and back at a new address, a
    remap). It is refused before anything of it is admitted, its client to plan it anew and send it
    again; its outputs are never made by it (a run pipelined behind it that reads one is refused
    the same way: `never_made`). `run` carries one generation per slice (`Dispatcher.submit`)."""
    moved = [f"{n!r} (generation {g} -> {c})" for n, g, c in zip(names, run.slice_generations, now, strict=False)
             if g != c]
    return Replan(f"run {run.run_id:#x} was planned on an older placement of slice {', '.join(moved)}: send it again")


@dataclass(eq=False)
class ClientSession:
    client_id: str
    id_prefix: int
    name: str
    job_id: str
    priority: int
    weight: float
    sequential: bool
    queue: asyncio.Queue[cpb.SessionEvent | None] = field(default_factory=asyncio.Queue)
    # the release barrier (see the module docstring)
    submitted: int = 0
    open_runs: dict[int, int] = field(default_factory=dict)  # run id -> ordinal
    _open_heap: list[int] = field(default_factory=list)
    _closed: set[int] = field(default_factory=set)  # ordinals closed but still in the heap
    held_releases: deque[tuple[int, str, list[int]]] = field(default_factory=deque)
    finished: int = 0  # runs over (ran, failed or refused): the client's bound on runs in flight
    _reported: int = 0
    # the last run message handled (admitted or refused), told with RunsDone (Welcome.checks_generations)
    last_run: int = 0
    untold: int = 0  # runs carrying generations admitted since `last_run` was last told (TELL_HANDLED_EVERY)
    overflowed: bool = False  # MAX_QUEUED events were waiting: the session ends, later events are dropped
    # outputs of runs refused before they started: no worker will ever compute them (buffer id ->
    # the first refusal's reason); the last MAX_NEVER_COMPUTED, less those the client released
    never_computed: OrderedDict[int, str] = field(default_factory=OrderedDict)
    # programs whose registration was refused (program id -> why), the last MAX_REFUSED_PROGRAMS
    refused_programs: OrderedDict[str, str] = field(default_factory=OrderedDict)
    # release acknowledgements (release_acks.py): asked for (Hello.ack_releases), the release
    # messages that passed the barrier, and how many of those the client was told arrived
    ack_releases: bool = False
    releases_out: int = 0
    releases_acked: int = 0
    # runs someone in the controller waits for (`when_over`): run id -> the future their end sets
    _over_waiters: dict[int, asyncio.Future[None]] = field(default_factory=dict)

    @property
    def owner(self) -> str:
        return f"job:{self.job_id}" if self.job_id else f"client:{self.client_id}"

    def send(self, ev: cpb.SessionEvent) -> None:
        if self.queue.qsize() < MAX_QUEUED:
            self.queue.put_nowait(ev)
        elif not self.overflowed:  # one past the bound: the stream ends with why (the None ends it)
            self.overflowed = True
            self.queue.put_nowait(cpb.SessionEvent(
                error=f"this session had {MAX_QUEUED} events unread: the controller ended it"))
            self.queue.put_nowait(None)

    def run_failed(self, run_id: int, error: str) -> None:
        self.send(cpb.SessionEvent(finished=cpb.RunFinished(run_id=run_id, ok=False, error=error)))

    def run_refused(self, run_id: int, error: str, generations: list[int] | None = None) -> None:
        """A run that never started (unknown program, wrong arity): failed, and over. An `error`
        that is a `Replan` tells the client to plan it anew (RunFinished.replan), `generations`
        its slices' now."""
        if isinstance(error, Replan):
            self.send(cpb.SessionEvent(finished=cpb.RunFinished(run_id=run_id, ok=False, error=error, replan=True,
                                                                slice_generations=generations)))
        else:
            self.run_failed(run_id, error)
        self.finished += 1

    def never_made(self, buffer_ids: Iterable[int], why: str) -> None:
        """These buffers (a refused run's outputs) will never be computed, because of `why`: a
        run of the session that reads one is refused too, with `why`, rather than admitted to
        wait on its worker for an input nobody makes (until the hang timeout, holding the
        worker's gang order, and everything after it in the client's chain of calls)."""
        for b in buffer_ids:
            self.never_computed[b] = why
            self.never_computed.move_to_end(b)
        while len(self.never_computed) > MAX_NEVER_COMPUTED:
            self.never_computed.popitem(last=False)

    def program_refused(self, program_id: str, why: str) -> None:
        """The session's registration of `program_id` was refused because of `why`."""
        self.refused_programs[program_id] = why
        self.refused_programs.move_to_end(program_id)
        while len(self.refused_programs) > MAX_REFUSED_PROGRAMS:
            self.refused_programs.popitem(last=False)

    def unknown_program(self, program_id: str) -> str:
        """The error of a run of a program the controller does not know."""
        why = self.refused_programs.get(program_id)
        if why is not None:
            return f"program {program_id} is not registered: its registration was refused ({why})"
        return (f"program {program_id} is not registered with this controller (a controller forgets "
                "the programs of sessions that ended; register it first)")

    def uncomputable(self, buffer_ids: Iterable[int]) -> tuple[int, int, str] | None:
        """The first of a run's inputs that will never be computed: (its index, its id, why)."""
        if not self.never_computed:
            return None
        for k, b in enumerate(buffer_ids):
            why = self.never_computed.get(b)
            if why is not None:
                return k, b, why
        return None

    def report_finished(self) -> None:
        """Tells the client how many of its runs are over, if that changed since last time, and
        the last run it handled (no event of its own: a run admitted is told with the next that
        is over, not to cost an op-by-op client a second event per call; or after TELL_HANDLED_EVERY
        admitted, none over)."""
        if self.finished != self._reported or self.untold >= TELL_HANDLED_EVERY:
            self._reported = self.finished
            self.untold = 0
            self.send(cpb.SessionEvent(runs_done=cpb.RunsDone(count=self.finished, last_run=self.last_run)))

    def run_opened(self, run_id: int) -> None:
        self.open_runs[run_id] = self.submitted
        heapq.heappush(self._open_heap, self.submitted)
        self.submitted += 1

    def run_closed(self, run_id: int) -> list[tuple[str, list[int]]]:
        """Forgets a finished run; returns the releases that may go out now."""
        ordinal = self.open_runs.pop(run_id, None)
        if ordinal is not None:
            self._closed.add(ordinal)
            self.finished += 1
        if self._over_waiters:
            waiter = self._over_waiters.pop(run_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        return self.releasable()

    def when_over(self, run_id: int) -> asyncio.Future[None] | None:
        """A future set when the session's open run `run_id` ends (ran, failed or was
        cancelled: the session's events say which); None when it is not open (over already, or
        never submitted). One future per run, shared by its waiters (none of whom may cancel it)."""
        if run_id not in self.open_runs:
            return None
        waiter = self._over_waiters.get(run_id)
        if waiter is None:
            waiter = self._over_waiters[run_id] = asyncio.get_running_loop().create_future()
        return waiter

    def hold_release(self, address: str, ids: list[int]) -> list[tuple[str, list[int]]]:
        self.held_releases.append((self.submitted, address, ids))
        return self.releasable()

    def releasable(self) -> list[tuple[str, list[int]]]:
        heap, closed = self._open_heap, self._closed
        while heap and heap[0] in closed:
            closed.discard(heapq.heappop(heap))
        if not self.held_releases:
            return []
        low = self._open_heap[0] if self._open_heap else self.submitted
        out = []
        while self.held_releases and self.held_releases[0][0] <= low:
            _, address, ids = self.held_releases.popleft()
            out.append((address, ids))
            self.releases_out += 1
        return out
