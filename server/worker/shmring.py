"""A shared-memory ring from one worker to another on the same host, for peer transfers.

A pipeline hop moves hundreds of small arrays a second between two workers. Through gRPC each
costs copies into and out of protobuf and HTTP/2 flow control (0.3-0.6 ms of CPU per 256 KiB
array on each side, measured in a pipeline); a fresh shared-memory segment per array costs
shm_open, mmap and a page fault per 4 KiB (it still carries arrays too big for a ring:
`put_segment`). Instead, each connection to a peer on the same host (locallink.py) carries one
ring: the sender copies an array into the ring and sends only where it is; the receiver copies
it out and marks it read. Notices of one connection arrive in the order they were written, so
what was read is one number (`released`, the seq of the last array read, in the ring's header,
written only by the receiver) and the sender never blocks: a full ring sends the array the old
way.

The receiver unlinks a segment's name as soon as it maps it, so no crash of either side leaves
it behind; a ring nobody opened is unlinked by its writer when its connection closes.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
import re
import secrets
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from schemas.arrays import ALIGN, aligned_empty

__all__ = ["RingReader", "RingWriter", "aligned_copy", "is_segment_name", "put_segment", "take_segment"]

RING_BYTES = 4 * 1024 * 1024  # arrays up to a quarter (1 MiB; larger ones get a segment each)
HEADER = 64  # released (the seq of the last array read): uint64 at offset 8
# each array starts on a cache line, ALIGN (64) bytes (and XLA on CPU can alias it without a copy)


PREFIX = "/pw_ring_"
_NAME = re.compile(r"/pw_ring_[0-9a-f]{16}")


def is_segment_name(name: str) -> bool:
    """Whether `name` is one this module makes: a receiver opens (and unlinks) no other segment,
    whoever names it."""
    return _NAME.fullmatch(name) is not None


# POSIX shared memory without multiprocessing.shared_memory: on Python 3.11 that registers every
# segment with a resource-tracker process (started on first use) that unlinks it at exit; here
# the owners decide, as the module docstring says.
def _create(size: int) -> tuple[str, mmap.mmap]:
    name = PREFIX + secrets.token_hex(8)
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size)
        return name, mmap.mmap(fd, size)
    except BaseException:
        _unlink(name)
        raise
    finally:
        os.close(fd)


def _open(name: str) -> mmap.mmap:
    if not is_segment_name(name):
        raise ValueError(f"{name!r} is not a transfer segment")
    fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass  # the reader mapped it and unlinked the name already


def put_segment(arr: np.ndarray) -> str:
    """A new segment holding a copy of `arr` (one array too big for a ring); its name. The
    receiver unlinks it (`take_segment`)."""
    name, m = _create(max(1, arr.nbytes))
    dst = np.ndarray(arr.shape, arr.dtype, buffer=m)
    dst[...] = arr
    del dst  # the map cannot close while a view of it exists
    m.close()
    return name


def put_parts_segment(parts: Sequence[Any], nbytes: int) -> str:
    """Like `put_segment` for bytes in parts (buffer-protocol objects, `nbytes` in all), written
    one after another: nothing is joined first."""
    name, m = _create(max(1, nbytes))
    try:
        offset = 0
        for part in parts:
            view = memoryview(part).cast("B")
            m[offset : offset + len(view)] = view
            offset += len(view)
        if offset != nbytes:
            raise ValueError(f"{offset} bytes in parts of {nbytes}")
    except BaseException:
        m.close()
        _unlink(name)
        raise
    m.close()
    return name


def take_segment(name: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
    """A copy of the array in segment `name`, which it unlinks; ValueError when it is too small."""
    m = _open(name)
    try:
        _unlink(name)
        out = _copy_from(m, 0, dtype, shape)
        if out is None:
            raise ValueError(f"segment {name}: {len(m)} bytes for {dtype}{list(shape)}")
    finally:
        m.close()
    return out


def _copy_from(m: mmap.mmap, offset: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray | None:
    """An aligned copy of the array at `offset` of `m`, or None when it does not fit there."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if offset < 0 or offset + nbytes > len(m):
        return None
    return aligned_copy(np.ndarray(shape, dtype, buffer=m, offset=offset))


def aligned_copy(src: np.ndarray) -> np.ndarray:
    """A C-order copy of `src` starting on a 64-byte boundary."""
    out = aligned_empty(src.shape, src.dtype)
    out[...] = src
    return out


class RingWriter:
    """The sending side: `put` copies an array in and says where, or None when it does not fit."""

    def __init__(self, capacity: int = RING_BYTES) -> None:
        self.capacity = capacity
        self.name, self._map = _create(HEADER + capacity)
        self._closed = False
        self._counters = np.ndarray((2,), np.uint64, buffer=self._map)
        self._seq = 0  # arrays put so far
        self._pos = 0  # where the next array goes
        self._live: deque[tuple[int, int]] = deque()  # (seq, offset) of arrays not read yet, oldest first
        self._lock = threading.Lock()

    def released(self) -> int:
        """The seq of the last array the reader copied out (they are read in order)."""
        return int(self._counters[1])

    def put(self, arr: np.ndarray) -> tuple[int, int] | None:
        """(offset, seq) with the array's bytes copied in at `offset`; the reader marks `seq` read
        once it copied them out. None when the ring has no room now."""
        n = -(-max(arr.nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            if self._closed or n > self.capacity // 4:
                return None
            offset = self._place(n)
            if offset is None:
                return None
            np.ndarray(arr.shape, arr.dtype, buffer=self._map, offset=HEADER + offset)[...] = arr
            self._seq += 1
            self._live.append((self._seq, offset))
            self._pos = offset + n
            return offset, self._seq

    def _place(self, n: int) -> int | None:
        """Where n bytes fit after the live arrays (which never wrap), or None."""
        done = self.released()
        while self._live and self._live[0][0] <= done:
            self._live.popleft()
        if not self._live:
            return 0  # an empty ring starts over: light traffic keeps to (and keeps resident) its first pages
        oldest, newest = self._live[0][1], self._live[-1][1]
        if newest >= oldest:  # live bytes are [oldest, pos): free are [pos, end) and [0, oldest)
            if self._pos + n <= self.capacity:
                return self._pos
            return 0 if n <= oldest else None
        return self._pos if self._pos + n <= oldest else None  # live wrapped: free is [pos, oldest)

    def close(self) -> None:
        """Unlinks the ring if its reader never did; the mapping goes with this object."""
        with self._lock:
            if not self._closed:
                self._closed = True
                _unlink(self.name)


class RingReader:
    """The receiving side of one stream: maps the ring on first use (and unlinks its name)."""

    def __init__(self) -> None:
        self._name = ""
        self._map: mmap.mmap | None = None
        self._counters: np.ndarray[Any, Any] | None = None

    def take(self, name: str, offset: int, release: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        """A copy of the array at `offset` of ring `name`; marks it read (`release`: its seq)."""
        if self._map is None or name != self._name:
            self._map, self._name = _open(name), name
            _unlink(name)  # mapped on both sides now: nothing is left behind whoever dies
            self._counters = np.ndarray((2,), np.uint64, buffer=self._map)
        assert self._counters is not None
        out = _copy_from(self._map, HEADER + offset, dtype, shape)
        if out is None:
            raise ValueError(f"ring {name}: {dtype}{list(shape)} at {offset} is past its end")
        self._counters[1] = release
        return out
