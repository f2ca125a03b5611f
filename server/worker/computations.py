"""Waits for launched buffers' computations to be over: launched is not computed.

A launch's outputs are `ready` in the buffer store (buffers.py) as soon as the executor launched
them, while XLA may still be computing them. A wait for their computation (worker.proto's Wait
with `computed`, waits.py) registers a latch here, which the executor's completion thread counts
down (`computed`), so that no thread blocks on it. The latches share the store's lock and read
its entries: whether a buffer is a launch's output, ready, and still computing is decided under
the same lock that settles it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from .buffer_entry import READY, Entry, Latch, Waiting
from .readiness import computed_now


class Computations:
    """The computation latches of one buffer store, under that store's lock."""

    def __init__(self, lock: threading.Lock, entries: dict[int, Entry]) -> None:
        self._lock = lock
        self._entries = entries  # the store's, read under its lock
        self._waiting = Waiting()  # per buffer

    def when_computed(self, buffer_ids: Sequence[int], callback: Callable[[], None]) -> Latch | bool:
        """Calls `callback` once the computations behind these ready buffers are over, from the
        thread that completes the last (the executor's, through `computed`), so that a wait for
        them holds no thread. True when they are all computed already (then it is not called);
        False when one is not a launch's output (an upload, a peer's array: not the executor's to
        complete) or is not ready: the caller waits on the values itself. `forget_computed`
        forgets the latch."""
        with self._lock:
            computing = []
            for b in dict.fromkeys(buffer_ids):
                e = self._entries.get(b)
                if e is None or e.state != READY or not e.launched:
                    return False
                if computed_now(e.value) is not False:  # computed; or deleted, failed: not waited for here
                    continue
                computing.append(b)  # `computed(b)` comes after this: it follows readiness, under the lock
            if not computing:
                return True
            latch = Latch(len(computing), callback)
            self._waiting.add(computing, latch)
            return latch

    def computed(self, buffer_ids: Iterable[int]) -> None:
        """(the executor, once these launched buffers' computations are over, failed or not)"""
        if not self._waiting.by_id:  # nobody waits (the hot path: no lock)
            return
        with self._lock:
            for b in buffer_ids:
                self._waiting.settle(b)

    def forget_computed(self, buffer_ids: Sequence[int], latch: Latch) -> None:
        with self._lock:
            latch.callback = None
            self._waiting.remove(dict.fromkeys(buffer_ids), latch)
