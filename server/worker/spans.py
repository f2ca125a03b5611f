"""When each task of a completed batch ran, for the controller's device-time accounting.

One wait completes a whole batch, so per-task times are not known: the time the batch's devices
were busy is split over its tasks by their node counts, in launch order, per device set. (The
controller charges device time from these spans; giving it all to the batch's first task would
bill one client for everyone's work and break proportional share.) Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence


class DeviceSpans:
    """Per device set, when its last batch ended (a batch starts no earlier)."""

    def __init__(self) -> None:
        self._busy_until: dict[frozenset[int], int] = {}

    def split(self, tasks: Sequence[tuple[frozenset[int], int, int]], end_ns: int) -> list[tuple[int, int]]:
        """(start, end) in ns of each (devices, launched at ns, node count) of a batch that
        completed at `end_ns`, in the order given (launch order)."""
        first: dict[frozenset[int], int] = {}
        counts: dict[frozenset[int], int] = {}
        for devices, start, size in tasks:
            first[devices] = min(first.get(devices, start), start)
            counts[devices] = counts.get(devices, 0) + size
        cursor: dict[frozenset[int], float] = {}
        steps: dict[frozenset[int], float] = {}
        for devices, start in first.items():
            cursor[devices] = max(start, self._busy_until.get(devices, 0))
            steps[devices] = max(0, end_ns - cursor[devices]) / counts[devices]
            self._busy_until[devices] = end_ns
        out = []
        for devices, _, size in tasks:
            span = steps[devices] * size
            out.append((int(cursor[devices]), int(cursor[devices] + span)))
            cursor[devices] += span
        return out
