"""What the listings' encoded-entry caches share (device_rows.py, host_rows.py): the clock a
ready host's last beat is shown by, and one cache per cluster object, ready for a listing."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Container
from typing import TypeVar

from .cluster import Cluster

CLOCK_STEP_S = 0.05  # a change of wall minus monotonic time beyond this is a step of the clock


class ListingRows:
    """Base of a listing's per-host cache: `_offset` is wall minus monotonic time, so a ready
    host's last beat is shown as its monotonic `last_seen` plus it; it is read again only when the
    wall clock stepped, so a host's kept entry stays valid until the host changes."""

    def __init__(self) -> None:
        self._offset = time.time() - time.monotonic()

    def begin(self) -> None:
        """Called once per listing: notices a step of the wall clock (the shown beats move)."""
        offset = time.time() - time.monotonic()
        if abs(offset - self._offset) > CLOCK_STEP_S:
            self._offset = offset

    def forget(self, names: Container[str]) -> None:
        """Drops the entries of hosts not in `names` (no longer in the cluster)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


R = TypeVar("R", bound=ListingRows)


def rows_for(registry: weakref.WeakKeyDictionary[Cluster, R], cluster: Cluster, make: Callable[[], R]) -> R:
    """The cluster's cache in `registry` (one per cluster object, gone with it), its departed
    hosts' entries dropped, ready for a listing."""
    rows = registry.get(cluster)
    if rows is None:
        rows = registry[cluster] = make()
    elif len(rows) > len(cluster.hosts):
        rows.forget(cluster.hosts)
    rows.begin()
    return rows


def stamp(at: float) -> str:
    """A wall time as `timeutil.iso` writes it (UTC, milliseconds)."""
    sec = int(at)
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(sec))}.{int((at - sec) * 1000):03d}Z"
