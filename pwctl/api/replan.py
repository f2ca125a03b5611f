"""Calls the controller refused because they were planned on an older placement of their slices,
planned anew and sent again, up to MAX_REPLANS times (controller.proto `RunFinished.replan`).

A `pw` call is planned on the client: its inputs are uploaded to the worker of its slice as the
client last heard of it, and its futures wait there. The controller is the authority on
placement: a run carries the generation of each of its slices the client planned with
(`RunProgram.slice_generations`), and a run planned on an older one is refused before anything of
it is admitted (nothing dispatched, no upload consumed), as is a run pipelined behind it that
reads one of its outputs. The client keeps what it needs to send each run again (`Sent`) until
the controller says it handled it (`RunsDone.last_run`); on such a refusal it reads the slices
that moved (`Whereabouts.read`), uploads the run's array inputs again where they run now, sends
the run again with the same output ids, and moves its futures there: the caller sees nothing but
the time it took. A run sent again may be refused again (its slice moved again between the
client's reading of it and the run's arrival: a host flapping, an island re-forming twice within
a round trip); it is planned anew each time, the slices read again, until MAX_REPLANS re-sendings:
refused once more, it fails with the controller's reason and how many times it was sent again.
A run that reads an output of a run given up so (refused MAX_REPLANS times, or not sent again)
fails at once when it is refused, naming that run's failure: nothing will ever compute its input
(the controller refuses every run that reads it), so sending it again would only be refused again.

Runs are refused in the order they were sent, and each re-sending happens, in that order, on the
session's reader: a run reading an output of another one sent again is sent again after it, with
that output's new home (`Runtime.plan_lock` orders a call's reading of its futures' homes and its
sending against a re-sending).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from schemas.pathways.v1 import controller_pb2 as cpb

from ..errors import PathwaysError
from .bounded import Bounded

if TYPE_CHECKING:
    from .runtime import Runtime

# Runs kept to be sent again, before the controller said it handled them; beyond this many (a
# controller that stopped saying so) the oldest are forgotten: refused, they fail as before.
MAX_KEPT = 4096
# Runs sent again remembered (old run id -> new), for the waits on their futures (futures.py)
MAX_REPLANNED = 4096
# How long a wait whose worker failed waits at most for the controller's answer to its run (it
# comes right behind the session's events before it: milliseconds; a session whose events are
# held, far behind, fails such a wait after this long)
ANSWER_S = 1.0
# How many times a run refused for its plan is planned anew and sent again before it fails. Each
# refusal means a slice of its moved between the client's reading of it and the run's arrival at
# the controller (each re-sending reads the moved slices again first): a slice moving twice within
# one round trip needs two, a few more cover a flapping host; past that the slice is not settling
# (or the controller refuses whatever it is sent), and the call fails after this many round trips
# rather than never.
MAX_REPLANS = 3


class Sent(Protocol):
    """What is kept of a run sent (programs.py): its program's slices (in name order) and how to
    send it again."""

    slices: list[str]
    # how many times it was sent again already (MAX_REPLANS: refused again, it fails); a send that
    # raised, never gone out, is not counted
    replans: int

    def send_again(self, rt: Runtime) -> int:
        """Uploads its array inputs again and sends the run again, planned on the slices as the
        runtime knows them now, its futures moved there; returns the new run's id."""
        ...

    def producers(self) -> Iterable[tuple[int, int]]:
        """(input index, the id of the run that computes it) for each of its inputs that is a
        future, that run id read now (one sent again since: the one it was sent again as)."""
        ...


class Replans:
    """The runs kept to be sent again, and those sent again. `plan_lock` is the runtime's: calls
    keep their runs under it, in the order they send them."""

    def __init__(self, rt: Runtime, plan_lock: threading.Lock) -> None:
        self._rt = rt
        self._lock = plan_lock
        # in the order sent (that of the session's stream; not that of their ids, taken before a
        # call's uploads, outside `plan_lock`); None: refused and sent again, its place kept (`handled`)
        self._kept: OrderedDict[int, Sent | None] = OrderedDict()
        self.replanned: Bounded[int, int] = Bounded(MAX_REPLANNED)  # old run id -> the one sent again
        # runs refused for their plan and not sent again (failed: `refused`), never admitted: a wait
        # on their futures reports that, not their worker's loss (futures.py `_poll`); and why: the
        # error it failed with, or, for a run given up because it reads an output of one given up
        # (`_send_again`), that run's why (a chain of such runs names its first failure, once)
        self.given_up: Bounded[int, str] = Bounded(MAX_REPLANNED)
        # notified (when someone waits: `_waiting`) where runs stop being kept and at the session's end
        self._answered = threading.Condition(plan_lock)
        self._waiting = 0

    def keep(self, run_id: int, sent: Sent) -> None:
        """Run `run_id` was sent (under `plan_lock`): kept until the controller handled it."""
        kept = self._kept
        kept[run_id] = sent
        if len(kept) > MAX_KEPT:
            kept.popitem(last=False)
            if self._waiting:  # (a wait for that one's answer ends: forgotten, it fails as before)
                self._answered.notify_all()

    def handled(self, last_run: int) -> None:
        """The controller handled every run up to `last_run` (RunsDone.last_run): none of them
        will be refused for its plan any more; what was kept of them goes. `last_run` is found
        where it was sent among the kept runs: one refused and sent again keeps its place there
        (`refused`), as a run not found (let go of already, forgotten past MAX_KEPT, or sent
        before the controller checked generations) came before every run kept."""
        with self._lock:
            kept = self._kept
            if last_run not in kept:
                return
            while kept.popitem(last=False)[0] != last_run:
                pass
            if self._waiting:
                self._answered.notify_all()

    def never_sent(self, run_id: int) -> None:
        """Kept run `run_id` was taken out of the queue, never sent, and failed (resume.py
        `_check_queued`): no answer will come for it, nothing waits for one."""
        with self._lock:
            if self._kept.pop(run_id, None) is not None and self._waiting:
                self._answered.notify_all()

    def forget(self) -> None:
        with self._lock:
            self._kept.clear()
            self._answered.notify_all()

    def session_over(self) -> None:
        """The session ended (`Runtime.run_failed(0)` says why): waits for answers end."""
        with self._lock:
            self._answered.notify_all()

    def refused(self, finished: cpb.RunFinished) -> str | None:
        """The controller refused a run for its plan (`finished.replan`): reads the slices that
        moved and sends it again, and returns None. When it cannot (not kept, sent again MAX_REPLANS
        times already, a slice not read anew, the session over) it returns the error the run fails
        with: the controller's reason, and how many times it was sent again if it was (the runtime
        records that before the next `handled` lets go of it: a wait on its futures sees one or
        the other). A run that reads an output of a run given up fails at once, naming that run's
        failure (the controller refused it for that output, which nothing will ever compute)."""
        error, why = self._send_again(finished)
        if error is not None:
            self.given_up[finished.run_id] = why or error
        return error

    def _send_again(self, finished: cpb.RunFinished) -> tuple[str | None, str]:
        """`refused`, but for remembering the runs given up: also, for a run given up because it
        reads an output of a run given up, that run's why (else "")."""
        sent = self._kept.get(finished.run_id)  # (kept until then: a wait on its futures waits for this)
        if sent is None:
            return finished.error, ""
        given_up = self.given_up
        if given_up:  # (read on this thread, where runs are given up, the producer's refusal first)
            for k, producer in sent.producers():
                why = given_up.get(producer)
                if why is not None:
                    return f"input {k} reads an output of run {producer:#x}, which failed: {why}", why
        return self._replan(finished, sent), ""

    def _replan(self, finished: cpb.RunFinished, sent: Sent) -> str | None:
        """Reads the slices that moved and sends `sent` again (None), or the error it fails with."""
        if sent.replans >= MAX_REPLANS:
            return _failed(finished.error, sent.replans, ": its slices kept moving")
        rt = self._rt
        for name, now in zip(sent.slices, finished.slice_generations, strict=False):
            vs = rt.slices.get(name)
            if vs is None:
                return _failed(finished.error, sent.replans)
            if vs.info.generation < now:  # (the session's SliceChanged, before this, says so already)
                rt.where.read(name)
                if vs.info.generation < now:  # not answered, or gone meanwhile
                    return _failed(finished.error, sent.replans)
        try:
            again = sent.send_again(rt)
        except PathwaysError:  # the session ended meanwhile: the run fails with the controller's reason
            return _failed(finished.error, sent.replans)
        self.sent_again(finished.run_id, again)
        return None

    def sent_again(self, run_id: int, again: int) -> None:
        """Kept run `run_id` was refused and sent again as run `again` (kept in its turn): what
        was kept of it goes, its place among the kept runs stays (`handled`)."""
        with self._lock:
            self.replanned[run_id] = again
            if run_id in self._kept:
                self._kept[run_id] = None
            if self._waiting:
                self._answered.notify_all()

    def kept(self) -> int:
        """How many runs are kept to be sent again (tests, diagnostics)."""
        return sum(1 for sent in list(self._kept.values()) if sent is not None)

    def moved(self, run_ids: Iterable[int]) -> bool:
        """Whether one of `run_ids` was sent again (its futures moved: futures.py looks again)."""
        replanned = self.replanned
        return bool(replanned) and any(r in replanned for r in run_ids)

    def gave_up(self, run_ids: Iterable[int]) -> bool:
        """Whether one of `run_ids` was refused for its plan and not sent again (it failed)."""
        given_up = self.given_up
        return bool(given_up) and any(r in given_up for r in run_ids)

    def unanswered(self, run_ids: Iterable[int]) -> bool:
        """Whether the controller may still refuse one of `run_ids` for its plan (it has not said it
        handled it): a wait on its futures that fails at their worker (lost, the session's
        `HostLost` coming before the refusal) waits for that answer first (`wait_answer`)."""
        kept = self._kept
        return bool(kept) and any(kept.get(r) is not None for r in run_ids)

    def wait_answer(self, run_ids: Iterable[int], deadline: float | None) -> None:
        """Returns once the controller handled `run_ids` (or refused one, sent again), the
        session ended, `deadline` (monotonic) passed, or ANSWER_S at most."""
        ids = list(run_ids)
        end = time.monotonic() + ANSWER_S
        if deadline is not None:
            end = min(end, deadline)
        with self._answered:
            self._waiting += 1
            try:
                while self.unanswered(ids) and not self._rt.run_failed(0):  # (0: the session's end)
                    left = end - time.monotonic()
                    if left <= 0:
                        return
                    self._answered.wait(left)
            finally:
                self._waiting -= 1


def _failed(error: str, replans: int, why: str = "") -> str:
    """The controller's reason `error` for a run refused for its plan, and not sent again, after
    it was sent again `replans` times."""
    if not replans:
        return error
    times = "once" if replans == 1 else f"{replans} times"
    return f"{error} (planned anew and sent again {times} already{why})"
