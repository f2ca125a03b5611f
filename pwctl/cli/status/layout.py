"""How many rows each section of the status screen gets (pure: no rendering, no I/O).

A section holds `total` items of `height` rows each, under `header` rows. Shown with `k` items
it costs its header, the items, and one "... and N more" line when some are left out; shown
with none it is a one-line summary (an empty section costs nothing). The screen's rows go first
to a few items of every section, in priority order, then to the rest, section by section.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Section:
    name: str
    total: int
    first: int  # items every section gets before any section gets more (room permitting)
    height: int = 1
    header: int = 1
    shown: int = 0

    def cost(self, k: int | None = None) -> int:
        k = self.shown if k is None else k
        if self.total == 0:
            return 0
        if k == 0:
            return 1
        return self.header + k * self.height + (1 if k < self.total else 0)

    @property
    def hidden(self) -> int:
        return self.total - self.shown


def allocate(sections: list[Section], rows: int | None, fill_order: list[str] | None = None) -> int:
    """Sets each section's `shown` so that their costs fit `rows` (None: no limit, all shown).
    First every section, in list order, gets up to its `first` items; then the sections named
    by `fill_order` (default: list order) get the rest. Returns the rows left over."""
    if rows is None:
        for s in sections:
            s.shown = s.total
        return 0
    for s in sections:
        s.shown = 0
    left = rows - sum(s.cost() for s in sections)
    by_name = {s.name: s for s in sections}
    order = [by_name[n] for n in fill_order] if fill_order else sections
    for cap_of, group in ((lambda s: min(s.total, s.first), sections), (lambda s: s.total, order)):
        for s in group:
            cap = cap_of(s)
            while s.shown < cap:
                extra = s.cost(s.shown + 1) - s.cost()
                if extra > left:
                    break
                left -= extra
                s.shown += 1
    return left
