"""A map of bounded size that forgets its oldest entries (the runtime's failed runs)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Bounded(OrderedDict[K, V]):
    """An OrderedDict of at most `limit` entries: an insertion past the limit forgets the oldest
    insertions. Every insertion (`d[k] = v`, `update`, `setdefault`) goes through `__setitem__`,
    which keeps the bound; insertions from several threads keep it too. Setting a key already
    present keeps its place."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a bounded map holds at least one entry, not {limit}")
        super().__init__()
        self.limit = limit
        self._lock = threading.Lock()

    def __setitem__(self, key: K, value: V) -> None:
        with self._lock:
            super().__setitem__(key, value)
            while len(self) > self.limit:
                self.popitem(last=False)
