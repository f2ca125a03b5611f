"""Giving freed heap memory back to the operating system when the worker goes quiet.

XLA allocates every buffer and compilation scratch space with malloc, from many threads. glibc
keeps freed memory in its per-thread arenas for reuse instead of returning it, so after a burst of
large computations (a training step frees hundreds of MiB of inputs, outputs and temporaries) the
process keeps that memory resident although nothing uses it (measured: a worker at 1.3 GiB after
a few transformer steps, 0.6 GiB after a trim). `malloc_trim(0)` hands the free pages of every
arena back. Done once the worker has been idle for a moment, it costs nothing while work flows and
one thread for a few milliseconds (up to a few hundred when GiBs come back) when it stops.

While work flows the opposite holds: glibc serves a block of 128 KiB or more with a fresh mmap
unless its adaptive threshold has grown past it, and trims the heap top as soon as 128 KiB there is
free, so a pipeline stage's 256 KiB buffers came back as new pages each time (measured: ~80 page
faults per micro-batch per worker, a tenth of a worker's CPU). `keep_freed_memory()` makes the heap
serve blocks up to 16 MiB and keep up to 64 MiB of free memory at its top between trims; the idle
trim still returns all of it.

It also caps glibc's arenas at two. By default a process gets up to eight per core, one per thread
that allocates, and an arena's pages stay resident while any small block on them lives: XLA's and
gRPC's threads each kept a partly used 64 MiB arena, so after a transformer run and a trim a worker
held ~100 MiB more than with two arenas (measured: worker PSS 250-360 MiB vs 200-240 MiB). The
threads that allocate on the hot path are few (launch, completion, event loop, XLA's), so sharing
two arenas costs no measurable time.

Without glibc (musl, macOS) `trim()` does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import platform
import time
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["IdleTrimmer", "keep_freed_memory", "trim", "trim_available"]

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 16 * 1024 * 1024
TRIM_THRESHOLD = 64 * 1024 * 1024
ARENA_MAX = 2


def _glibc_function(name: str, argtypes: list[Any]) -> Any:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = getattr(ctypes.CDLL(None), name)  # the libc this process already uses
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


_malloc_trim = _glibc_function("malloc_trim", [ctypes.c_size_t])
_mallopt = _glibc_function("mallopt", [ctypes.c_int, ctypes.c_int])


def keep_freed_memory() -> bool:
    """Buffers up to 16 MiB come from the heap and freed memory stays there until `trim()`
    (fixed glibc thresholds instead of adaptive ones), in at most two arenas; True when glibc
    took every setting. Call it before threads start allocating (before JAX's backend starts)."""
    if _mallopt is None:
        return False
    settings = ((_M_ARENA_MAX, ARENA_MAX), (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return all([bool(_mallopt(param, value)) for param, value in settings])


def trim_available() -> bool:
    return _malloc_trim is not None


def trim() -> bool:
    """Returns free heap memory to the OS (glibc `malloc_trim(0)`); True when some was released.

    ctypes drops the GIL for the call, so other Python threads keep running meanwhile.
    """
    if _malloc_trim is None:
        return False
    return bool(_malloc_trim(0))


_NEVER = object()


class IdleTrimmer:
    """Decides when to trim: after something happened (`activity()` changed) and then nothing
    for `idle_s` seconds; once per quiet period. Call `due()` periodically (it is cheap when
    nothing changed); trim when it returns True.

    `activity` returns a value that changes whenever the worker did work or freed memory, e.g.
    (nodes executed, live buffers, buffer bytes).
    """

    def __init__(self, activity: Callable[[], Hashable], idle_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.activity = activity
        self.idle_s = idle_s
        self.clock = clock
        self._last = activity()
        self._changed_at = clock()
        self._trimmed: object = _NEVER  # the first quiet period trims too (start-up garbage)
        self.trims = 0

    def due(self) -> bool:
        now = self.clock()
        current = self.activity()
        if current != self._last:
            self._last, self._changed_at = current, now
            return False
        if current == self._trimmed or now - self._changed_at < self.idle_s:
            return False
        self._trimmed = current
        self.trims += 1
        return True

    def quiet(self) -> bool:
        """Whether nothing happened for `idle_s` seconds, as of the last `due()`."""
        return self.clock() - self._changed_at >= self.idle_s
