"""The shards a worker holds of an array that lives on several workers' devices (a jax.Array
that is not fully addressable: a multi-host slice's result, or an uploaded part), read by the
store's accounting (buffers.py) and by fetches and transfers of its parts (parts.py)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["distinct_shards", "held_nbytes", "is_partial"]


def is_partial(value: Any) -> bool:
    """Whether this worker holds only part of the value (its other shards are on peers)."""
    return not getattr(value, "is_fully_addressable", True)


def distinct_shards(value: Any) -> dict[tuple[int, ...], Any]:
    """Start index -> shard of each distinct shard on this worker's devices (a shard replicated
    over several of them once, the first device's)."""
    seen: dict[tuple[int, ...], Any] = {}
    for shard in value.addressable_shards:
        start = tuple(0 if s.start is None else int(s.start) for s in shard.index)
        seen.setdefault(start, shard)
    return seen


def held_nbytes(value: Any) -> int:
    """The bytes of `value` this worker holds: the whole array's, or for an array spread over
    several workers the distinct shards on its own devices (a replicated shard once, as every
    value of the store counts its logical bytes once, not per device)."""
    if not is_partial(value):
        return int(getattr(value, "nbytes", 0))
    return sum(math.prod(s.data.shape) for s in distinct_shards(value).values()) * value.dtype.itemsize
