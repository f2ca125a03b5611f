"""What the scheduler counts for metrics: runs finished, hangs detected, latency histograms.

Plain integers and lists, updated once per finished run (a bisect and two increments): no lock,
no allocation, nothing per computation. The metrics endpoint reads them at scrape time on the
controller's event loop, the same thread that updates them.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# Upper bounds (seconds) of the latency buckets: a run of a small program finishes in well under a
# millisecond of controller time, a gang that waits for a window or a slow host takes seconds.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)


@dataclass(slots=True)
class Histogram:
    """Counts per bucket (`bounds[i]` is bucket i's upper bound; the last count is +Inf)."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs as Prometheus wants them, "+Inf" last."""
        out, running = [], 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass(slots=True)
class RunStats:
    runs_ok: int = 0
    runs_failed: int = 0
    hangs_detected: int = 0
    run_latency: Histogram = field(default_factory=Histogram)  # submit (arrival) to finish
    admission_wait: Histogram = field(default_factory=Histogram)  # submit to admission

    def finished(self, ok: bool, submitted_at: float, admitted_at: float | None, now: float) -> None:
        if ok:
            self.runs_ok += 1
        else:
            self.runs_failed += 1
        self.run_latency.observe(max(0.0, now - submitted_at))
        if admitted_at is not None:
            self.admission_wait.observe(max(0.0, admitted_at - submitted_at))
