"""Remapping: slices attach to and detach from devices, broken slices are re-placed or degraded,
degraded slices are tried again when capacity may have returned."""

from __future__ import annotations

from dataclasses import replace

from server.resource_manager.models import (
    Action,
    RemapRecord,
    Slice,
    SliceDegraded,
    SliceRemapped,
    SliceRestored,
    SliceStatus,
    _Unplaceable,
)
from server.resource_manager.placement import Placer

MAX_AUTO_SEQ = 2**53


class Remapper(Placer):
    """The transitions of placed and degraded slices."""

    def _attach(self, s: Slice) -> None:
        for d in s.mapping:
            self._load[d] = self._load.get(d, 0) + 1
            if s.request.exclusive:
                self._exclusive[d] = s.name

    def _detach(self, s: Slice) -> None:
        for d in s.mapping:
            self._load[d] -= 1
            if not self._load[d]:
                del self._load[d]
            if self._exclusive.get(d) == s.name:
                del self._exclusive[d]

    def _remove(self, s: Slice) -> None:
        if s.status is not SliceStatus.DEGRADED:
            self._detach(s)
        del self._slices[s.name]

    def _broken(self, s: Slice) -> bool:
        """A placed slice whose devices went unhealthy or moved under its filters (re-registration)."""
        if any(d not in self._healthy for d in s.mapping):
            return True
        devs = [self._devices[d] for d in s.mapping]
        return (
            len({d.island for d in devs}) > 1
            or (s.request.island is not None and any(d.island != s.request.island for d in devs))
            or (s.request.kind is not None and any(d.kind != s.request.kind for d in devs))
        )

    def _repair(self, cause: str) -> list[Action]:
        """Re-place every broken placed slice, in creation order; degrade those that do not fit."""
        actions: list[Action] = []
        for s in [s for s in self._placed() if self._broken(s)]:
            self._detach(s)
            placed = self._place(s.request, prefer=s.mapping)
            if isinstance(placed, _Unplaceable):
                reason = f"{cause}; {placed.reason}"
                new = replace(s, status=SliceStatus.DEGRADED, reason=reason)
                self._slices[s.name] = new
                actions.append(SliceDegraded(new, reason))
                continue
            new = _remapped(s, placed.mapping, cause)
            self._slices[s.name] = new
            self._attach(new)
            actions.append(SliceRemapped(new, s.mapping, cause))
        return actions

    def _retry_degraded(self, trigger: str, skip: frozenset[str] = frozenset()) -> list[Action]:
        """Try to place every degraded slice again, in creation order; failures stay as they are."""
        actions: list[Action] = []
        for s in list(self._slices.values()):
            if s.status is not SliceStatus.DEGRADED or s.name in skip:
                continue
            placed = self._place(s.request, prefer=s.mapping)
            if isinstance(placed, _Unplaceable):
                continue
            if placed.mapping == s.mapping:
                new = replace(s, status=SliceStatus.READY, reason="", generation=s.generation + 1)
            else:
                new = _remapped(s, placed.mapping, trigger)
            self._slices[s.name] = new
            self._attach(new)
            actions.append(SliceRestored(new))
        return actions

    @staticmethod
    def _degraded_names(actions: list[Action]) -> frozenset[str]:
        return frozenset(a.slice.name for a in actions if isinstance(a, SliceDegraded))

    def _next_auto_name(self) -> str:
        """The next "slice-N": past every one this manager has held (`_auto_seq`) and any taken."""
        seq = self._auto_seq + 1
        while f"slice-{seq}" in self._slices:
            seq += 1
        return f"slice-{seq}"

    def _held_name(self, name: str) -> None:
        """Records that a slice named `name` exists (an automatic name, or one chosen like it)."""
        seq = auto_name_seq(name)
        if seq is not None:
            self._auto_seq = max(self._auto_seq, seq)


def auto_name_seq(name: str) -> int | None:
    """N for a name "slice-N" that automatic naming could give (N up to 2**53, so it stays an
    integer every database holds); None for any other name."""
    if name.startswith("slice-") and name[6:].isascii() and name[6:].isdigit():
        seq = int(name[6:])
        return seq if seq <= MAX_AUTO_SEQ else None
    return None


def _remapped(s: Slice, mapping: tuple[int, ...], reason: str) -> Slice:
    """`s` moved onto `mapping` for `reason`: status REMAPPED, the move in its history, one generation on."""
    return replace(s, mapping=mapping, status=SliceStatus.REMAPPED, reason=reason,
                   history=(*s.history, RemapRecord(s.mapping, mapping, reason)), generation=s.generation + 1)
