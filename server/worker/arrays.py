"""Arrays as raw bytes with dtype and shape (no pickle), and back."""

from __future__ import annotations

from typing import Any

import numpy as np


def dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def resolve_dtype(name: str) -> np.dtype[Any]:
    """numpy does not know bfloat16 and friends by name; ml_dtypes (shipped with jax) does."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def numpy_from_bytes(dtype: str, shape: Any, data: Any) -> np.ndarray:
    dt = resolve_dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    return np.frombuffer(data, dtype=dt, count=count).reshape(tuple(shape))


def array_to_numpy(value: Any) -> np.ndarray:
    """The full (global) value of a JAX array or numpy array, zero-copy where JAX allows."""
    return np.asarray(value)


def c_order(a: Any) -> np.ndarray:
    """A C-contiguous array of the same shape (np.ascontiguousarray turns 0-d into 1-d)."""
    a = np.asarray(a)
    return a if a.flags.c_contiguous else np.array(a, order="C")
