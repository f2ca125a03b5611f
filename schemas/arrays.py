"""Arrays on the wire: raw C-order bytes with a dtype name and a shape (no pickle), and back.

Shared by the client (uploads, fetches) and the workers (fetches, peer transfers). Dtype names
are numpy's; bfloat16 and the other ML types resolve through ml_dtypes, which JAX ships.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ALIGN", "aligned_empty", "byte_view", "c_order", "dtype_name", "from_bytes", "from_parts",
           "resolve_dtype", "to_bytes", "to_numpy"]


# XLA on CPU adopts a host array that starts on a 64-byte boundary without copying it (a jit call's
# argument or `jax.device_put`: the device buffer aliases the numpy memory); numpy's own allocations
# are only 16-byte aligned, so a 64 MiB array received into `np.empty` costs another 64 MiB copy
# into a fresh (page-faulting) device buffer when its consumer runs (bench/FINDINGS.md, "mhperf")
ALIGN = 64


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialised C-order array whose data starts on an `ALIGN`-byte boundary."""
    dt = np.dtype(dtype)
    shp = tuple(int(d) for d in shape)
    nbytes = math.prod(shp) * dt.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)  # numpy asks for huge pages on large allocations
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes].view(dt).reshape(shp)


def dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def resolve_dtype(name: str) -> np.dtype[Any]:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        kind = getattr(ml_dtypes, name, None)
        if kind is None:
            raise ValueError(f"unknown dtype {name!r}") from None
        return np.dtype(kind)


def from_bytes(dtype: str, shape: Sequence[int], data: Any) -> np.ndarray:
    """A read-only array over `data` (bytes, or a buffer at least that large: a page-rounded
    shared-memory segment); raises ValueError when the buffer is too small."""
    dt = resolve_dtype(dtype)
    shp = tuple(int(d) for d in shape)
    count = math.prod(shp)
    need, got = count * dt.itemsize, memoryview(data).nbytes
    if got < need:
        raise ValueError(f"{got} bytes for {dtype}{list(shp)}, expected {need}")
    return np.frombuffer(data, dtype=dt, count=count).reshape(shp)


def from_parts(dtype: str, shape: Sequence[int], parts: Sequence[bytes]) -> np.ndarray:
    """The array whose bytes are `parts` joined (a chunked stream's messages), copied once into
    an aligned array (`aligned_empty`) rather than joined into bytes that XLA would copy again;
    raises ValueError when they are too few."""
    dt = resolve_dtype(dtype)
    out = aligned_empty(shape, dt)
    view = byte_view(out)
    need, off = len(view), 0
    for p in parts:
        if off >= need:
            break
        take = min(len(p), need - off)
        view[off:off + take] = memoryview(p)[:take]
        off += take
    if off < need:
        raise ValueError(f"{sum(len(p) for p in parts)} bytes for {dtype}{list(out.shape)}, expected {need}")
    return out


def to_bytes(a: Any) -> tuple[str, list[int], bytes]:
    """(dtype name, shape, raw C-order bytes): the inverse of `from_bytes`."""
    arr = np.asarray(a)
    return arr.dtype.name, [int(d) for d in arr.shape], arr.tobytes(order="C")


def to_numpy(value: Any) -> np.ndarray:
    """The full (global) value of a JAX or numpy array; zero-copy where JAX allows (CPU)."""
    return np.asarray(value)


def c_order(a: Any) -> np.ndarray:
    """A C-contiguous array of the same shape (np.ascontiguousarray turns 0-d into 1-d)."""
    a = np.asarray(a)
    return a if a.flags.c_contiguous else np.array(a, order="C")


def byte_view(a: Any) -> memoryview:
    """The raw C-order bytes of `a` as a flat memoryview of unsigned bytes, without a copy where `a`
    is already C-contiguous. `memoryview(a.data).cast("B")` cannot do this for the ML dtypes
    (bfloat16 and friends have no buffer-protocol format), so view the array as uint8 first."""
    return c_order(a).reshape(-1).view(np.uint8).data
