"""The proxy's array requests: host bytes in and out of worker buffers, and their handles.

An array handle (the client's id) maps to an `ArrayRecord`: a worker buffer of the session plus
what the client told about it. Several handles may share one buffer (FullyReplicatedShard of a
single-device array is the array itself); the buffer is freed when its last handle goes.

Supported today: single-device arrays (`xla::ifrt::SingleDeviceSharding`), in C order. Other
shardings and strides answer UNIMPLEMENTED naming what was asked.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from schemas.arrays import resolve_dtype

from .handles import HandleError

if TYPE_CHECKING:
    from .service import Session

Message = Any

# xla.ifrt.DTypeProto.Kind names -> numpy dtype names (what the workers' buffers hold)
DTYPES = {
    "KIND_PRED": "bool", "KIND_S8": "int8", "KIND_S16": "int16", "KIND_S32": "int32", "KIND_S64": "int64",
    "KIND_U8": "uint8", "KIND_U16": "uint16", "KIND_U32": "uint32", "KIND_U64": "uint64",
    "KIND_F16": "float16", "KIND_F32": "float32", "KIND_F64": "float64", "KIND_BF16": "bfloat16",
    "KIND_C64": "complex64", "KIND_C128": "complex128",
}
SINGLE_DEVICE = "xla::ifrt::SingleDeviceSharding"
HLO = "xla::ifrt::HloSharding"


@dataclass(eq=False)
class ArrayRecord:
    buffer_id: int
    dtype: str
    shape: tuple[int, ...]
    device_id: int
    refs: int = 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * resolve_dtype(self.dtype).itemsize


def numpy_dtype(dtype_proto: Message) -> str:
    kind = dtype_proto.DESCRIPTOR.fields_by_name["kind"].enum_type.values_by_number.get(dtype_proto.kind)
    name = DTYPES.get(kind.name if kind is not None else "")
    if name is None:
        raise HandleError("UNIMPLEMENTED", f"arrays of dtype {kind.name if kind else dtype_proto.kind} "
                          "are not supported by the Pathways IFRT proxy server")
    return name


def single_device(session: Session, sharding: Message, proto: Any) -> int:
    """The device of a sharding over one device (SingleDeviceSharding, or an HloSharding whose
    device list has one device); UNIMPLEMENTED for any other sharding."""
    serialized = sharding.serialized_sharding
    device_id: int | None = None
    if serialized.type_name == SINGLE_DEVICE:
        device_id = proto.cls("xla.ifrt.SingleDeviceShardingProto").FromString(serialized.data).device_id
    elif serialized.type_name == HLO:
        devices = proto.cls("xla.ifrt.HloShardingProto").FromString(serialized.data).devices.device_ids
        if len(devices) == 1:
            device_id = devices[0]
    if device_id is None:
        raise HandleError("UNIMPLEMENTED", f"arrays with sharding {serialized.type_name or '(none)'} over several "
                          "devices are not supported by the Pathways IFRT proxy server yet (single-device arrays are)")
    if device_id not in {d.id for d in session.backend.slice.devices}:
        raise HandleError("INVALID_ARGUMENT", f"device {device_id} is not one of the session's devices")
    return int(device_id)


def check_c_order(strides: Message, dtype: str, shape: tuple[int, ...]) -> None:
    if not strides.strides:
        return
    item = resolve_dtype(dtype).itemsize
    expected, step = [], item
    for d in reversed(shape):
        expected.append(step)
        step *= d
    if list(strides.strides) != expected[::-1]:
        raise HandleError("UNIMPLEMENTED", f"byte strides {list(strides.strides)} (only C order is supported)")


async def make_array_from_host_buffer(session: Session, req: Message, resp: Message, proto: Any) -> None:
    r = req.make_array_from_host_buffer_request
    handle = r.array_handle or session.handles.new_handle()
    session.handles.reserve(handle)  # before any await: later requests may use it (handles.py)
    dtype = numpy_dtype(r.dtype)
    shape = tuple(int(d) for d in r.shape.dims)
    device = single_device(session, r.sharding, proto)
    if r.HasField("byte_strides"):
        check_c_order(r.byte_strides, dtype, shape)
    data = await session.buffers.take(r.host_buffer_handle)  # may still be arriving (requirement 5)
    expected = math.prod(shape) * resolve_dtype(dtype).itemsize
    if len(data) != expected:
        raise HandleError("INVALID_ARGUMENT", f"host buffer of {len(data)} bytes for a {dtype}{list(shape)} "
                          f"array ({expected} bytes)")
    buffer_id = await session.backend.put(device, dtype, shape, data)
    session.handles.settle(handle, ArrayRecord(buffer_id, dtype, shape, device))
    resp.make_array_from_host_buffer_response.array_handle = handle


async def copy_to_host_buffer(session: Session, req: Message, resp: Message, proto: Any) -> None:
    r = req.copy_to_host_buffer_request
    rec = await session.handles.resolve(r.array_handle, ArrayRecord)
    if r.HasField("byte_strides"):
        check_c_order(r.byte_strides, rec.dtype, rec.shape)
    data = await session.backend.get(rec.buffer_id)
    if len(data) != rec.nbytes:
        raise HandleError("INTERNAL", f"worker returned {len(data)} bytes for a {rec.nbytes}-byte array")
    session.buffers.store(r.host_buffer_handle, data)
    resp.copy_to_host_buffer_response.SetInParent()


async def fully_replicated_shard(session: Session, req: Message, resp: Message, proto: Any) -> None:
    r = req.fully_replicated_shard_request
    handle = r.result_handle or session.handles.new_handle()
    session.handles.reserve(handle)
    rec = await session.handles.resolve(r.array_handle, ArrayRecord)
    session.handles.settle(handle, rec)  # a single-device array is its own (only) shard
    rec.refs += 1
    resp.fully_replicated_shard_response.array_handle = handle


async def check_value_ready(session: Session, req: Message, resp: Message, proto: Any) -> None:
    ids = []
    for h in req.check_value_ready_request.value_handles:
        value = await session.handles.resolve(h)
        if isinstance(value, ArrayRecord):
            ids.append(value.buffer_id)
    if ids:
        await session.backend.ready(ids)
    resp.check_value_ready_response.SetInParent()


async def release(session: Session, handle: int) -> None:
    value = await session.handles.pop_resolved(handle)
    if isinstance(value, ArrayRecord):
        value.refs -= 1
        if value.refs == 0:
            session.backend.free([value.buffer_id])


async def destruct_array(session: Session, req: Message, resp: Message, proto: Any) -> None:
    for handle in req.destruct_array_request.array_handle:  # repeated since protocol version 22
        await release(session, handle)
    resp.destruct_array_response.SetInParent()


async def delete_array(session: Session, req: Message, resp: Message, proto: Any) -> None:
    await release(session, req.delete_array_request.array_handle)
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

HANDLERS = {
    "make_array_from_host_buffer_request": make_array_from_host_buffer,
    "copy_to_host_buffer_request": copy_to_host_buffer,
    "fully_replicated_shard_request": fully_replicated_shard,
    "check_value_ready_request": check_value_ready,
    "destruct_array_request": destruct_array,
    "delete_array_request": delete_array,
}
