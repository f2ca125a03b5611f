"""Arrays read back to the client (CopyToHostBuffer, then HostBufferLookup), streamed from the workers.

The jaxlib client asks CopyToHostBuffer to put an array in a host buffer, waits for the answer,
then reads the buffer with one HostBufferLookup stream and deletes it. An array of
`STREAM_MIN_BYTES` or more is not read into the controller: CopyToHostBuffer answers once the
buffers it comes from are computed, and stores a `Download` under the host buffer's handle that
holds those buffers (a DestructArray right after does not free them); the lookup then reads them
from their workers' `Fetch` a message at a time and sends each on once the next has come (the
last goes with the call's status: host_buffer_rpcs.py), so the controller holds a few messages
at once and reads no faster than the client takes them. The worker makes those messages
wire-identical to the lookup's (`FetchRequest.data_messages`: `{bytes data = 1}`, 2 MiB each), so
they go on unparsed and uncopied: the controller checks each one's header (`wire.data_length`)
and counts its bytes. Deleting the host buffer, or the session's end, lets the buffers go.

An array is streamed as `Segment`s, byte ranges of worker buffers whose concatenation is its C-order
bytes, each read with a `Fetch` of that range (the worker sends only those bytes): one buffer's
whole value; a shard of a buffer that is one range of it (shards along the leading axis, which is
how np.asarray reads a sharded array: shard by shard); or, for an array made of parts of several
buffers, each part in order, when every part is one range both of the array and of its buffer.
Any other layout (e.g. shards along a later axis) is first joined into one buffer on a worker by
the program an execute would use (arrays.join). A result sharded over a slice spanning workers is
first gathered into a replicated copy (its own workers hold only their shards), which the
downloads under way share (`SharedCopy`); what a download made is freed with it.

Smaller arrays are read whole (one fetch of their buffer's data messages, on the session's bulk
connection where there is one, read on the event loop: cluster_backend.py `get`; no extra round
trip to wait for them) and kept here until the lookup. CopyToHostBuffer is answered as soon as
their fetch has begun (`Fetching`), so the fetch goes on while the client takes the answer and
sends its lookup, which waits for what is left of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas.arrays import resolve_dtype

from .. import wire
from ..rpcguard import write_or_cancel
from .arrays import ArrayRecord, Buf, drop_buffers, full, join, joined_bytes, unref
from .backend import BackendError
from .compose import gather_function
from .handles import Arriving, HandleError, HostData, Streamed
from .layouts import check_c_order
from .shardings import Index

if TYPE_CHECKING:
    from .service import Session

Message = Any

STREAM_MIN_BYTES = 4 << 20  # an array this large streams from its workers to the client
# (buffer id, offset, length) -> those bytes of the buffer as serialized `{bytes data = 1}`
# messages, as its worker sends them (its `Fetch` with `data_messages`)
Stream = Callable[[int, int, int], AsyncGenerator[bytes, None]]


@dataclass(frozen=True)
class Segment:
    buffer_id: int
    start: int  # byte range of the buffer's C-order bytes
    stop: int


def byte_range(index: Index, shape: tuple[int, ...], itemsize: int) -> tuple[int, int] | None:
    """The byte range `index` (a box) covers in a C-order array of `shape`, or None if the box is
    not one contiguous range (it is when every axis after its first longer than 1 is whole)."""
    sizes = [s.stop - s.start for s in index]
    if 0 in sizes:
        return (0, 0)
    first = next((k for k, n in enumerate(sizes) if n > 1), len(sizes))
    if any(index[k].start != 0 or index[k].stop != shape[k] for k in range(first + 1, len(shape))):
        return None
    stride, start = itemsize, 0
    for k in reversed(range(len(shape))):
        start += index[k].start * stride
        stride *= shape[k]
    return start, start + math.prod(sizes) * itemsize


def plan(rec: ArrayRecord) -> list[tuple[Buf, int, int]] | None:
    """(buffer, start, stop) ranges whose bytes, in order, are `rec`'s C-order bytes; None when
    its parts are not contiguous ranges of both the array and their buffers."""
    itemsize = resolve_dtype(rec.dtype).itemsize
    ranges: dict[tuple[int, int], tuple[Buf, int, int]] = {}  # array range -> buffer range
    for part, dom in zip(rec.parts, rec.domains, strict=True):
        out = byte_range(dom, rec.shape, itemsize)
        src = byte_range(part.index, part.buf.shape, itemsize)
        if out is None or src is None or out[1] - out[0] != src[1] - src[0]:
            return None
        if out[0] < out[1]:
            ranges.setdefault(out, (part.buf, *src))  # replicas: the first shard's copy
    segments: list[tuple[Buf, int, int]] = []
    at = 0
    for (start, stop), (buf, lo, hi) in sorted(ranges.items()):
        if start != at:  # a gap or an overlap: not a tiling in ranges
            return None
        if segments and segments[-1][0] is buf and segments[-1][2] == lo:
            segments[-1] = (buf, segments[-1][1], hi)  # the buffer goes on: one fetch
        else:
            segments.append((buf, lo, hi))
        at = stop
    return segments if at == rec.nbytes else None


class Download(Streamed):
    """An array's bytes left on the workers for the client's lookup: `segments` read in order
    with `stream` (the worker's `Fetch` of that byte range, message by message); `release` lets
    the buffers go."""

    def __init__(self, stream: Stream, segments: Sequence[Segment],
                 nbytes: int, release: Callable[[], None]) -> None:
        self._stream = stream
        self.segments = tuple(segments)
        self.nbytes = nbytes
        self._release: Callable[[], None] | None = release

    async def messages(self) -> AsyncGenerator[bytes, None]:
        for seg in self.segments:
            want = seg.stop - seg.start
            got = 0
            async with contextlib.aclosing(self._stream(seg.buffer_id, seg.start, want)) as parts:
                async for message in parts:
                    got += wire.data_length(message)  # checked already by the stream: the header only
                    if got > want:
                        break
                    yield message
            if got != want:
                raise BackendError("INTERNAL", f"buffer {seg.buffer_id:#x}: the worker sent {got} bytes of a "
                                   f"{want}-byte range")

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


async def _gathered(session: Session, buf: Buf) -> int:
    """A replicated copy of a result sharded over workers, which the slice's worker can read
    (the caller frees it)."""
    gather = getattr(session.backend, "gather", None)  # the cluster's backend: on the devices it is spread over
    if gather is not None:
        copy: int = await gather(buf.id, buf.dtype, buf.shape)
        return copy
    info = session.backend.slice
    key = ("gather", buf.dtype, buf.shape)
    made = session.functions.get(key)
    if made is None:
        made = session.functions[key] = await asyncio.to_thread(gather_function, buf.dtype, buf.shape,
                                                                len(info.devices), info.platform_name)
    (copy,) = await session.backend.run_function("proxy_gather", made[1], 1, [buf.id])
    return copy


def _spread(session: Session, buf: Buf) -> bool:
    """Whether `buf`'s parts were left on several workers: decided by the slice's placement when
    the run making it ran (`Buf.spread`), not by the placement now. After a remap such a buffer
    is read through a gather, which refuses it with an error naming the remap (holdings.py
    `check_placed`), rather than fetched from a worker that holds only part of it, or is gone."""
    return buf.spread


@dataclass(eq=False)
class SharedCopy:
    """A gathered copy of a buffer that downloads under way share (np.asarray of a sharded array
    downloads each shard: one gather serves them all); freed with its last user."""

    made: asyncio.Future[int]
    users: int = 0


async def _shared_gather(session: Session, buf: Buf) -> int:
    """A gathered copy of `buf` (`_gathered`), shared; the caller `_unshare`s it when done."""
    entry = session.gathers.get(buf.id)
    if entry is None:
        entry = session.gathers[buf.id] = SharedCopy(asyncio.ensure_future(_gathered(session, buf)))
    entry.users += 1
    try:
        return await asyncio.shield(entry.made)
    except BaseException:
        _unshare(session, buf.id)
        raise


def _unshare(session: Session, buffer_id: int) -> None:
    entry = session.gathers[buffer_id]
    entry.users -= 1
    if entry.users:
        return
    del session.gathers[buffer_id]

    def free(made: asyncio.Future[int]) -> None:
        if not made.cancelled() and made.exception() is None:
            session.backend.free([made.result()])

    if entry.made.done():
        free(entry.made)
    else:  # nobody waits for it any more: freed once it is made
        entry.made.add_done_callback(free)


async def start(session: Session, rec: ArrayRecord, stream: Stream) -> Download:
    """A download of `rec`, once the buffers it reads are computed (BackendError if their runs
    failed). It holds `rec`'s buffers (and the copies it made) until it is released."""
    held = rec.buffers
    for b in held:
        b.records += 1
    made: list[int] = []  # buffers it made, its own
    copies: dict[int, int] = {}  # buffer -> its gathered copy, shared

    def release() -> None:
        if made:
            session.backend.free(made)
        for b in copies:
            _unshare(session, b)
        drop_buffers(session, held)

    try:
        for b in held:
            if _spread(session, b):
                copies[b.id] = await _shared_gather(session, b)
        ranges = plan(rec)
        if ranges is None:  # a layout that is not ranges in order: joined into one buffer first
            made.append(await join(session, rec, copies))
            segments = [Segment(made[-1], 0, rec.nbytes)]
        else:
            segments = [Segment(copies.get(b.id, b.id), lo, hi) for b, lo, hi in ranges]
        await session.backend.ready(list(dict.fromkeys(s.buffer_id for s in segments)))
    except BaseException:
        release()
        raise
    return Download(stream, segments, rec.nbytes, release)


async def host_bytes(session: Session, rec: ArrayRecord) -> bytes | HostData:
    """The array's bytes (C order), read whole from its buffers (one buffer's: as the worker sent
    them). In a task of its own (`Fetching`'s), which the backend's `get` cancels if the buffer's
    run fails."""
    buf = rec.buffer()
    if buf is not None:
        if buf.id not in session.fetches and not _spread(session, buf):
            return await session.backend.get(buf.id)  # in this task: no shared one
        return await _fetch(session, buf)
    sources = rec.buffers
    datas = await asyncio.gather(*(_fetch(session, b) for b in sources))
    arrays = {id(b): np.frombuffer(joined_bytes(d), resolve_dtype(b.dtype)).reshape(b.shape)
              for b, d in zip(sources, datas, strict=True)}
    if len(rec.parts) == 1 or all(d == full(rec.shape) for d in rec.domains):
        p = rec.parts[0]
        return np.ascontiguousarray(arrays[id(p.buf)][p.index]).tobytes()
    out = np.empty(rec.shape, resolve_dtype(rec.dtype))
    for part, dom in zip(rec.parts, rec.domains, strict=True):
        out[dom] = arrays[id(part.buf)][part.index]
    return out.tobytes()


async def _fetch(session: Session, buf: Buf) -> bytes | HostData:
    """A buffer's bytes; downloads of shards of one buffer that overlap share one fetch, in a task
    of its own (which the backend's `get` cancels if the buffer's run fails)."""
    task = session.fetches.get(buf.id)
    if task is None:
        task = session.fetches[buf.id] = asyncio.ensure_future(_download(session, buf))
        task.add_done_callback(lambda _: session.fetches.pop(buf.id, None))
    return await asyncio.shield(task)


async def _download(session: Session, buf: Buf) -> bytes | HostData:
    if not _spread(session, buf):
        return await session.backend.get(buf.id)
    copy = await _gathered(session, buf)
    try:
        return await session.backend.get(copy)
    finally:
        session.backend.free([copy])


class Fetching(Arriving):
    """A small array's bytes on their way from its workers (`host_bytes`, in a task of its own),
    stored by CopyToHostBuffer without waiting for them: the client's lookup, which comes a round
    trip of the client's later, waits for what is left of the fetch (bench/FINDINGS.md,
    2026-11-27 14:41). It holds the array's buffers until the bytes came (a DestructArray right
    after must not free what is being read); `release` (the host buffer deleted, the session's
    end) ends a fetch still under way."""

    def __init__(self, session: Session, rec: ArrayRecord) -> None:
        self.nbytes = rec.nbytes
        self._session: Session | None = session
        self._rec = rec
        rec.refs += 1
        self._task = asyncio.ensure_future(_fetched(session, rec))
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[HostData]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved: a lookup that never comes leaves it unawaited
        self._let_go()

    def _let_go(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            unref(session, self._rec)

    async def result(self) -> HostData:
        return await asyncio.shield(self._task)

    def release(self) -> None:
        self._task.cancel()
        self._let_go()  # now, not in the cancelled task's callback: the session may be closing


async def _fetched(session: Session, rec: ArrayRecord) -> HostData:
    data = await host_bytes(session, rec)
    if len(data) != rec.nbytes:
        raise BackendError("INTERNAL", f"worker returned {len(data)} bytes for a {rec.nbytes}-byte array")
    return data if isinstance(data, HostData) else HostData([data])


async def copy_to_host_buffer(session: Session, req: Message, resp: Message, proto: Any) -> None:
    """Answered once an array of `STREAM_MIN_BYTES` or more is computed (its bytes stay on the
    workers: `Download`); a smaller one at once, its fetch begun (`Fetching`)."""
    r = req.copy_to_host_buffer_request
    rec = await session.handles.resolve(r.array_handle, ArrayRecord)
    if r.HasField("byte_strides"):
        check_c_order(r.byte_strides, rec.dtype, rec.shape)
    stream = getattr(session.backend, "lookup_messages", None)  # the cluster's backend has it (cluster_backend.py)
    if stream is not None and rec.nbytes >= STREAM_MIN_BYTES:
        rec.refs += 1  # a DestructArray right after must not free what is being read
        try:
            data: Download | Fetching = await start(session, rec, stream)
        finally:
            unref(session, rec)
    else:
        data = Fetching(session, rec)
    try:
        session.buffers.store(r.host_buffer_handle, data)
    except HandleError:
        data.release()
        raise
    resp.copy_to_host_buffer_response.SetInParent()


async def write_lookup(context: Any, data: HostData | Streamed, chunk: int, handle: int) -> bytes:
    """A HostBufferLookup's messages, all but the last written here, the last returned (the
    handler's answer, which gRPC sends with the call's status: one write fewer; a small read's
    only message goes so): bytes kept here in `chunk`s (serialized here, one copy of each), or a
    download's messages read from a worker and each sent on, unparsed, once the next has come
    (the controller holds a few however slowly the client reads; BackendError when the workers
    fail it). Each write waits for the client's flow-control window; a client that goes away
    cancels the handler (rpcguard.write_or_cancel: no traceback logged, as one was for a client
    that never read its lookup, then hung up: the chaos run's proxy fuzz), which closes the
    download's `messages` and with it the worker's fetch."""
    last: bytes | None = None
    if isinstance(data, Streamed):
        sent = 0
        async with contextlib.aclosing(data.messages()) as messages:
            async for message in messages:
                sent += wire.data_length(message)
                if last is not None:
                    await write_or_cancel(context, last)
                last = message
        if sent != data.nbytes:
            raise BackendError("INTERNAL", f"host buffer {handle}: the workers sent {sent} bytes of {data.nbytes}")
        return last if last is not None else b""
    for part in data.parts:
        view = memoryview(part).cast("B")
        for offset in range(0, len(view), chunk):
            if last is not None:
                await write_or_cancel(context, last)
            last = wire.data_message(view[offset : offset + chunk])
    return last if last is not None else b""  # no bytes: one empty message


HANDLERS = {"copy_to_host_buffer_request": copy_to_host_buffer}
