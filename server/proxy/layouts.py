"""How the proxy lays out an array's bytes: dtypes, byte strides, and XLA's layout text.

The client names a dtype by its `xla.ifrt.DTypeProto` kind (`DTYPES`: the numpy name the workers'
buffers hold), sends host buffers in C order or with byte strides (a shard sent as a view into
the host array it came from: `strided`), reads them back in C order only (`check_c_order`), and
asks for the default layout as XLA's layout text (`default_layout`, requirement 3 in
docs/facts.md).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from schemas.arrays import resolve_dtype

from . import shardings as sh
from .handles import HandleError, HostData, Staged

Message = Any

# xla.ifrt.DTypeProto.Kind names -> numpy dtype names (what the workers' buffers hold)
DTYPES = {
    "KIND_PRED": "bool", "KIND_S8": "int8", "KIND_S16": "int16", "KIND_S32": "int32", "KIND_S64": "int64",
    "KIND_U8": "uint8", "KIND_U16": "uint16", "KIND_U32": "uint32", "KIND_U64": "uint64",
    "KIND_F16": "float16", "KIND_F32": "float32", "KIND_F64": "float64", "KIND_BF16": "bfloat16",
    "KIND_C64": "complex64", "KIND_C128": "complex128",
}


def numpy_dtype(dtype_proto: Message) -> str:
    kind = dtype_proto.DESCRIPTOR.fields_by_name["kind"].enum_type.values_by_number.get(dtype_proto.kind)
    name = DTYPES.get(kind.name if kind is not None else "")
    if name is None:
        raise HandleError("UNIMPLEMENTED", f"arrays of dtype {kind.name if kind else dtype_proto.kind} "
                          "are not supported by the Pathways IFRT proxy server")
    return name


def c_strides(dtype: str, shape: tuple[int, ...]) -> list[int]:
    """The byte strides of a C-order array."""
    expected, step = [], resolve_dtype(dtype).itemsize
    for d in reversed(shape):
        expected.append(step)
        step *= d
    return expected[::-1]


def check_c_order(strides: Message, dtype: str, shape: tuple[int, ...]) -> None:
    """UNIMPLEMENTED unless `strides` (a ByteStrides message) are none or C order's."""
    if not strides.strides:
        return
    if list(sh.shape_of(strides.strides, "byte strides")) != c_strides(dtype, shape):
        raise HandleError("UNIMPLEMENTED", f"byte strides {list(strides.strides)} (only C order is supported)")


def strided(raw: bytes, dtype: str, shape: tuple[int, ...], strides: Message | None) -> np.ndarray:
    """The array a host buffer holds: C order, or the byte strides the client sent (a shard sent
    as a view into the host array it came from)."""
    np_dtype = resolve_dtype(dtype)
    if strides is None or not strides.strides:
        check_size(raw, dtype, shape)
        return np.frombuffer(raw, np_dtype).reshape(shape)
    st = sh.shape_of(strides.strides, "byte strides")
    if len(st) != len(shape) or any(x < 0 for x in st):
        raise HandleError("INVALID_ARGUMENT", f"byte strides {list(st)} for a {len(shape)}-d array")
    span = 0 if 0 in shape else sum((d - 1) * x for d, x in zip(shape, st, strict=True)) + np_dtype.itemsize
    if len(raw) < span:
        raise HandleError("INVALID_ARGUMENT", f"host buffer of {len(raw)} bytes for a {dtype}{list(shape)} array "
                          f"with byte strides {list(st)} ({span} bytes)")
    if span == 0:
        return np.empty(shape, np_dtype)
    return np.ascontiguousarray(np.ndarray(shape, np_dtype, buffer=raw, strides=st))


def check_size(data: bytes | HostData | Staged, dtype: str, shape: tuple[int, ...]) -> None:
    """INVALID_ARGUMENT unless `data` is as long as a C-order array of this dtype and shape."""
    expected = math.prod(shape) * resolve_dtype(dtype).itemsize
    if len(data) != expected:
        raise HandleError("INVALID_ARGUMENT", f"host buffer of {len(data)} bytes for a {dtype}{list(shape)} "
                          f"array ({expected} bytes)")


def default_layout(rank: int) -> bytes:
    """XLA layout text of the descending (row-major) layout, e.g. `{1,0}` (requirement 3)."""
    return ("{" + ",".join(str(d) for d in reversed(range(rank))) + "}").encode()
