"""The client-chosen handles of one proxy session, and host buffers awaiting their arrays.

Handles are small integers the client picks (ids within its session only); handles the server
makes (the first Execute's outputs, futures, executables) start at `SERVER_HANDLE_BASE` so they
never collide: a client-chosen handle in that range is refused where it is taken (`reserve`), or
it would later make one of the server's own fail as "already in use".
A failed operation marks its result handles with its error (requirement 7 in docs/facts.md):
a later use of such a handle fails with the original message, not with "unknown handle".

Requests run concurrently (a MakeArray may wait for its bytes), so an op reserves its result
handles before its first await (`reserve`), in request order; a later request that uses such a
handle waits for it (`resolve`) until the op settles it or fails.

A request that reads handles claims them when it is read (`claim`, in the session's reader, in
request order) until it is done (`unclaim`); a DestructArray that arrives later waits for those
claims (`pop_resolved`). Without them the destruct could run between an op's `settle` and the
wakeup of an earlier reader of that handle, which then found it gone ("unknown handle").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncGenerator, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Protocol

from .. import wire

SERVER_HANDLE_BASE = 1 << 62
# The handles one request may name in a list it reads or makes (an Execute's arguments, a
# CheckValueReady's values, a CopyArrays' arrays, ...): far above what one jax call names, and a
# bound on the work one request asks of the session's event loop (each is claimed, resolved and
# answered one by one). DestructArray and DeleteArray lists are bounded by the session's handle
# limit instead: the jaxlib client batches whatever it released in 50 us, with no size bound.
MAX_HANDLES = 1 << 16
# what a handle of each kind is, in an error's words (not the class's name)
_NOUNS = {"ArrayRecord": "an array", "LoadedExecutable": "a loaded executable", "Future": "a future"}


class HandleError(Exception):
    """An unknown handle, a handle of the wrong kind, or one whose producing op failed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def bounded(values: Sized, what: str, cap: int, why: str = "") -> None:
    """INVALID_ARGUMENT naming the request's field `what` when it holds more than `cap` entries
    (checked before any entry is looked at: the work a request asks stays bounded)."""
    if len(values) > cap:
        raise HandleError("INVALID_ARGUMENT", f"{what}: {len(values)} entries, at most {cap}{why}")


@dataclass
class Failed:
    code: str
    message: str


class Pending:
    """A handle whose op has not finished; `resolve` waits on it. Its future is made only when
    someone waits (most ops finish before anything reads their handles)."""

    __slots__ = ("_done",)

    def __init__(self) -> None:
        self._done: asyncio.Future[None] | None = None

    @property
    def done(self) -> asyncio.Future[None]:
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
        return self._done

    def finish(self) -> None:
        """The op finished (or failed): wakes whoever waits."""
        if self._done is not None and not self._done.done():
            self._done.set_result(None)


class HandleTable:
    """Handle -> object (an array, executable, future) or the error of the op that made it."""

    def __init__(self, limit: int = 1_000_000) -> None:
        self._items: dict[int, Any] = {}
        self._limit = limit  # a bound on what one client can make the controller hold
        self._next = itertools.count(SERVER_HANDLE_BASE)
        self._claims: dict[int, int] = {}  # handle -> requests read earlier that still use it
        self._unclaimed: dict[int, asyncio.Future[None]] = {}  # wakes `pop_resolved` at no claims

    def __len__(self) -> int:
        return len(self._items)

    @property
    def limit(self) -> int:
        return self._limit

    def new_handle(self) -> int:
        return next(self._next)

    def put(self, handle: int, value: Any) -> None:
        if handle in self._items:
            raise HandleError("INVALID_ARGUMENT", f"handle {handle} is already in use")
        if len(self._items) >= self._limit:
            raise HandleError("RESOURCE_EXHAUSTED", f"a proxy session holds at most {self._limit} handles")
        self._items[handle] = value

    def reserve(self, handle: int) -> None:
        """Claims the client-chosen `handle` for an op that will `settle` it (or whose failure will
        `fail` it); one in the server's range is INVALID_ARGUMENT (one compare: the per-call path)."""
        if handle >= SERVER_HANDLE_BASE:
            raise HandleError("INVALID_ARGUMENT", f"handle {handle} is in the server's range (2**62 and above): "
                              "a client picks handles below it")
        self.put(handle, Pending())

    def reserve_new(self) -> int:
        """A handle the server makes, claimed as `reserve` claims a client's."""
        handle = next(self._next)
        self.put(handle, Pending())
        return handle

    def reserve_all(self, given: Sequence[int], count: int) -> list[int] | None:
        """An op's `count` result handles, reserved (before any await: later requests may use
        them): the client's `given`, or new ones of the server's where it names none; None when
        it names another number (counted before the list is copied: the caller says why)."""
        if not given:
            return [self.reserve_new() for _ in range(count)]
        if len(given) != count:
            return None
        handles = list(given)
        for h in handles:
            self.reserve(h)
        return handles

    def reserve_or_new(self, handle: int) -> int:
        """`handle` reserved, or a new one where the client named none (0)."""
        if not handle:
            return self.reserve_new()
        self.reserve(handle)
        return handle

    def settle(self, handle: int, value: Any) -> None:
        pending = self._items.get(handle)
        self._items[handle] = value
        if isinstance(pending, Pending):
            pending.finish()

    async def resolve(self, handle: int, kind: type | None = None) -> Any:
        """Like `get`, but waits for a handle whose op is still running."""
        value = self._items.get(handle)
        if isinstance(value, Pending):
            await asyncio.shield(value.done)
        return self.get(handle, kind)

    def fail(self, handles: int | list[int], code: str, message: str) -> None:
        """Marks `handles` as the results of a failed op (over whatever they held). A handle in
        the server's range is marked only where the op reserved it (a client's there was refused,
        and marking it would make the server's own fail later), and a handle the table does not
        hold only while it has room (a failed request adds no more than a made one could)."""
        for h in [handles] if isinstance(handles, int) else handles:
            if h:
                pending = self._items.get(h)
                if not isinstance(pending, Pending) and (
                        h >= SERVER_HANDLE_BASE or (pending is None and len(self._items) >= self._limit)):
                    continue
                self._items[h] = Failed(code, message)
                if isinstance(pending, Pending):
                    pending.finish()

    def peek(self, handle: int) -> Any:
        """What `handle` holds now, `Pending` included (None if unknown)."""
        return self._items.get(handle)

    def get(self, handle: int, kind: type | None = None) -> Any:
        value = self._items.get(handle)
        if value is None:
            raise HandleError("NOT_FOUND", f"unknown handle {handle}")
        if isinstance(value, Failed):
            raise HandleError(value.code, value.message)
        if isinstance(value, Pending):
            raise HandleError("FAILED_PRECONDITION", f"handle {handle} is not ready")
        if kind is not None and not isinstance(value, kind):
            raise HandleError("INVALID_ARGUMENT", f"handle {handle} is not {_NOUNS.get(kind.__name__, kind.__name__)}")
        return value

    def pop(self, handle: int) -> Any:
        """Removes a handle; returns what it held (None if unknown, failed or pending)."""
        value = self._items.pop(handle, None)
        return None if isinstance(value, Failed | Pending) else value

    def claim(self, handles: list[int]) -> None:
        """Marks `handles` as used by a request read now; `pop_resolved` waits until `unclaim`."""
        for h in handles:
            self._claims[h] = self._claims.get(h, 0) + 1

    def unclaim(self, handles: list[int]) -> None:
        for h in handles:
            left = self._claims.get(h, 0) - 1
            if left > 0:
                self._claims[h] = left
                continue
            self._claims.pop(h, None)
            waiter = self._unclaimed.pop(h, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def pop_free(self, handles: Sequence[int]) -> tuple[list[Any], list[int]]:
        """Removes those of `handles` that `pop_resolved` would remove without waiting (their op
        finished and no request read before uses them): what they held (unknown and failed ones
        left out), and the others, in order, for `pop_resolved`. One pass, no await: a
        DestructArray's whole list at the cost of one handle's."""
        values: list[Any] = []
        busy: list[int] = []
        for h in handles:
            if not self._pop_into(h, values):
                busy.append(h)
        return values, busy

    def pop_run(self, handles: Sequence[int], start: int) -> tuple[list[Any], int]:
        """`pop_free` of `handles[start:]` up to the first it cannot remove yet: what they held,
        and that one's index (len(handles): none)."""
        values: list[Any] = []
        for i in range(start, len(handles)):
            if not self._pop_into(handles[i], values):
                return values, i
        return values, len(handles)

    def _pop_into(self, handle: int, values: list[Any]) -> bool:
        """Removes `handle` unless it must wait (`pop_resolved`), adding what it held to `values`;
        False when it must wait."""
        value = self._items.get(handle)
        if isinstance(value, Pending) or self._claims.get(handle):
            return False
        if value is not None:
            del self._items[handle]
            if not isinstance(value, Failed):
                values.append(value)
        return True

    async def pop_resolved(self, handle: int) -> Any:
        """Removes a handle once its op finished and the requests read before that use it are done;
        returns what it held (None if unknown or failed)."""
        while True:
            value = self._items.get(handle)
            if isinstance(value, Pending):
                await asyncio.shield(value.done)
            elif self._claims.get(handle):
                waiter = self._unclaimed.get(handle)
                if waiter is None:
                    waiter = self._unclaimed[handle] = asyncio.get_running_loop().create_future()
                await asyncio.shield(waiter)
            else:
                return self.pop(handle)

    def values(self) -> list[Any]:
        return [v for v in self._items.values() if not isinstance(v, Failed | Pending)]


class HostData:
    """Host bytes kept as the parts they arrived in (the client's 1 MiB chunks, the worker's
    fetch chunks): an upload writes them on one by one, and only a consumer that needs them
    contiguous joins them (`tobytes`), so 64 MiB is not copied to be joined and again to be sent."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: list[bytes | memoryview]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.nbytes = sum(len(p) for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def tobytes(self) -> bytes:
        if len(self.parts) == 1 and isinstance(self.parts[0], bytes):
            return self.parts[0]
        return b"".join(self.parts)

    def slice(self, start: int, stop: int) -> HostData:
        """Bytes `start:stop`, as views of the parts (no copy)."""
        out: list[bytes | memoryview] = []
        offset = 0
        for part in self.parts:
            end = offset + len(part)
            if end > start and offset < stop:
                out.append(memoryview(part).cast("B")[max(start - offset, 0) : min(stop, end) - offset])
            offset = end
        return HostData(out)


class Staged(Protocol):
    """A host buffer whose bytes went on to a worker as they arrived (staging.Staging)."""

    def __len__(self) -> int: ...

    async def finish(self, dtype: str, shape: tuple[int, ...]) -> int:
        """Makes the bytes the array `dtype[shape]` on the worker; its buffer id."""
        ...

    async def materialize(self) -> HostData: ...

    def discard(self) -> None: ...


class Streamed:
    """A host buffer whose bytes stay on the workers until a lookup streams them (downloads.py):
    what CopyToHostBuffer stores for a large array. The controller holds none of its bytes."""

    nbytes: int

    def __len__(self) -> int:
        return self.nbytes

    def messages(self) -> AsyncGenerator[bytes, None]:
        """The bytes in order as serialized lookup messages (`{bytes data = 1}`), read from the
        workers as the consumer takes them."""
        raise NotImplementedError

    def release(self) -> None:
        """Lets go of what the buffer holds on the workers (idempotent)."""
        raise NotImplementedError


class Arriving:
    """A host buffer whose bytes are on their way from the workers (downloads.py `Fetching`: a
    small array CopyToHostBuffer answered for before its bytes came): a lookup waits for them.
    Counted against the session's limit as the bytes it will hold."""

    nbytes: int

    def __len__(self) -> int:
        return self.nbytes

    async def result(self) -> HostData:
        """The bytes, once they came (BackendError if the fetch failed)."""
        raise NotImplementedError

    def release(self) -> None:
        """Lets go of the fetch and what it holds on the workers (idempotent)."""
        raise NotImplementedError


Entry = HostData | Staged | Streamed | Arriving


def _held(data: Entry) -> int:
    """The bytes an entry counts against the session's limit: a streamed download holds none here."""
    return 0 if isinstance(data, Streamed) else len(data)


class HostBuffers:
    """Bytes the client stored with HostBufferStore, by handle, until a request takes them: held
    here (`HostData`), or staged on a worker (`Staged`, staging.py); and the arrays CopyToHostBuffer
    left for the client's lookup (`HostData`, or `Streamed` from the workers: downloads.py).

    A MakeArray can arrive before its HostBufferStore has finished (requirement 5), so `take`
    waits, up to `wait_s`. Bounded: at most `limit_bytes` held or staged per session.
    """

    def __init__(self, limit_bytes: int = 8 << 30, wait_s: float = 60.0) -> None:
        self._data: dict[int, Entry] = {}
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._held = 0
        self._limit = limit_bytes
        self._wait_s = wait_s

    @property
    def held_bytes(self) -> int:
        return self._held

    def reserve(self, size: int) -> None:
        """Checks a store of `size` bytes fits before its bytes are read."""
        if size < 0:
            raise HandleError("INVALID_ARGUMENT", f"host buffer of {size} bytes: a size is 0 or more")
        if self._held + size > self._limit:
            raise HandleError(
                "RESOURCE_EXHAUSTED",
                f"host buffer of {size} bytes: the session holds {self._held} of at most {self._limit} bytes",
            )

    def store(self, handle: int, data: bytes | Entry) -> None:
        if isinstance(data, bytes):
            data = HostData([data])
        if handle in self._data:
            raise HandleError("ALREADY_EXISTS", f"host buffer {handle} already stored")
        self.reserve(_held(data))
        self._data[handle] = data
        self._held += _held(data)
        waiter = self._waiters.pop(handle, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def lookup(self, handle: int) -> Entry:
        data = self._data.get(handle)
        if data is None:
            raise HandleError("NOT_FOUND", f"host buffer {handle} not found")
        return data

    async def lookup_bytes(self, handle: int) -> HostData | Streamed:
        """The bytes stored under `handle`, read back here if they were staged (and kept here), or
        waited for if they are arriving (the entry stays until deleted); a streamed download as it
        is (the caller reads its `chunks`)."""
        data = self.lookup(handle)
        if isinstance(data, HostData | Streamed):
            return data
        if isinstance(data, Arriving):
            return await data.result()
        self.delete(handle)
        try:
            held = await data.materialize()
        except BaseException:
            data.discard()
            raise
        if handle not in self._data:  # else stored again meanwhile: that one stays
            self.store(handle, held)
        return held

    async def take(self, handle: int) -> HostData:
        """The bytes stored under `handle` (waiting for them, reading staged ones back), removed
        from the store."""
        data = await self.take_any(handle)
        if isinstance(data, HostData):
            return data
        try:
            return await data.materialize()
        except BaseException:
            data.discard()
            raise

    async def take_any(self, handle: int) -> HostData | Staged:
        """What is stored under `handle` (waiting for it), removed from the store; a streamed
        download (a client making an array of what it downloaded) is read here whole."""
        if handle not in self._data:
            waiter = self._waiters.get(handle)
            if waiter is None:
                waiter = self._waiters[handle] = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(waiter), self._wait_s)
            except TimeoutError:
                self._waiters.pop(handle, None)
                raise HandleError(
                    "DEADLINE_EXCEEDED", f"host buffer {handle} did not arrive within {self._wait_s:g} s"
                ) from None
        data = self.delete(handle)
        if isinstance(data, Arriving):
            try:
                return await data.result()
            finally:
                data.release()
        if not isinstance(data, Streamed):
            return data
        try:
            async with contextlib.aclosing(data.messages()) as messages:
                return HostData([wire.data_field(message) async for message in messages])
        finally:
            data.release()

    def delete(self, handle: int) -> Entry:
        """Removes `handle`'s entry and returns it (the caller discards a staged one it does not use)."""
        data = self._data.pop(handle, None)
        if data is None:
            raise HandleError("NOT_FOUND", f"host buffer {handle} not found")
        self._held -= _held(data)
        return data

    def drop(self, handle: int) -> None:
        """Deletes `handle`, freeing what a staged buffer or a download holds on the workers."""
        _let_go(self.delete(handle))

    def clear(self) -> None:
        for data in self._data.values():
            _let_go(data)
        self._data.clear()
        self._held = 0
        for w in self._waiters.values():
            if not w.done():
                w.cancel()
        self._waiters.clear()


def _let_go(data: Entry) -> None:
    """Frees what an entry holds on the workers."""
    if isinstance(data, Streamed | Arriving):
        data.release()
    elif not isinstance(data, HostData):
        data.discard()
