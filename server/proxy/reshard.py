"""The proxy's requests that regroup shards into other arrays: FullyReplicatedShard,
DisassembleIntoSingleDeviceArrays, AssembleArrayFromSingleDeviceArrays, CopyArrays and
RemapArrays (as jaxlib 0.10.2 and pathwaysutils send them).

None of them moves bytes: an array is its parts (arrays.py), so a new array is new parts over
the same worker buffers, read as the request's sharding says. The buffers' values never change
(a donated buffer that another array reads is not given up: executables.py), so sharing is safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import shardings as sh
from .arrays import ArrayRecord, Part, full, new_record, parse_sharding
from .handles import MAX_HANDLES, HandleError, bounded
from .layouts import numpy_dtype
from .shardings import Index, Sharding

if TYPE_CHECKING:
    from .service import Session

Message = Any


async def fully_replicated_shard(session: Session, req: Message, resp: Message, proto: Any) -> None:
    r = req.fully_replicated_shard_request
    handle = session.handles.reserve_or_new(r.result_handle)
    rec = await session.handles.resolve(r.array_handle, ArrayRecord)
    if rec.domains[0] != full(rec.shape):
        raise HandleError("INVALID_ARGUMENT", "FullyReplicatedShard of an array that is not fully replicated")
    shard = new_record(rec.dtype, rec.shape, Sharding(rec.sharding.devices[:1]), rec.parts[:1])
    session.handles.settle(handle, shard)
    resp.fully_replicated_shard_response.array_handle = handle


async def disassemble(session: Session, req: Message, resp: Message, proto: Any) -> None:
    r = req.disassemble_into_single_device_arrays_request
    # an array has a shard per device at most
    bounded(r.result_handles, "disassemble_into_single_device_arrays_request.result_handles", _devices(session),
            " (the session's devices)")
    for h in r.result_handles:  # before any await: later requests may use them
        session.handles.reserve(h)
    rec = await session.handles.resolve(r.array_handle, ArrayRecord)
    n = len(rec.parts)
    results = list(r.result_handles) or [session.handles.reserve_new() for _ in range(n)]
    if len(results) != n:
        raise HandleError("INVALID_ARGUMENT", f"an array of {n} shards, {len(results)} result handles")
    for h, part, dom, dev in zip(results, rec.parts, rec.domains, rec.sharding.devices, strict=True):
        session.handles.settle(h, new_record(rec.dtype, sh.index_shape(dom), Sharding((dev,)), [part]))
    resp.disassemble_into_single_device_arrays_response.array_handles.extend(results)


async def assemble(session: Session, req: Message, resp: Message, proto: Any) -> None:
    r = req.assemble_array_from_single_device_arrays_request
    handle = session.handles.reserve_or_new(r.result_handle)
    bounded(r.single_device_array_handles, "assemble_array_from_single_device_arrays_request."
            "single_device_array_handles", _devices(session), " (the session's devices)")
    shards = [await session.handles.resolve(h, ArrayRecord) for h in r.single_device_array_handles]
    if not shards:
        raise HandleError("INVALID_ARGUMENT", "an array assembled from no shards")
    shape = sh.shape_of(r.shape.dims)
    dtype = numpy_dtype(r.dtype) if r.HasField("dtype") else shards[0].dtype
    sharding = parse_sharding(session, r.sharding, proto)
    if len(shards) != len(sharding.devices):
        raise HandleError("INVALID_ARGUMENT", f"{len(shards)} shards for a sharding over {len(sharding.devices)} "
                          "devices")
    parts = []
    for i, (s, dom) in enumerate(zip(shards, sharding.domains(shape), strict=True)):
        if len(s.parts) != 1 or s.dtype != dtype or s.shape != sh.index_shape(dom):
            raise HandleError("INVALID_ARGUMENT", f"shard {i}: a {s.dtype}{list(s.shape)} array where a single-device "
                              f"{dtype}{list(sh.index_shape(dom))} shard is expected")
        parts.append(s.parts[0])
    session.handles.settle(handle, new_record(dtype, shape, sharding, parts))
    resp.assemble_array_from_single_device_arrays_response.array_handle = handle


async def copy_arrays(session: Session, req: Message, resp: Message, proto: Any) -> None:
    r = req.copy_arrays_request
    results = session.handles.reserve_all(r.result_handles, len(r.array_handles))
    if results is None:
        raise HandleError("INVALID_ARGUMENT", f"{len(r.array_handles)} arrays, {len(r.result_handles)} result handles")
    bounded(r.device_ids, "copy_arrays_request.device_ids", _devices(session), " (the session's devices)")
    devices = tuple(int(d) for d in r.device_ids)
    known = {d.id for d in session.backend.slice.devices}
    if not set(devices) <= known:
        raise HandleError("INVALID_ARGUMENT", f"devices {sorted(set(devices) - known)} are not the session's")
    for h, src in zip(results, r.array_handles, strict=True):
        rec = await session.handles.resolve(src, ArrayRecord)
        # the value does not move: a buffer is the array's value wherever the client sees it, and
        # a program reading it places it on its own devices (server/worker/executable.py)
        session.handles.settle(h, new_record(rec.dtype, rec.shape, rec.sharding.with_devices(devices), list(rec.parts)))
    resp.copy_arrays_response.array_handles.extend(results)


def _devices(session: Session) -> int:
    return len(session.backend.slice.devices)


def _intervals(start: Any, end: Any, step: Any, shards: int) -> list[int]:
    """The shard indices a mapping's intervals name, in order: at most `shards` (the output
    array's: a mapping's from and to lists are as long, and each output shard is filled once),
    counted before any is made (an interval of 2**62 shards is one compare, not a list)."""
    if not len(start) == len(end) == len(step):
        raise HandleError("INVALID_ARGUMENT", f"a remap mapping with {len(start)} interval starts, {len(end)} ends "
                          f"and {len(step)} steps")
    bounded(start, "remap_arrays_request.plan.mappings intervals", shards, " (the output array's shards)")
    out: list[int] = []
    for a, b, c in zip(start, end, step, strict=True):
        if c <= 0:
            raise HandleError("INVALID_ARGUMENT", f"a remap interval with step {c}")
        span = range(a, b, c)
        if len(out) + len(span) > shards:
            raise HandleError("INVALID_ARGUMENT", f"remap_arrays_request.plan.mappings: intervals naming more than "
                              f"{shards} shards (the output array's)")
        out.extend(span)
    return out


async def remap_arrays(session: Session, req: Message, resp: Message, proto: Any) -> None:
    """Output shards taken from input shards, as the plan says (nothing moves: the outputs' parts
    are the inputs' parts)."""
    r = req.remap_arrays_request
    plan = r.plan  # its `input_devices_for_output`, never read, is not bounded (as execute's unread fields)
    bounded(plan.output_specs, "remap_arrays_request.plan.output_specs", MAX_HANDLES)
    bounded(plan.mappings, "remap_arrays_request.plan.mappings", MAX_HANDLES)
    results = session.handles.reserve_all(r.result_handles, len(plan.output_specs))
    if results is None:
        raise HandleError("INVALID_ARGUMENT", f"{len(plan.output_specs)} outputs, {len(r.result_handles)} result "
                          "handles")
    inputs = [await session.handles.resolve(h, ArrayRecord) for h in r.array_handles]
    if len(inputs) != len(plan.input_specs):
        raise HandleError("INVALID_ARGUMENT", f"a plan for {len(plan.input_specs)} arrays applied to {len(inputs)}")
    specs = []
    for spec in plan.output_specs:
        sharding = parse_sharding(session, spec.sharding, proto)
        specs.append((numpy_dtype(spec.dtype), sh.shape_of(spec.shape.dims), sharding))
    parts: list[dict[int, tuple[Part, Index | None]]] = [{} for _ in specs]
    for m in plan.mappings:
        if not (0 <= m.in_array < len(inputs) and 0 <= m.out_array < len(specs)):
            raise HandleError("INVALID_ARGUMENT", f"a remap mapping {m.in_array} -> {m.out_array} out of range")
        src = inputs[m.in_array]
        shards = len(specs[m.out_array][2].devices)
        froms = _intervals(m.from_start, m.from_end, m.from_step, shards)
        tos = _intervals(m.to_start, m.to_end, m.to_step, shards)
        if len(froms) != len(tos):
            raise HandleError("INVALID_ARGUMENT", "a remap mapping with intervals of different lengths")
        dtype, shape, _ = specs[m.out_array]
        for j, t in zip(froms, tos, strict=True):
            if not 0 <= j < len(src.parts):
                raise HandleError("INVALID_ARGUMENT", f"shard {j} of an array of {len(src.parts)} shards")
            if src.dtype != dtype:
                raise HandleError("INVALID_ARGUMENT", f"a {src.dtype} shard remapped into a {dtype} array")
            # where the shard sits in the output: where it sat in the input when the shapes agree
            parts[m.out_array][t] = (src.parts[j], src.domains[j] if src.shape == shape else None)
    for h, (dtype, shape, sharding), got in zip(results, specs, parts, strict=True):
        n = len(sharding.devices)
        if sorted(got) != list(range(n)):
            raise HandleError("INVALID_ARGUMENT", f"the plan fills shards {sorted(got)} of an array of {n}")
        if sharding.explicit is not None:  # an even sharding, which says shards' shapes, not places
            domains = [got[t][1] for t in range(n)]
            if all(d is not None for d in domains):
                # of an array of the same shape, each shard is where it was (xla::ifrt reorder_shards:
                # the same shards on the devices of a mesh in another order), not in device order
                sharding = Sharding(sharding.devices, None, tuple(d for d in domains if d is not None))
            elif sharding.explicit == ():
                raise HandleError("UNIMPLEMENTED", "a remap into an array of another shape with an even sharding")
        session.handles.settle(h, new_record(dtype, shape, sharding, [got[t][0] for t in range(n)]))
    resp.remap_arrays_response.array_handles.extend(results)


HANDLERS = {
    "fully_replicated_shard_request": fully_replicated_shard,
    "disassemble_into_single_device_arrays_request": disassemble,
    "assemble_array_from_single_device_arrays_request": assemble,
    "copy_arrays_request": copy_arrays,
    "remap_arrays_request": remap_arrays,
}
