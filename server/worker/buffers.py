"""The worker's buffer store: futures of arrays, with reference counts and owners.

A buffer is `pending` until its producer (a node on this worker, a client upload, a
transfer from another worker) supplies it, then `ready` or `failed`. It is freed
when nobody needs it any more: the client released it (or never held it: program
intermediates) and no enqueued consumer still has to read it. A release that comes
before the buffer exists leaves a tombstone so a late upload is dropped, not leaked.

What changes buffers is here (declaring, producing, failing, releasing); waits for them and looks
at them are in buffer_reads.py, the store's base class, which holds the entries and their lock.

Thread-safe: the executor thread, the completion thread and the gRPC handlers share it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .buffer_entry import FAILED, PENDING, READY, Entry, Recent
from .buffer_entry import BufferFailed as BufferFailed  # what the store's readers catch, taken from here
from .buffer_reads import BufferReads
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


class BufferStore(BufferReads):
    """The worker's buffers: what changes them, on the entries and under the lock of its base
    (`BufferReads`: waits and looks)."""

    def __init__(self) -> None:
        super().__init__()
        # waits for launched buffers' computations to be over (`when_computed`, the executor's
        # `computed`): under this lock, reading these entries
        self.computations = Computations(self._lock, self._entries)
        self._freed_uploads: Recent[int] = Recent(MAX_FREED_UPLOADS)
        self._unwanted: Recent[int] = Recent(MAX_UNWANTED)
        self._tombstones: Recent[int] = Recent(MAX_TOMBSTONES)  # their ids
        self._ended: Recent[str] = Recent(MAX_ENDED_OWNERS)
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
