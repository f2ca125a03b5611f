"""The proxy's array requests: host bytes in and out of worker buffers, shards, and their handles.

Every array is held as worker buffers with global values: an array handle (the client's id)
maps to an `ArrayRecord`, its dtype, shape and sharding (shardings.py) and, for each shard in
the sharding's device order, a `Part`: a worker buffer (`Buf`) and the index domain of that
buffer the shard is. An array computed or uploaded whole has one buffer and its shards are the
sharding's own domains of it; the shards DisassembleIntoSingleDeviceArrays makes are views of
the same buffer (nothing moves; reshard.py), and AssembleArrayFromSingleDeviceArrays of such views is the
buffer again. An array whose parts are not one buffer's own layout (shards assembled from
elsewhere, a remap) is joined on a worker by a small program (compose.py) the first time it is
read as a whole (an execute argument); downloads are downloads.py's. Buffers are freed when the
last record using them goes; a buffer another record still uses is never donated (executables.py
runs the module's non-donating twin).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas.arrays import resolve_dtype

from . import shardings as sh
from .backend import ArraySpec
from .compose import Piece, piece_function
from .handles import MAX_HANDLES, HandleError, HostData, Staged, bounded
from .layouts import c_strides, check_size, numpy_dtype, strided
from .shardings import Index, Sharding

if TYPE_CHECKING:
    from .service import Session

Message = Any

SINGLE_DEVICE = sh.SINGLE_DEVICE
# a MakeArraysFromHostBufferShards shard: its shard indices, shape, host buffer message, and bytes
ShardBuffer = tuple[list[int], tuple[int, ...], Any, "HostData | Staged"]


@dataclass(eq=False)
class Buf:
    """A worker buffer of the session; `records`: how many records read it."""

    id: int
    dtype: str
    shape: tuple[int, ...]
    records: int = 0
    spread: bool = False  # a multi-device program's result: on a slice spanning workers, no one holds it all


@dataclass(frozen=True, eq=False)
class Part:
    buf: Buf
    index: Index  # where in the buffer's value this shard is


@dataclass(eq=False)
class ArrayRecord:
    dtype: str
    shape: tuple[int, ...]
    sharding: Sharding
    parts: list[Part]  # one per device of the sharding, in its order
    refs: int = 1  # handles and pending executes holding the record
    _domains: list[Index] | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * resolve_dtype(self.dtype).itemsize

    @property
    def domains(self) -> list[Index]:
        if self._domains is None:
            self._domains = self.sharding.domains(self.shape)
        return self._domains

    def buffer(self) -> Buf | None:
        """The one buffer whose value this array is, if it is one."""
        buf = self.parts[0].buf
        if buf.shape != self.shape:
            return None
        for part, dom in zip(self.parts, self.domains, strict=True):
            if part.buf is not buf or part.index != dom:
                return None
        return buf

    @property
    def buffers(self) -> list[Buf]:
        parts = self.parts
        if len(parts) == 1:  # an array on one device (most of a loop's)
            return [parts[0].buf]
        return list({id(p.buf): p.buf for p in parts}.values())


def full(shape: tuple[int, ...]) -> Index:
    return tuple(slice(0, d) for d in shape)


def new_record(dtype: str, shape: tuple[int, ...], sharding: Sharding, parts: list[Part]) -> ArrayRecord:
    if len(parts) != len(sharding.devices):
        raise HandleError("INVALID_ARGUMENT", f"{len(parts)} shards for a sharding over {len(sharding.devices)} "
                          "devices")
    rec = ArrayRecord(dtype, shape, sharding, parts)
    for b in rec.buffers:
        b.records += 1
    return rec


def whole(buf: Buf, sharding: Sharding, domains: list[Index] | None = None) -> ArrayRecord:
    """The array that is `buf`'s value, with `sharding` (`domains`: its shards' domains of
    `buf.shape`, when the caller knows them)."""
    if domains is None:
        domains = sharding.domains(buf.shape)
    rec = new_record(buf.dtype, buf.shape, sharding, [Part(buf, d) for d in domains])
    rec._domains = domains
    return rec


def drop_buffers(session: Session, bufs: list[Buf]) -> None:
    """Drops one reader of each buffer; frees those nobody reads any more."""
    done = []
    for b in bufs:
        b.records -= 1
        if b.records == 0:
            done.append(b.id)
    if done:
        session.backend.free(done)


def unref(session: Session, rec: ArrayRecord) -> None:
    """Drops one reference to `rec`; its buffers go with its last one (unless others use them)."""
    unref_all(session, (rec,))


def unref_all(session: Session, recs: Iterable[ArrayRecord]) -> None:
    """`unref` of each of `recs`, whose freed buffers go in one `free` (one release a worker,
    one cork decision): a step's ~80 arrays, not ~80 calls down to the dispatcher."""
    freed: list[Buf] = []
    for rec in recs:
        rec.refs -= 1
        if rec.refs == 0:
            bufs, rec.parts = rec.buffers, []
            freed += bufs
    drop_buffers(session, freed)


async def join(session: Session, rec: ArrayRecord, ids: dict[int, int] | None = None) -> int:
    """Runs a program joining `rec`'s parts on a worker: the id of a new buffer (the caller's to
    free) holding its value. `ids`: buffer id -> the id to read instead (a gathered copy)."""
    sources = rec.buffers
    position = {id(b): i for i, b in enumerate(sources)}
    pieces, seen = [], set()
    for part, dom in zip(rec.parts, rec.domains, strict=True):
        key = tuple((s.start, s.stop) for s in dom)
        if key not in seen:
            seen.add(key)
            pieces.append(Piece(position[id(part.buf)], part.index, dom))
    inputs = [(b.dtype, b.shape) for b in sources]
    cache_key = (tuple(inputs), rec.dtype, rec.shape, tuple(
        (p.source, tuple((s.start, s.stop) for s in p.src), tuple((s.start, s.stop) for s in p.dst)) for p in pieces))
    made = session.functions.get(cache_key)
    if made is None:
        made = await asyncio.to_thread(piece_function, inputs, (rec.dtype, rec.shape), pieces,
                                       session.backend.slice.platform_name)
        session.functions[cache_key] = made
    # where the slice spans hosts when it runs, its result is spread over the workers: its spec
    # lets a later run on other devices read it through a gathered copy (cluster_backend.py
    # `prepare`). Always passed: the session's count of the slice's hosts is refreshed by runs
    # only, so right after a remap it may be stale.
    specs = [ArraySpec(rec.dtype, rec.shape)]
    (out,) = await session.backend.run_function("proxy_assemble", made[1], 1,
                                                [(ids or {}).get(b.id, b.id) for b in sources], outputs=specs)
    return out


async def materialize(session: Session, rec: ArrayRecord) -> Buf:
    """The one buffer holding `rec`'s value, joining its parts on a worker if needed."""
    buf = rec.buffer()
    if buf is not None:
        return buf
    buf = Buf(await join(session, rec), rec.dtype, rec.shape)
    buf.records = 1
    old, rec.parts = rec.buffers, [Part(buf, d) for d in rec.domains]
    drop_buffers(session, old)
    return buf


def joined_bytes(data: bytes | HostData) -> bytes:
    return data.tobytes() if isinstance(data, HostData) else data


def parse_sharding(session: Session, sharding: Message, proto: Any) -> Sharding:
    return sh.parse(sharding, proto, {d.id for d in session.backend.slice.devices})


async def _put(session: Session, sharding: Sharding, dtype: str, shape: tuple[int, ...],
               data: bytes | HostData) -> ArrayRecord:
    domains = sharding.domains(shape)
    # sharded over devices of several workers: each gets the bytes of its own devices' shards
    # only, and holds its part (a backend of slices spanning hosts has it: uploading.py)
    spread = getattr(session.backend, "put_spread", None)
    if spread is not None and _in_parts(sharding, domains, shape):
        assert sharding.op_sharding is not None
        buffer_id = await spread(sharding.devices, sharding.op_sharding, domains, dtype, shape, data)
        if buffer_id is not None:
            return whole(Buf(buffer_id, dtype, shape, spread=True), sharding, domains)
    # every device holds the whole array: a copy goes to each worker holding some of them
    buffer_id = await session.backend.put(sharding.devices, dtype, shape, data,
                                          replicated=_replicated(domains, shape))
    return whole(Buf(buffer_id, dtype, shape), sharding, domains)


def _in_parts(sharding: Sharding, domains: list[Index], shape: tuple[int, ...]) -> bool:
    """Whether an upload with this sharding can be held in parts by the workers of its devices
    (the backend decides whether they are several): sharded, not replicated, not empty, and a
    plain tiling (`Sharding.tiled`)."""
    return not _replicated(domains, shape) and math.prod(shape) > 0 and sharding.tiled


def _replicated(domains: list[Index], shape: tuple[int, ...]) -> bool:
    """Whether every device holds the whole array (of more than one device)."""
    return len(domains) > 1 and all(d == full(shape) for d in domains)


async def _read_back(staged: Staged) -> HostData:
    try:
        return await staged.materialize()
    except BaseException:
        staged.discard()
        raise


async def make_array_from_host_buffer(session: Session, req: Message, resp: Message, proto: Any) -> None:
    r = req.make_array_from_host_buffer_request
    handle = session.handles.reserve_or_new(r.array_handle)  # before any await: later requests may use it
    dtype = numpy_dtype(r.dtype)
    shape = sh.shape_of(r.shape.dims)
    sharding = parse_sharding(session, r.sharding, proto)
    strides = list(sh.shape_of(r.byte_strides.strides, "byte strides")) if r.HasField("byte_strides") else []
    held = await session.buffers.take_any(r.host_buffer_handle)  # may still be arriving (req. 5)
    nbytes = math.prod(shape) * resolve_dtype(dtype).itemsize
    if not isinstance(held, HostData):  # staged on the worker (staging.py)
        if strides and strides != c_strides(dtype, shape):
            data: bytes | HostData = await _read_back(held)
        else:
            try:
                check_size(held, dtype, shape)
            except HandleError:
                held.discard()
                raise
            buffer_id = await held.finish(dtype, shape)
            domains = sharding.domains(shape)
            # on to the worker holding its devices (or a copy to each, replicated), as `_put` stores
            settle = getattr(session.backend, "settle_staged", None)  # a backend that stages has it
            if settle is not None:
                settle(buffer_id, sharding.devices, _replicated(domains, shape))
            session.handles.settle(handle, whole(Buf(buffer_id, dtype, shape), sharding, domains))
            resp.make_array_from_host_buffer_response.array_handle = handle
            return
    else:
        data = held
    # jax.device_put sends a contiguous array's C-order strides: then the parts go on as they came
    if strides and (strides != c_strides(dtype, shape) or len(data) != nbytes):
        data = strided(joined_bytes(data), dtype, shape, r.byte_strides).tobytes()
    check_size(data, dtype, shape)
    session.handles.settle(handle, await _put(session, sharding, dtype, shape, data))
    resp.make_array_from_host_buffer_response.array_handle = handle


async def make_arrays_from_host_buffer_shards(session: Session, req: Message, resp: Message, proto: Any) -> None:
    r = req.make_arrays_from_host_buffer_shards_request
    what = "make_arrays_from_host_buffer_shards_request"
    bounded(r.specs, f"{what}.specs", MAX_HANDLES)
    handles = session.handles.reserve_all(r.array_handles, len(r.specs))
    if handles is None:
        raise HandleError("INVALID_ARGUMENT", f"{len(r.specs)} arrays, {len(r.array_handles)} handles")
    for h, spec in zip(handles, r.specs, strict=True):
        dtype = numpy_dtype(spec.array_spec.dtype)
        shape = sh.shape_of(spec.array_spec.shape.dims)
        sharding = parse_sharding(session, spec.array_spec.sharding, proto)
        domains = sharding.domains(shape)
        if len(spec.addressable_shard_indices) != len(spec.host_buffers):
            raise HandleError("INVALID_ARGUMENT", "as many shard index lists as host buffers are needed")
        # no more shards than the array has (each is looked at: the work stays the array's)
        bounded(spec.host_buffers, f"{what}.specs.host_buffers", len(domains), " (the array's shards)")
        for indices in spec.addressable_shard_indices:
            bounded(indices.indices, f"{what}.specs.addressable_shard_indices.indices", len(domains),
                    " (the array's shards)")
        shards: list[ShardBuffer] = []
        try:
            for indices, hb in zip(spec.addressable_shard_indices, spec.host_buffers, strict=True):
                hb_shape = sh.shape_of(hb.shape.dims)
                sh.shape_of(hb.byte_strides.strides, "byte strides")  # bounded before a list of them is made
                if numpy_dtype(hb.dtype) != dtype:
                    raise HandleError("INVALID_ARGUMENT", "a shard's dtype differs from its array's")
                held = await session.buffers.take_any(hb.host_buffer_handle)  # staged ones are on a worker
                shards.append((list(indices.indices), hb_shape, hb, held))
                for i in indices.indices:
                    if not 0 <= i < len(domains) or sh.index_shape(domains[i]) != hb_shape:
                        raise HandleError("INVALID_ARGUMENT", f"shard {i} of a {dtype}{list(shape)} array cannot be a "
                                          f"{list(hb_shape)} buffer")
            missing = set(range(len(domains))) - {i for s in shards for i in s[0]}
            if missing:
                raise HandleError("INVALID_ARGUMENT", f"shards {sorted(missing)} missing")
            rec = await _staged_parts(session, sharding, domains, dtype, shape, shards)
            if rec is not None:  # in parts on their workers, from where they were staged
                session.handles.settle(h, rec)
                continue
            data = await _joined_shards(dtype, shape, domains, shards)
        except BaseException:
            for *_, held in shards:
                if not isinstance(held, HostData):
                    held.discard()  # (one finished or read back already: nothing to do)
            raise
        session.handles.settle(h, await _put(session, sharding, dtype, shape, data))
    resp.make_arrays_from_host_buffer_shards_response.array_handles.extend(handles)


async def _joined_shards(dtype: str, shape: tuple[int, ...], domains: list[Index],
                         shards: list[ShardBuffer]) -> bytes:
    """The array's C-order bytes from its shards' host buffers (staged ones read back)."""
    out: np.ndarray | None = None
    data: bytes | None = None
    for indices, hb_shape, hb, held in shards:
        raw = (held if isinstance(held, HostData) else await _read_back(held)).tobytes()
        value = strided(raw, dtype, hb_shape, hb.byte_strides if hb.HasField("byte_strides") else None)
        for i in indices:
            if domains[i] == full(shape):
                data = value.tobytes()
                continue
            if out is None:
                out = np.empty(shape, resolve_dtype(dtype))
            out[domains[i]] = value
    if data is None:
        assert out is not None
        data = out.tobytes()
    return data


async def _staged_parts(session: Session, sharding: Sharding, domains: list[Index], dtype: str,
                        shape: tuple[int, ...], shards: list[ShardBuffer]) -> ArrayRecord | None:
    """An array sharded over devices of several workers whose shards' host buffers were all
    staged (4 MiB or more each: on the slice's first worker), in parts on its workers without
    reading the shards back here (uploading.py `put_spread_staged`); None where it is not one
    (then the caller joins the shards here)."""
    put = getattr(session.backend, "put_spread_staged", None)
    if put is None or not _in_parts(sharding, domains, shape) or any(isinstance(held, HostData)
                                                                       for *_, held in shards):
        return None
    for _, hb_shape, hb, held in shards:
        if hb.HasField("byte_strides") and list(hb.byte_strides.strides) not in ([], c_strides(dtype, hb_shape)):
            return None
        check_size(held, dtype, hb_shape)
    assert sharding.op_sharding is not None
    staged = [(indices, held, hb_shape) for indices, hb_shape, _, held in shards]
    buffer_id = await put(sharding.devices, sharding.op_sharding, domains, dtype, shape, staged)
    return None if buffer_id is None else whole(Buf(buffer_id, dtype, shape, spread=True), sharding, domains)


async def check_value_ready(session: Session, req: Message, resp: Message, proto: Any) -> None:
    ids: dict[int, None] = {}
    for h in req.check_value_ready_request.value_handles:
        value = await session.handles.resolve(h)
        if isinstance(value, ArrayRecord):
            ids.update((b.id, None) for b in value.buffers)
    if ids:
        await session.backend.ready(list(ids))
    resp.check_value_ready_response.SetInParent()


async def release_all(session: Session, handles: Sequence[int]) -> None:
    """Drops `handles` (a DestructArray's or DeleteArray's list). Those free now go at once, their
    buffers in one `free`; those that an earlier request still uses (or whose op still runs) wait
    for that (`pop_resolved`: a free never overtakes a use), in order: once the first is free, it
    goes with those after it that are free by then (the request that used them all is over), in
    one `free` again, and so on."""
    table = session.handles
    values, busy = table.pop_free(handles)
    unref_all(session, (v for v in values if isinstance(v, ArrayRecord)))
    i = 0
    while i < len(busy):
        first = await table.pop_resolved(busy[i])
        values, i = table.pop_run(busy, i + 1)
        unref_all(session, (v for v in (first, *values) if isinstance(v, ArrayRecord)))


async def destruct_array(session: Session, req: Message, resp: Message, proto: Any) -> bytes:
    handles = req.destruct_array_request.array_handle  # repeated since protocol version 22
    bounded(handles, "destruct_array_request.array_handle", session.handles.limit, " (a session's handles)")
    await release_all(session, handles)
    return session.encoder.empty("destruct_array_response")  # always empty: made once


async def delete_array(session: Session, req: Message, resp: Message, proto: Any) -> None:
    handles = req.delete_array_request.array_handle  # repeated, as DestructArray's
    bounded(handles, "delete_array_request.array_handle", session.handles.limit, " (a session's handles)")
    await release_all(session, handles)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    future_handle = session.handles.new_handle()
    session.handles.put(future_handle, done)  # the client may CheckFuture the deletion
    resp.delete_array_response.deletion_future_handle = future_handle


# The client-chosen result handles of each request kind: a failed request marks them with its
# error (requirement 7), so later uses report the original error rather than "unknown handle".
RESULT_HANDLES = {
    "make_array_from_host_buffer_request": ("array_handle",),
    "fully_replicated_shard_request": ("result_handle",),
    "loaded_executable_execute_request": ("result_array_handle",),
    "make_arrays_from_host_buffer_shards_request": ("array_handles",),
    "assemble_array_from_single_device_arrays_request": ("result_handle",),
    "disassemble_into_single_device_arrays_request": ("result_handles",),
    "copy_arrays_request": ("result_handles",),
    "remap_arrays_request": ("result_handles",),
}

# The handles each request kind reads: claimed when the request is read, so a DestructArray
# read after it waits until it is done (handles.py).
USED_HANDLES = {
    "loaded_executable_execute_request": ("args_handles",),
    "copy_to_host_buffer_request": ("array_handle",),
    "check_value_ready_request": ("value_handles",),
    "fully_replicated_shard_request": ("array_handle",),
    "disassemble_into_single_device_arrays_request": ("array_handle",),
    "assemble_array_from_single_device_arrays_request": ("single_device_array_handles",),
    "copy_arrays_request": ("array_handles",),
    "remap_arrays_request": ("array_handles",),
}

HANDLERS = {
    "make_array_from_host_buffer_request": make_array_from_host_buffer,
    "make_arrays_from_host_buffer_shards_request": make_arrays_from_host_buffer_shards,
    "check_value_ready_request": check_value_ready,
    "destruct_array_request": destruct_array,
    "delete_array_request": delete_array,
}
