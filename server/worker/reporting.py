"""When a worker tells the controller what it ran.

Each finished task is a `NodeEvent` for the controller: it frees room in the island's window,
ends runs, and charges device time to fair shares. Sending every event at once wakes the
worker's event loop, the controller and the client once per computation. On two shared cores,
where XLA's four CPU device threads meet in a rendezvous per collective, that burst of wake-ups
lands just as the next computation starts. A back-to-back run of 12 ms all-reduce loops lost
10-20% to it: 0.78-0.86x plain JAX with events sent within 5 ms, 0.91-1.00x within 50 ms
(bench_dispatch's fused all-reduce).

Nobody waits for a report while the worker still has work queued. Clients wait on the worker
itself (Wait, Fetch), and arrays move worker to worker. So the worker holds events while it is
busy. It sends them at once when someone may be waiting, or when holding them would cost:
  - a task failed (its run fails everywhere now, not later);
  - a task of a sequential-dispatch run finished (the controller sends the run's next node only
    then);
  - the worker is about to run dry: the controller must learn in time to admit more work (a
    small `--window`, or a run waiting for an empty island);
  - `max_events` are held, which bounds how far the controller's view of the window lags;
  - the held tasks' outputs reach `max_bytes`: a buffer the client drops is freed only once the
    controller knows that every run submitted before the drop has finished, so holding reports
    of big outputs would hold memory.
Otherwise it sends them `max_delay_s` after the first one. Two sends are at least
`min_interval_s` apart, so that a burst of completions leaves as one message; except where the
controller waits for the event itself (a task sent `report_promptly`: a sequential-dispatch run's
node, whose successor is sent only then, or a run an IFRT proxy client blocks on, whose readiness
check the controller answers from the run's end): that one goes at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from schemas.pathways.v1 import controller_pb2 as cpb


@dataclass(frozen=True)
class ReportPolicy:
    max_delay_s: float = 0.05
    max_events: int = 64
    low_water: int = 2  # tasks left on the worker (queued, waiting or computing) at or below which events go now
    min_interval_s: float = 0.005
    max_bytes: int = 4 << 20


class EventBuffer:
    """Node events waiting to be sent, and when they are due. `add` is called from the
    executor's threads, `due_in` and `take` from the sender (the worker's event loop)."""

    def __init__(self, policy: ReportPolicy = ReportPolicy(), clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self._lock = threading.Lock()
        self._events: list[cpb.NodeEvent] = []
        self._bytes = 0
        self._first_at = 0.0
        self._urgent = False
        self._prompt = False  # a held event the controller waits for: not held for min_interval_s
        self._last_sent = float("-inf")

    def add(self, events: Sequence[cpb.NodeEvent], prompt: bool = False, backlog: int | None = None,
            nbytes: int = 0) -> bool:
        """Holds `events`; True when the sender should look now (the buffer was empty, so its
        deadline is new, or the events became urgent).

        `prompt`: someone waits for these (a sequential-dispatch run). `backlog`: tasks the
        worker still has (None: unknown, e.g. 'started' events for hang detection). `nbytes`:
        the size of the finished tasks' outputs."""
        if not events:
            return False
        p = self.policy
        urgent = (prompt or (backlog is not None and backlog <= p.low_water)
                  or any(e.end_ns and not e.ok for e in events))
        with self._lock:
            first = not self._events
            if first:
                self._first_at = self.clock()
            self._events.extend(events)
            self._bytes += nbytes
            was_urgent, was_prompt = self._urgent, self._prompt
            self._urgent = was_urgent or urgent or len(self._events) >= p.max_events or self._bytes >= p.max_bytes
            self._prompt = was_prompt or prompt
            return first or (self._urgent and not was_urgent) or (self._prompt and not was_prompt)

    def due_in(self) -> float | None:
        """Seconds until the held events are due (0: now); None when nothing is held."""
        with self._lock:
            if not self._events:
                return None
            if self._prompt:
                return 0.0
            now = self.clock()
            at = self._last_sent + self.policy.min_interval_s
            if not self._urgent:
                at = max(at, self._first_at + self.policy.max_delay_s)
            return max(0.0, at - now)

    def take(self) -> list[cpb.NodeEvent]:
        """Everything held, now sent."""
        with self._lock:
            events, self._events = self._events, []
            self._bytes = 0
            self._urgent = self._prompt = False
            self._last_sent = self.clock()
            return events

    def __len__(self) -> int:
        return len(self._events)
