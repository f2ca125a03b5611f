"""The worker's buffer store: futures of arrays, with reference counts and owners.

A buffer is `pending` until its producer (a node on this worker, a client upload, a
transfer from another worker) supplies it, then `ready` or `failed`. It is freed
when nobody needs it any more: the client released it (or never held it: program
intermediates) and no enqueued consumer still has to read it. A release that comes
before the buffer exists leaves a tombstone so a late upload is dropped, not leaked.

Thread-safe: the executor thread, the completion thread and the gRPC handlers share it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from .buffer_entry import FAILED, PENDING, READY, BufferFailed, Entry, Latch, Recent, Waiting
from .computations import Computations
from .shards import held_nbytes

# client uploads freed, remembered so that a copy sent again after a broken stream (`again`) is
# not kept as a new buffer nobody will release; the oldest are forgotten first
MAX_FREED_UPLOADS = 16384
# intermediates of dropped runs that peers send here (`unwanted`), remembered so that a copy a
# late sender sends still is not held for a reader that will never come; the oldest go first
MAX_UNWANTED = 16384
# releases of buffers that did not exist yet (tombstones), kept so that a late upload or copy is
# dropped; beyond this many the oldest are forgotten (its producer, if it ever comes, is kept)
MAX_TOMBSTONES = 16384
# owners (clients, jobs) whose end this worker heard (`release_owner`), remembered so that what
# of theirs arrives later (an upload or a peer's copy in flight, a late enqueue) is not kept for
# a client that is gone: nothing would ever release it. The oldest are forgotten first.
MAX_ENDED_OWNERS = 4096


class BufferStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, Entry] = {}
        # threads blocked in wait_all(), per buffer: only a settling of that buffer counts them down
        self._waiters = Waiting()
        # waits for launched buffers' computations to be over (`when_computed`, the executor's
        # `computed`): under this lock, reading these entries
        self.computations = Computations(self._lock, self._entries)
        self._freed_uploads: Recent[int] = Recent(MAX_FREED_UPLOADS)
        self._unwanted: Recent[int] = Recent(MAX_UNWANTED)
        self._tombstones: Recent[int] = Recent(MAX_TOMBSTONES)  # their ids
        self._ended: Recent[str] = Recent(MAX_ENDED_OWNERS)
        # values set and entries forgotten so far (`activity`); new entries show in the entry count
        self._changes = 0
        # told each buffer `fail` settled as failed (outside the lock): the servicer drops the
        # parts it was gathering for it (parts.py, Gathering)
        self.on_failed: Callable[[int], None] | None = None
        # told each pending buffer that became `unread` (outside the lock): the servicer drops
        # the parts it was gathering for it, which nobody here would read
        self.on_unread: Callable[[int], None] | None = None

    # ---- declaring ----
    # A task declares every output and input at once, under one lock round trip: a training step
    # has hundreds (parameters and optimizer state), and per-buffer calls were a visible part of
    # the worker's time per step.
    def expect(self, buffer_ids: Sequence[int], owner: str, visible: Sequence[bool] = ()) -> None:
        """An enqueued node will produce these buffers; `visible[i]` keeps buffer i for the client."""
        keeps = list(visible)  # a protobuf repeated field is slow to index: read once, not per id
        if len(keeps) < len(buffer_ids):
            keeps.extend([False] * (len(buffer_ids) - len(keeps)))
        with self._lock:
            entries = self._entries
            ended = owner in self._ended  # once a task, not per buffer (`_new`)
            for buffer_id, keep in zip(buffer_ids, keeps, strict=False):
                e = entries.get(buffer_id)
                if e is None:  # the usual case: set up whole, in one constructor call
                    entries[buffer_id] = Entry(owner, released=True) if ended else Entry(owner, client_ref=keep)
                    continue
                if keep and not e.released:
                    e.client_ref = True
                if not e.owner:
                    e.owner = owner
                e.unread = False

    def add_consumers(self, buffer_ids: Sequence[int], owner: str = "") -> None:
        """An enqueued reader (a node, or a send to another worker) will read each of these once."""
        with self._lock:
            entries = self._entries
            ended = owner in self._ended  # once a task, not per buffer (`_new`)
            for buffer_id in buffer_ids:
                e = entries.get(buffer_id)
                if e is None:
                    e = entries[buffer_id] = Entry(owner, released=True) if ended else Entry(owner)
                e.consumers += 1
                e.hold = False
                e.unread = False

    def consumer_done(self, buffer_id: int) -> None:
        gone: list[Entry] = []  # freed under the lock, deallocated after it
        unread = False
        with self._lock:
            e = self._entries.get(buffer_id)
            if e is not None:
                e.consumers = max(0, e.consumers - 1)
                if e.state == PENDING and not e.released and not e.held:
                    e.unread = unread = True  # its last reader gave up before it existed
                self._maybe_free(buffer_id, e, gone)
        if unread and self.on_unread is not None:
            self.on_unread(buffer_id)

    # ---- producing ----
    def keep(self, buffer_id: int, owner: str) -> None:
        """A peer sends this buffer here (before or after this call) for `owner`'s client to
        keep, as an upload (worker.proto `BufferKeep`): held until released, unless it was."""
        with self._lock:
            e = self._entries.get(buffer_id)
            if e is None:
                e = self._new(buffer_id, owner)
            e.owner = e.owner or owner
            e.hold, e.unread = False, False  # arrived already (held for a reader): the client's now
            if not e.released:
                e.client_ref = True

    def put(
        self, buffer_id: int, value: Any, nbytes: int, *, owner: str = "", client_ref: bool = False,
        from_peer: bool = False, same_owner: bool = False, again: bool = False,
    ) -> bool:
        """Supplies a buffer's value. Client uploads pass client_ref=True; a transfer from
        another worker (from_peer) may overtake the enqueue of its reader, so it is held.
        With same_owner (a client's upload) a buffer recorded under another owner is left as it
        is and the answer is False. `again`: an upload sent again (worker.proto), dropped when
        this buffer settled already or was an upload freed since."""
        gone: list[Entry] = []  # freed under the lock, deallocated after it
        with self._lock:
            e = self._entries.get(buffer_id)
            if again and (e.state != PENDING if e is not None else buffer_id in self._freed_uploads):
                return True
            if e is None and from_peer and buffer_id in self._unwanted:
                del self._unwanted[buffer_id]
                return True  # an intermediate of a dropped run, sent late: nothing will read it
            if e is None:
                e = self._new(buffer_id, owner, hold=from_peer)
            elif same_owner and e.owner and e.owner != owner:
                return False
            e.owner = e.owner or owner
            if e.state == READY:
                return True  # a second copy of the same future: keep the first
            if client_ref and not e.released:
                e.client_ref = True
            e.uploaded = same_owner
            e.state, e.value, e.nbytes, e.error = READY, value, nbytes, ""
            self._changes += 1
            callbacks = e.take_callbacks()
            self._waiters.settle(buffer_id)
            self._maybe_free(buffer_id, e, gone)
        for cb in callbacks:
            cb()
        return True

    def unhold(self, buffer_ids: Sequence[int]) -> None:
        """No reader will come for these peers' copies held for one (`put` from_peer): their run
        was dropped before its reader here was sent. Each goes unless a reader or the client holds it."""
        gone: list[Entry] = []  # freed under the lock, deallocated after it
        with self._lock:
            for buffer_id in buffer_ids:
                e = self._entries.get(buffer_id)
                if e is not None and e.hold:
                    e.hold = False
                    self._maybe_free(buffer_id, e, gone)

    def unwanted(self, buffer_ids: Sequence[int]) -> None:
        """Intermediates of dropped runs that peers send here (controller.proto Drop.unread_ids):
        their readers are gone and no other run reads them, so a copy that comes from now on is
        not kept. A worker frozen past its host's loss sends the output of the node it was
        computing once it goes on, before it hears that its runs were dropped; held for a reader
        (`put` from_peer), that copy would stay for good (nothing else releases it)."""
        with self._lock:
            for buffer_id in buffer_ids:
                self._unwanted.add(buffer_id)

    def never_made(self, buffer_ids: Sequence[int], error: str) -> None:
        """Their producer's run failed before it started: each one pending here (a send to a
        reader, a wait) fails with `error` (`fail`: one settled already stays as it is); an id
        this worker never heard of is left unknown (`fail` would record it)."""
        for buffer_id in buffer_ids:
            with self._lock:
                known = buffer_id in self._entries
            if known:
                self.fail(buffer_id, error)

    def fail(self, buffer_id: int, error: str) -> None:
        with self._lock:
            e = self._entries.get(buffer_id)
            if e is None:
                e = self._entries[buffer_id] = Entry()
            if e.state != PENDING:
                return
            callbacks = self._failed(buffer_id, e, error)
        if self.on_failed is not None:
            self.on_failed(buffer_id)
        for cb in callbacks:
            cb()

    def _failed(self, buffer_id: int, e: Entry, error: str) -> list[Callable[[], None]]:
        """Settles a pending entry as failed (call with the lock held): its waiters woken, the
        entry freed if nothing holds it; the callbacks to call once the lock is released."""
        e.state, e.error, e.value = FAILED, error, None
        self._changes += 1
        callbacks = e.take_callbacks()
        self._waiters.settle(buffer_id)
        self._maybe_free(buffer_id, e, [])  # its value is gone already: nothing to deallocate
        return callbacks

    def refuse(self, buffer_id: int, owner: str, error: str, *, held: bool) -> None:
        """`owner`'s upload of this buffer was refused, or cut off before its last byte: whatever
        reads it fails with `error` instead of waiting for bytes that will not come. `held` (an
        upload refused whole): kept for the client as the array would have been, so a reader
        enqueued later sees the reason too, until the client releases it. Otherwise it is kept
        only while something already waits for it (a staged upload cut off unused, as the proxy
        drops one, leaves nothing). A buffer already settled, or recorded under another owner,
        is left as it is."""
        with self._lock:
            e = self._entries.get(buffer_id)
            if e is None:
                if not held and buffer_id not in self._waiters:
                    return
                e = self._new(buffer_id, owner)
            elif e.state != PENDING or (e.owner and e.owner != owner):
                return
            e.owner = e.owner or owner
            if (held or buffer_id in self._waiters) and not e.released:
                e.client_ref = True
            callbacks = self._failed(buffer_id, e, error)
        for cb in callbacks:
            cb()

    def consumed(self, buffer_ids: Sequence[int], error: str) -> None:
        """These ready buffers were donated to a computation and no longer exist: a later reader
        (or fetch) fails with `error` instead of handing XLA a deleted array."""
        with self._lock:
            for buffer_id in buffer_ids:
                e = self._entries.get(buffer_id)
                if e is not None and e.state == READY:
                    e.state, e.error, e.value, e.nbytes = FAILED, error, None, 0
                    self._changes += 1

    def launched(self, output_ids: Sequence[int], values: Sequence[Any], input_ids: Sequence[int],
                 sizes: Sequence[int] | None = None) -> int:
        """A node was launched: its outputs exist (still computing) and it no longer needs
        its inputs. One lock round trip for the whole node (the executor's hot path). `sizes`
        are the outputs' bytes where the caller knows them (reading each array's is ~1 µs);
        returns their sum."""
        callbacks: list[Callable[[], None]] = []
        total = 0
        if sizes is None:
            sizes = [held_nbytes(v) for v in values]
        gone: list[Entry] = []  # freed under the lock, deallocated after it
        with self._lock:
            self._changes += 1
            entries = self._entries
            # nothing that runs under the lock adds a wait: looked at once, not per output
            settle = self._waiters.settle if self._waiters.by_id else None
            for buffer_id, value, nbytes in zip(output_ids, values, sizes, strict=False):
                total += nbytes
                e = entries.get(buffer_id)
                if e is None:
                    e = entries[buffer_id] = Entry()
                if e.state == READY:
                    continue
                e.state = READY
                e.value = value
                e.nbytes = nbytes
                e.error = ""
                e.launched = True
                if e.callbacks:
                    callbacks.extend(e.take_callbacks())
                if settle is not None:
                    settle(buffer_id)
                if not (e.client_ref or e.consumers or e.hold):  # not Entry.held, inline (usually it is)
                    self._maybe_free(buffer_id, e, gone)
            for buffer_id in input_ids:
                e = entries.get(buffer_id)
                if e is not None:
                    if e.consumers > 0:
                        e.consumers -= 1
                    if not (e.client_ref or e.consumers or e.hold):  # not Entry.held, inline
                        self._maybe_free(buffer_id, e, gone)
        for cb in callbacks:
            cb()
        return total

    def pending_of(self, buffer_ids: Sequence[int]) -> list[int]:
        """The ids among these that exist and are still pending (unknown ids count as settled:
        the launch reports them)."""
        with self._lock:
            entries = self._entries
            out = [b for b in buffer_ids if (e := entries.get(b)) is not None and e.state == PENDING]
        return list(dict.fromkeys(out)) if len(out) > 1 else out

    # ---- reading ----
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

    def waiting_ids(self) -> int:
        """How many buffer ids have waits on them (tests: waits that ended leave nothing)."""
        with self._lock:
            return len(self._waiters)

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

    def settled(self, buffer_id: int) -> bool:
        """Whether the buffer exists and is ready or failed (no wait)."""
        with self._lock:
            return self._settled(buffer_id, must_exist=False)

    def _settled(self, buffer_id: int, must_exist: bool = True) -> bool:
        e = self._entries.get(buffer_id)
        if e is None:
            return must_exist
        return e.state != PENDING

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

    # ---- releasing ----
    def release(self, buffer_ids: Sequence[int], owner: str = "") -> None:
        """The client dropped these buffers (some maybe before they exist: tombstones, which are
        `owner`'s: they go with its other buffers, `release_owner`; the oldest go beyond
        MAX_TOMBSTONES, whoever their owner, as nothing else would end one whose producer never
        comes: a run dropped before it reached this worker, a controller that died)."""
        gone: list[Entry] = []  # freed under the lock, deallocated after it
        with self._lock:
            for buffer_id in buffer_ids:
                e = self._entries.get(buffer_id)
                if e is None:
                    self._entries[buffer_id] = Entry(owner, released=True)
                    for old in self._tombstones.add(buffer_id):  # the oldest go (some became live since)
                        forgotten = self._entries.get(old)
                        if forgotten is not None and forgotten.tombstone:
                            del self._entries[old]
                            self._changes += 1
                    continue
                e.released, e.client_ref = True, False
                self._maybe_free(buffer_id, e, gone)

    def _new(self, buffer_id: int, owner: str, hold: bool = False) -> Entry:
        """A new entry (call with the lock held). One of an owner that ended here is released
        from the start and never held: it goes once produced and read (`_maybe_free`)."""
        if owner and owner in self._ended:
            e = self._entries[buffer_id] = Entry(owner, released=True)
        else:
            e = self._entries[buffer_id] = Entry(owner, hold=hold)
        return e

    def release_owner(self, owner: str) -> int:
        """Drops every client reference held by `owner` (a client or job went away), and its
        tombstones: nothing of its can come that a client of it would read. What of its arrives
        later is not kept either (`_new`)."""
        gone: list[Entry] = []  # freed under the lock, deallocated after it
        with self._lock:
            if owner:
                self._ended.add(owner)
            ids = [i for i, e in self._entries.items() if e.owner == owner]
            for i in ids:
                e = self._entries[i]
                e.released, e.client_ref = True, False
                if e.tombstone:
                    del self._entries[i]
                    self._changes += 1
                    self._tombstones.pop(i, None)
                    continue
                self._maybe_free(i, e, gone)
            return len(ids)

    def tombstones(self) -> int:
        """How many tombstones the store keeps (tests, the worker's stats)."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.released and e.state == PENDING)

    def _maybe_free(self, buffer_id: int, e: Entry, gone: list[Entry]) -> None:
        """Forgets the buffer when nobody needs it any more. Its entry goes to `gone`, which the
        caller drops after leaving the lock: dropping the last reference to a JAX array runs
        XLA's deallocation (tens of µs, more while a computation still reads it), which must not
        keep the launch thread waiting for the lock. One that something holds stays: `Entry.held`,
        spelled out here and in `launched` (which calls this only where it is false) so that the
        hot path (`launched`, `release`) pays no call per array; tests/test_buffers.py checks that
        the copies agree with it."""
        if e.client_ref or e.consumers or e.hold:  # Entry.held, inline
            return
        if e.state == PENDING and not e.released:
            return  # produced later for a reader that has not been enqueued yet
        if e.state == PENDING and e.released and not e.callbacks:
            return  # tombstone: keep until the upload arrives, then drop it
        del self._entries[buffer_id]
        self._changes += 1
        gone.append(e)
        if self._tombstones:
            self._tombstones.pop(buffer_id, None)
        if e.uploaded:
            self._freed_uploads.add(buffer_id)

    # ---- stats ----
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
