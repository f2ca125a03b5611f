"""When the worker connects to the controller again after a failed or ended connection."""

from __future__ import annotations

__all__ = ["Reconnect"]


class Reconnect:
    """How long the worker waits before connecting to the controller again.

    While the controller cannot be reached (it is starting, as under `pwctl up`, which starts the
    workers with it, or restarting) the worker tries again every `fast_s` for `fast_for_s`, so it
    registers within tens of milliseconds of the controller listening; a refused attempt costs
    well under a millisecond of CPU. After that, and while the controller rejects the worker (a
    bad token, an invalid registration), the wait doubles up to `max_s`.
    """

    def __init__(self, max_s: float, fast_s: float = 0.05, fast_for_s: float = 5.0) -> None:
        self.max_s, self.fast_s, self.fast_for_s = max_s, fast_s, fast_for_s
        self._failing_since: float | None = None  # first failure since the last connection
        self._wait = fast_s

    def connected(self) -> None:
        self._failing_since = None
        self._wait = self.fast_s

    def delay(self, now: float, rejected: bool = False) -> float:
        """The wait after a connection that failed or ended at time `now`; `rejected`: the
        controller answered with an error (anything but UNAVAILABLE)."""
        if self._failing_since is None:
            self._failing_since = now
            self._wait = self.fast_s
            return self._wait
        if not rejected and now - self._failing_since < self.fast_for_s:
            return self.fast_s
        self._wait = min(max(self._wait * 2, self.fast_s), self.max_s)
        return self._wait
