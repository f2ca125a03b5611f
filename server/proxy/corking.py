"""Coalescing one proxy session's dispatcher flushes: several executes' tasks, one Enqueue.

A `pw` client sends its runs in batches, and the dispatcher sends each worker one `Enqueue` per
flush with every task it decided meanwhile. The jaxlib client sends each execute as its own
request, and each used to flush at once: one `Enqueue` with one task per call, one gRPC write on
the controller's event loop and one message, one executor wake-up and one round of XLA thread
wake-ups on the worker per call (bench/FINDINGS.md, 2026-11-25 22:54-23:22: ~600 µs of worker CPU per
call against ~40 µs for the same call batched through `pw`).

`FlushCork` holds the flush back while the session's requests keep coming, like TCP's
autocorking holds a socket's small writes while the application is still writing:

- a decision (a run or a release handed to the dispatcher) arms it; it flushes once the event
  loop has made `quiet_passes` passes without another decision of the session. An idle loop
  makes those passes at once (each pass has the next one ready, so it never sleeps): nothing
  waits for a timer, and the cost is a few callbacks;
- the hold is bounded however fast the requests come: `max_held` decisions, or `max_delay_s`
  since the first one held (read on the next pass: no timer), flush at once, so a device that
  is idle while the client issues a burst of long steps starts the first of them within
  about that time;
- `waiting` sends what is held at once: called before anything that waits on the workers (a
  readiness check, a download), so a blocking call never waits for the cork; and the session's
  next run goes at once too: a client that blocks on its results calls one at a time
  (op-by-op), so there is nothing to coalesce its next call with and holding it could only
  delay it. Releases in between (the client drops the previous call's arrays before its next
  call) do not go at once: they are held (armed as any decision) and leave with that run, in its
  `Enqueue`, one message to the worker per call instead of two.

Holding back a flush changes no order: the held runs go to the scheduler at the flush, in the
order they came, in one scheduler pass (cluster_backend.py: as a `pw` client's batch of runs),
and the dispatcher's outbox keeps each host's messages in that order; they leave in fewer
messages (its Outbox merges consecutive enqueues and releases into one), a few loop passes
later. A release is held behind every earlier run of the session from the moment the run was
submitted (client_session.py), decided or not. Other flushes of the dispatcher (another
client's, a worker's report) take the releases and decisions already made with them, which only
sends them earlier.
"""

from __future__ import annotations

import time
from collections.abc import Callable

QUIET_PASSES = 4  # event-loop passes without a new decision of the session before it flushes
MAX_HELD = 64  # decisions held at most before a flush
MAX_DELAY_S = 0.002  # the longest a decision is held (checked on the passes)


class FlushCork:
    """`flush`: the dispatcher's flush; `call_soon`: schedules a callback for the event loop's
    next pass (`loop.call_soon`); `clock`: monotonic seconds. No I/O of its own."""

    def __init__(self, flush: Callable[[], None], call_soon: Callable[[Callable[[], None]], object],
                 clock: Callable[[], float] = time.monotonic, quiet_passes: int = QUIET_PASSES,
                 max_held: int = MAX_HELD, max_delay_s: float = MAX_DELAY_S) -> None:
        self._flush = flush
        self._call_soon = call_soon
        self._clock = clock
        self.quiet_passes = quiet_passes
        self.max_held = max_held
        self.max_delay_s = max_delay_s
        self._since = 0.0  # when the first decision held came
        self.held = 0  # decisions since the last flush
        self._decisions = 0  # every decision so far (a pass sees whether one came)
        self._seen = 0
        self._quiet = 0
        self._armed = False
        self._round = 0  # counts flushes: a pass of an earlier round stops
        self._waited = False  # a call waited on the workers since the last decision
        self.flushes = 0

    def decided(self, run: bool = True) -> None:
        """A run (`run`) or a release or move was handed to the dispatcher (not flushed)."""
        self.held += 1
        self._decisions += 1
        if (run and self._waited) or self.held >= self.max_held:
            self._waited = False
            self.flush()
        elif not self._armed:
            self._armed = True
            self._since = self._clock()
            self._seen = self._decisions
            self._quiet = 0
            self._schedule()

    def _schedule(self) -> None:
        round_ = self._round
        self._call_soon(lambda: self._pass(round_))

    def _pass(self, round_: int) -> None:
        if not self._armed or round_ != self._round:
            return  # flushed meanwhile
        if self._decisions != self._seen:
            self._seen = self._decisions
            self._quiet = 0
        else:
            self._quiet += 1
        if self._quiet >= self.quiet_passes or self._clock() - self._since >= self.max_delay_s:
            self.flush()
        else:
            self._schedule()

    def waiting(self) -> None:
        """A call waits on the workers: flushes now, and the next decision flushes at once."""
        self._waited = True
        self.flush()

    def flush(self) -> None:
        """Sends what is held now (nothing held: nothing to do)."""
        self._armed = False
        self._round += 1  # a pass still scheduled sees it and stops (a new arming schedules its own)
        if self.held:
            self.held = 0
            self.flushes += 1
            self._flush()
