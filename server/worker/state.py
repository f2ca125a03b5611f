"""The worker's pure core: which task to launch when, in the island's gang order.

`WorkerState` is a state machine in the style of Dask distributed's `worker_state_machine.py`:
stimuli in (`handle`), instructions out, no threads, no I/O, no JAX. The executor
(server/worker/executor.py) owns one, feeds it from its threads and carries out what it returns.

A task holds one seq of this worker's gang order (server/controller/segments.py). Its states:

    queued ──(head of the order)──> launching ──Launched──> in flight ──Completed──> gone
      │      └─ a collective: held ──┘  │  ▲        (LaunchFailed: gone)
      │                    InputsMissing │  │ InputsReady
      │                                  ▼  │
      │                                 waiting
      └── (queued, held or waiting) its run dropped, or a peer it needs lost ──> gone (Fail)

Rules (docs/facts.md, "JAX on CPU": JAX blocks the launching thread past ~32 computations in
flight; on CPU two collective computations in flight at once deadlock):
- Tasks leave the order strictly by seq; a seq the controller skipped counts as done.
- A task without collectives is launched as soon as it leaves the order; when an input has not
  arrived (a transfer from another worker), the launch reports `InputsMissing`, the task waits,
  and the tasks behind it go on. Every such wait points to an earlier task of the global order,
  so it cannot deadlock.
- A task with collectives (`communicates`) is held at the head of the order until every earlier
  task was launched (none launching or waiting), and its `Launch` names the tasks in flight on
  its devices (`after`): the executor waits for them to complete before it starts. Tasks
  behind it stay in the order until its `Launch` is issued (the executor carries instructions
  out in order): every member of an island launches the island's collectives in the one gang
  order.
- A dropped run's tasks, and tasks that need a lost peer (its inputs come from it, or it joins
  their collective), fail at once with an error naming the run's reason or the peer; a held
  collective behind them is released, so nothing waits forever and later tasks are not stuck.
  (`Task.peers` and `PeerLost` are not fed from the wire, by choice: a broken transfer link is
  not a lost peer, since its sender sends the array again on the gRPC stream, and a peer that
  dies is the controller's to declare: its stream to the controller closes, and the controller
  drops every run that needs it on the other workers, one error for all, tests/test_peer_loss.py.
  The executor's `peer_lost` is the entry point should a worker ever learn of a loss first.)

Ownership of derived facts: whether a segment communicates is owned by the worker, read off its
compiled executables (server/worker/executable.py) and handed in on `Task.communicates`; the cut
of a program into segments, their wiring and their devices are owned by the controller
(server/controller/segments.py) and taken from the wire as given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..invariants import InvariantError, Stimulus, StimulusLog, validation_enabled

MAX_DROPPED_RUNS = 10_000  # remembered dropped runs (their late tasks fail at once); halved when full


@dataclass(eq=False, slots=True)
class Task:
    """One run's execution of a segment, as the machine sees it (the executor's tasks extend it
    with what the I/O needs). Compared by identity: a seq is reused after a `Reset`."""

    seq: int
    run_id: int
    communicates: bool = False  # it has collectives (the worker's compiled executables say)
    devices: frozenset[int] = frozenset()  # worker-local devices it runs on
    peers: frozenset[str] = frozenset()  # other workers it needs: input senders, collective members

    def __repr__(self) -> str:
        return f"Task(seq={self.seq}, run={self.run_id}{', collective' if self.communicates else ''})"


# ---- stimuli ----
@dataclass(slots=True)
class Enqueued:
    tasks: list[Task]


@dataclass(slots=True)
class Skipped:
    """Seqs assigned to tasks that will never be sent: they count as done."""

    seqs: list[int]


@dataclass(slots=True)
class Launched:
    """These tasks launched (fed in batches: the executor's hot path)."""

    tasks: list[Task]


@dataclass(slots=True)
class InputsMissing:
    task: Task


@dataclass(slots=True)
class InputsReady:
    task: Task


@dataclass(slots=True)
class LaunchFailed:
    """The launch failed; the executor reported it."""

    task: Task


@dataclass(slots=True)
class Completed:
    tasks: list[Task]


@dataclass(slots=True)
class Dropped:
    run_ids: list[int]
    reason: str


@dataclass(slots=True)
class PeerLost:
    peer: str
    reason: str = "connection lost"


@dataclass(slots=True)
class Reset:
    reason: str


Stimulus_ = Enqueued | Skipped | Launched | InputsMissing | InputsReady | LaunchFailed | Completed | Dropped \
    | PeerLost | Reset


# ---- instructions ----
@dataclass(slots=True)
class Launch:
    """Launch the task; first wait for `after` (the tasks in flight on its devices) to complete."""

    task: Task
    after: tuple[Task, ...] = ()


@dataclass(slots=True)
class Fail:
    """Fail the task: its outputs fail, consumers elsewhere get the error; `free_inputs` also
    fails its inputs (nothing will read them; waits on them end); `report` tells the controller."""

    task: Task
    error: str
    free_inputs: bool = False
    report: bool = True


Instruction = Launch | Fail


_SKIP = Task(seq=-1, run_id=-1)  # a pending seq that will never be sent


@dataclass
class WorkerState:
    """The gang-order state of one worker (not thread-safe: one thread feeds it at a time)."""

    next_seq: int = 1
    queued: dict[int, Task] = field(default_factory=dict)  # seq -> task, not yet at the head
    held: Task | None = None  # a collective at the head, waiting for earlier tasks to launch
    launching: dict[int, Task] = field(default_factory=dict)
    waiting: dict[int, Task] = field(default_factory=dict)  # for an input
    # launched and not known to have completed (the executor reports completions in batches;
    # waiting for one that already completed costs nothing)
    in_flight: dict[int, Task] = field(default_factory=dict)
    # launched before the last reset and not known to have completed: their seqs belong to the
    # old order, but they still compute on the devices, so a collective waits for them too
    draining: list[Task] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)  # run -> reason
    lost_peers: dict[str, str] = field(default_factory=dict)  # peer -> reason
    validate_each: bool = field(default_factory=validation_enabled)
    log: StimulusLog = field(default_factory=StimulusLog)

    def handle(self, stimulus: Stimulus_) -> list[Instruction]:
        """Applies one stimulus; the instructions to carry out, in order."""
        out: list[Instruction] = []
        if self.validate_each:
            self.log.record(_describe(stimulus))
        if isinstance(stimulus, Launched):
            launching, in_flight = self.launching, self.in_flight
            for t in stimulus.tasks:
                if launching.get(t.seq) is t:
                    del launching[t.seq]
                    in_flight[t.seq] = t
            if self.held is None and not self.validate_each:
                return out  # the hot path: with no collective held, a launch releases nothing
        elif isinstance(stimulus, Enqueued):
            for t in stimulus.tasks:
                self.queued[t.seq] = t
        elif isinstance(stimulus, Completed):
            for t in stimulus.tasks:
                if self.in_flight.get(t.seq) is t:
                    del self.in_flight[t.seq]
            if self.draining:
                self._drained(stimulus.tasks)
        elif isinstance(stimulus, InputsMissing):
            t = stimulus.task
            if self.launching.pop(t.seq, None) is t:
                self.waiting[t.seq] = t
        elif isinstance(stimulus, InputsReady):
            t = stimulus.task
            if self.waiting.pop(t.seq, None) is t:  # not failed meanwhile, not of an old epoch
                self.launching[t.seq] = t
                out.append(Launch(t))
        elif isinstance(stimulus, LaunchFailed):
            t = stimulus.task
            if self.launching.get(t.seq) is t:
                del self.launching[t.seq]
            elif self.draining:
                self._drained([t])
        elif isinstance(stimulus, Skipped):
            for seq in stimulus.seqs:
                if seq >= self.next_seq and seq not in self.queued:
                    self.queued[seq] = _SKIP
        elif isinstance(stimulus, Dropped):
            self._drop(stimulus, out)
        elif isinstance(stimulus, PeerLost):
            self._peer_lost(stimulus, out)
        elif isinstance(stimulus, Reset):
            self._reset(stimulus.reason, out)
        self._advance(out)
        if self.validate_each:
            self.validate()
        return out

    def _advance(self, out: list[Instruction]) -> None:
        """Takes tasks off the head of the order while the rules allow."""
        while True:
            held = self.held
            if held is not None:
                if self.launching or self.waiting:
                    return  # gang order: the collective waits for every earlier task to launch
                self.held = None
                self.launching[held.seq] = held
                running = (*self.in_flight.values(), *self.draining) if self.draining else self.in_flight.values()
                out.append(Launch(held, tuple(f for f in running if f.devices & held.devices)))
            t = self.queued.pop(self.next_seq, None)
            if t is None:
                return
            self.next_seq += 1
            if t is _SKIP:
                continue
            # inlined `_doomed` for the common case (the hot path): no dropped run, no lost peer
            error = self._doomed(t) if t.run_id in self.dropped or (t.peers and self.lost_peers) else ""
            if error:  # it arrived after its run was dropped or its peer lost
                out.append(Fail(t, error))
            elif t.communicates:
                self.held = t
            else:
                self.launching[t.seq] = t
                out.append(Launch(t))

    def _doomed(self, t: Task) -> str:
        """Why the task can never run ('' when it can)."""
        reason = self.dropped.get(t.run_id)
        if reason is not None:
            return reason
        if t.peers and self.lost_peers:
            for p in t.peers:
                if p in self.lost_peers:
                    return f"peer {p} was lost ({self.lost_peers[p]})"
        return ""

    def _fail_doomed(self, free_inputs: bool, out: list[Instruction]) -> None:
        """Fails every task not launched yet that can never run, in seq order: waiting, held and
        queued ones (a queued one's seq still counts, as done)."""
        for seq, t in list(self.waiting.items()):
            if error := self._doomed(t):
                del self.waiting[seq]
                out.append(Fail(t, error, free_inputs))
        held = self.held
        if held is not None and (error := self._doomed(held)):
            self.held = None
            out.append(Fail(held, error, free_inputs))
        for seq in sorted(self.queued):
            t = self.queued[seq]
            if t is not _SKIP and (error := self._doomed(t)):
                self.queued[seq] = _SKIP
                out.append(Fail(t, error, free_inputs))

    def _drop(self, s: Dropped, out: list[Instruction]) -> None:
        for r in s.run_ids:
            self.dropped[r] = s.reason
        self._fail_doomed(True, out)
        if len(self.dropped) > MAX_DROPPED_RUNS:
            for r in list(self.dropped)[: MAX_DROPPED_RUNS // 2]:
                del self.dropped[r]

    def _peer_lost(self, s: PeerLost, out: list[Instruction]) -> None:
        self.lost_peers[s.peer] = s.reason
        self._fail_doomed(False, out)  # its other inputs may be others' too

    def _drained(self, tasks: list[Task]) -> None:
        done = {id(t) for t in tasks}
        self.draining = [t for t in self.draining if id(t) not in done]

    def _reset(self, reason: str, out: list[Instruction]) -> None:
        """A new registration: seqs restart; work not launched yet fails (unreported: the new
        controller does not know it). What was launched goes on computing: it moves to
        `draining`, which the new order's first collectives on its devices wait for (two
        computations with collectives at once deadlock on CPU; the wait is bounded by the
        collective timeouts)."""
        stale = [t for t in self.queued.values() if t is not _SKIP] + list(self.waiting.values())
        if self.held is not None:
            stale.append(self.held)
        out.extend(Fail(t, reason, report=False) for t in sorted(stale, key=lambda t: t.seq))
        self.queued.clear()
        self.waiting.clear()
        self.draining.extend(self.launching.values())  # launched: their outcomes are ignored
        self.draining.extend(self.in_flight.values())
        self.launching.clear()
        self.in_flight.clear()
        self.held = None
        self.lost_peers.clear()
        self.next_seq = 1

    # ---- invariants ----
    def validate(self) -> None:
        """Raises InvariantError (with the recent stimuli) when the state is inconsistent."""
        problem = self._problem()
        if problem:
            raise InvariantError(problem, self.history())

    def _problem(self) -> str:
        if any(seq < self.next_seq for seq in self.queued):
            return f"a queued seq is below the head of the order ({self.next_seq})"
        tables = {"launching": self.launching, "waiting": self.waiting, "in flight": self.in_flight}
        seen: dict[int, str] = {}
        for name, table in tables.items():
            for seq, t in table.items():
                if t.seq != seq or seq >= self.next_seq:
                    return f"{t!r} is {name} under seq {seq} (head {self.next_seq})"
                if seq in seen:
                    return f"seq {seq} is both {seen[seq]} and {name}"
                seen[seq] = name
        held = self.held
        if held is not None:
            if held.seq >= self.next_seq or held.seq in seen:
                return f"held {held!r} is also elsewhere or ahead of the head ({self.next_seq})"
            if not (self.launching or self.waiting):
                return f"{held!r} is held although no earlier task is launching or waiting"
        if self.queued.get(self.next_seq) is not None and held is None:
            return f"seq {self.next_seq} is at the head of the order and was not taken"
        for t in self.waiting.values():
            if self._doomed(t):
                return f"{t!r} waits although it can never run ({self._doomed(t)})"
        if len(self.dropped) > MAX_DROPPED_RUNS:
            return f"{len(self.dropped)} dropped runs remembered (bound {MAX_DROPPED_RUNS})"
        return ""

    def history(self) -> list[Stimulus]:
        return self.log.recent()

    @property
    def backlog(self) -> int:
        """Tasks not over yet: queued, held, launching, waiting or computing."""
        queued = sum(1 for t in self.queued.values() if t is not _SKIP)
        return (queued + (self.held is not None) + len(self.launching) + len(self.waiting) + len(self.in_flight)
                + len(self.draining))


def _describe(s: Stimulus_) -> str:
    if isinstance(s, (Enqueued, Launched, Completed)):
        return f"{type(s).__name__}({', '.join(repr(t) for t in s.tasks[:8])}{', ...' if len(s.tasks) > 8 else ''})"
    return repr(s)


__all__ = [
    "Completed", "Dropped", "Enqueued", "Fail", "InputsMissing", "InputsReady", "Instruction", "Launch",
    "LaunchFailed", "Launched", "PeerLost", "Reset", "Skipped", "Task", "WorkerState",
]
