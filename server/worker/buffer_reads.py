"""The reading side of the worker's buffer store (buffers.py): its entries under one lock, waits for
buffers to settle and their values, and looks at their state.

A wait blocks a thread (`wait_all`: the launch thread for a node's inputs; with a timeout of 0, a
read of values that settled) or calls back from the thread that settles the last of its buffers
(`watch`: the worker's RPC handlers, which hold no thread; `on_settled`: a launch or a send put off
until its input exists). A client's fetch may overtake the enqueue that declares its buffer, so an
unknown buffer can be waited for (`must_exist=False`), where a node's input that does not exist
fails. Nothing here changes a buffer: the store (`BufferStore`, a subclass) declares, produces,
fails and frees them, and settles the waits recorded here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from .buffer_entry import FAILED, PENDING, READY, BufferFailed, Entry, Latch, Waiting


class BufferReads:
    """A buffer store's entries under its lock, and what reads them (buffers.py `BufferStore`
    adds what changes them). Thread-safe, as the store is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, Entry] = {}
        # threads blocked in wait_all(), per buffer: only a settling of that buffer counts them down
        self._waiters = Waiting()
        # values set and entries forgotten so far (`activity`); new entries show in the entry count
        self._changes = 0

    # ---- waiting ----
    def pending_of(self, buffer_ids: Sequence[int]) -> list[int]:
        """The ids among these that exist and are still pending (unknown ids count as settled:
        the launch reports them)."""
        with self._lock:
            entries = self._entries
            out = [b for b in buffer_ids if (e := entries.get(b)) is not None and e.state == PENDING]
        return list(dict.fromkeys(out)) if len(out) > 1 else out

    def wait(self, buffer_id: int, timeout: float | None = None, must_exist: bool = True) -> Any:
        """Blocks until the buffer is ready; raises BufferFailed or TimeoutError (see `wait_all`)."""
        return self.wait_all((buffer_id,), timeout, must_exist)[0]

    def wait_all(self, buffer_ids: Sequence[int], timeout: float | None = None, must_exist: bool = True) -> list[Any]:
        """Blocks until every buffer is ready; their values. Raises BufferFailed when one failed or
        does not exist (any more), TimeoutError when one is still pending after `timeout`.

        With must_exist=False (a client fetch, which may overtake the enqueue that declares the
        buffer) an unknown id is waited for instead of failing."""
        with self._lock:
            entries = self._entries
            values = []
            for b in buffer_ids:  # the usual case first: all ready, one pass
                e = entries.get(b)
                if e is None or e.state != READY:
                    break
                values.append(e.value)
            else:
                return values
            pending = [b for b in dict.fromkeys(buffer_ids) if not self._settled(b, must_exist)]
            if not pending:
                return self._values(buffer_ids)
            latch = Latch(len(pending))
            self._waiters.add(pending, latch)
        latch.event.wait(timeout)
        with self._lock:
            if latch.left > 0:
                self._waiters.remove(pending, latch)
            late = next((b for b in pending if not self._settled(b, must_exist)), None)
            if late is not None:
                raise TimeoutError(f"buffer {late} is not ready after {timeout} s")
            return self._values(buffer_ids)

    def watch(self, buffer_ids: Sequence[int], callback: Callable[[], None],
              must_exist: bool = False) -> Latch | None:
        """Calls `callback` once every buffer settled (ready, failed, or gone), from the thread that
        settles the last; None when all are settled already (then it is not called). Unknown ids
        are waited for (a fetch may overtake the enqueue that declares them) unless `must_exist`,
        when they count as settled (gone). No thread blocks:
        the worker's RPC handlers wait on an asyncio future the callback completes, so a caller
        that gives up (cancels, times out) costs nothing; `unwatch` forgets the latch."""
        with self._lock:
            pending = [b for b in dict.fromkeys(buffer_ids) if not self._settled(b, must_exist=must_exist)]
            if not pending:
                return None
            latch = Latch(len(pending), callback)
            self._waiters.add(pending, latch)
            return latch

    def unwatch(self, buffer_ids: Sequence[int], latch: Latch) -> None:
        with self._lock:
            latch.callback = None
            self._waiters.remove(dict.fromkeys(buffer_ids), latch)

    def on_settled(self, buffer_id: int, cb: Callable[[], None]) -> None:
        """Calls cb (from whichever thread settles it) once the buffer is ready or failed."""
        with self._lock:
            e = self._entries.get(buffer_id)
            if e is not None and e.state == PENDING:
                if e.callbacks is None:
                    e.callbacks = [cb]
                else:
                    e.callbacks.append(cb)
                return
        cb()

    def settled(self, buffer_id: int) -> bool:
        """Whether the buffer exists and is ready or failed (no wait)."""
        with self._lock:
            return self._settled(buffer_id, must_exist=False)

    def _settled(self, buffer_id: int, must_exist: bool = True) -> bool:
        e = self._entries.get(buffer_id)
        if e is None:
            return must_exist
        return e.state != PENDING

    def _values(self, buffer_ids: Sequence[int]) -> list[Any]:
        """The values of settled buffers (call with the lock held); BufferFailed for the first
        that failed or does not exist."""
        out = []
        for buffer_id in buffer_ids:
            e = self._entries.get(buffer_id)
            if e is None:
                raise BufferFailed(f"buffer {buffer_id} does not exist (released or never produced)")
            if e.state == FAILED:
                raise BufferFailed(e.error)
            assert e.state == READY, "read only once every buffer settled, under the same lock"
            out.append(e.value)
        return out

    def waiting_ids(self) -> int:
        """How many buffer ids have waits on them (tests: waits that ended leave nothing)."""
        with self._lock:
            return len(self._waiters)

    # ---- looking ----
    def owner_of(self, buffer_id: int) -> str | None:
        """The owner recorded for a buffer ("" when none was), None when the store has no entry."""
        with self._lock:
            e = self._entries.get(buffer_id)
            return None if e is None else e.owner

    def gathering_over(self, buffer_id: int) -> bool:
        """Whether parts arriving for this buffer can no longer make it: it settled already
        (ready or failed) or the client released it before it existed."""
        with self._lock:
            e = self._entries.get(buffer_id)
            return e is not None and (e.state != PENDING or e.released)

    def unread(self, buffer_id: int) -> bool:
        """Whether the buffer is pending and `unread`: the readers enqueued here all ended before
        it existed, and neither the client nor a new reader holds it."""
        with self._lock:
            e = self._entries.get(buffer_id)
            return e is not None and e.unread and e.state == PENDING and not e.held

    def released(self, buffer_id: int) -> bool:
        """Whether the client released this buffer before it existed (a tombstone)."""
        with self._lock:
            e = self._entries.get(buffer_id)
            return e is not None and e.released and e.state == PENDING

    def tombstones(self) -> int:
        """How many tombstones the store keeps (tests, the worker's stats)."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.released and e.state == PENDING)

    def activity(self) -> tuple[int, int]:
        """A value that changes whenever a buffer is added, settles or goes (the worker's idle
        trimmer looks every half second): O(1), where `stats` reads every entry (tens of
        thousands while a client's steps are queued: milliseconds under the lock)."""
        with self._lock:
            return len(self._entries), self._changes

    def stats(self) -> tuple[int, int]:
        """(live buffers, bytes), not counting tombstones."""
        with self._lock:
            live = [e for e in self._entries.values() if not (e.released and e.state == PENDING)]
            return len(live), sum(e.nbytes for e in live)
