"""Arrays on the wire: raw C-order bytes with a dtype name and a shape (no pickle), and back.

Shared by the client (uploads, fetches) and the workers (fetches, peer transfers). Dtype names
are numpy's; bfloat16 and the other ML types resolve through ml_dtypes, which JAX ships.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["byte_view", "c_order", "dtype_name", "from_bytes", "resolve_dtype", "to_bytes", "to_numpy"]


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
