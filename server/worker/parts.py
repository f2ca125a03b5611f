"""An array of a multi-host slice as this worker holds it: the parts of the global array that
live on its devices (a jax.Array that is not fully addressable), for fetching.

The client asks every member worker for its parts (`FetchRequest.parts`) and puts the global
array together (pwctl/api/futures.py); replicated shards are sent once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from schemas import arrays
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb

__all__ = ["is_partial", "local_parts", "part_chunks"]


def is_partial(value: Any) -> bool:
    """Whether this worker holds only part of the value (its other shards are on peers)."""
    return not getattr(value, "is_fully_addressable", True)


def local_parts(value: Any) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """(start index, data) of each distinct shard on this worker's devices."""
    seen: dict[tuple[int, ...], np.ndarray] = {}
    for shard in value.addressable_shards:
        start = tuple(0 if s.start is None else int(s.start) for s in shard.index)
        if start not in seen:
            seen[start] = arrays.c_order(np.asarray(shard.data))
    return list(seen.items())


def part_chunks(parts: list[tuple[tuple[int, ...], np.ndarray]], global_shape: tuple[int, ...],
                chunk: int) -> Iterator[wpb.FetchChunk]:
    """The FetchChunks of a parts reply (worker.proto, FetchChunk): `last` on the final one."""
    for k, (start, data) in enumerate(parts):
        raw = arrays.byte_view(data)
        n = max(1, -(-len(raw) // chunk))
        for i in range(n):
            piece = pb.ArrayProto(data=bytes(raw[i * chunk:(i + 1) * chunk]))
            c = wpb.FetchChunk(array=piece, part=k, last=k == len(parts) - 1 and i == n - 1)
            if i == 0:  # (the chunk holds a copy of `piece`)
                c.array.dtype, c.array.shape[:] = arrays.dtype_name(data.dtype), list(data.shape)
                c.part_start[:] = list(start)
                c.global_shape[:] = list(global_shape)
            yield c


class Gathering:
    """Parts of multi-host slices' arrays arriving from their members (one Transfer stream each),
    by buffer id, until they cover the array. Identical parts (replicated shards, sent by every
    member that holds them) count once."""

    def __init__(self) -> None:
        self._open: dict[int, tuple[np.ndarray, set[tuple[int, ...]], list[int]]] = {}
        self._lock = threading.Lock()

    def add(self, buffer_id: int, global_shape: tuple[int, ...], start: tuple[int, ...],
            part: np.ndarray) -> np.ndarray | None:
        """Adds one part; the whole array once its parts cover it, else None. Raises ValueError
        for a part that does not fit the array."""
        if len(start) != len(global_shape) or part.ndim != len(global_shape) or any(
                b < 0 or b + n > g for b, n, g in zip(start, part.shape, global_shape, strict=True)):
            raise ValueError(f"a part {list(part.shape)} at {list(start)} does not fit {list(global_shape)}")
        with self._lock:
            entry = self._open.get(buffer_id)
            if entry is None:
                entry = self._open[buffer_id] = (np.empty(global_shape, part.dtype), set(), [0])
            whole, seen, covered = entry
            if whole.dtype != part.dtype or whole.shape != global_shape:
                raise ValueError(f"parts of buffer {buffer_id} disagree on dtype or shape")
            if start not in seen:
                seen.add(start)
                whole[tuple(slice(b, b + n) for b, n in zip(start, part.shape, strict=True))] = part
                covered[0] += part.size
            if covered[0] < whole.size:
                return None
            del self._open[buffer_id]
            return whole

    def drop(self, buffer_id: int) -> None:
        with self._lock:
            self._open.pop(buffer_id, None)
