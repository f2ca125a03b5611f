"""Keeping Python's cyclic garbage collector, and page faults, off the hot path of long-running
server processes.

A worker imports JAX and compiles programs: hundreds of thousands of long-lived Python objects.
Every full collection walks all of them, and the hot path's allocations (protobuf messages,
futures, closures) trigger collections often: measured with perf, 30-40% of a pipeline worker's
event-loop thread was `gc_collect_main` and its visitors. `settle()` collects once and moves the
survivors to the permanent generation (`gc.freeze()`), so later collections scan only objects
made since; the servers call it when they are ready and again when they go idle (after
`gc.unfreeze()`, so garbage among earlier survivors is still found).

`reuse_large_buffers()` is for the controller, through which the IFRT proxy's transfers pass as
1-4 MiB messages: glibc's malloc maps a buffer over its mmap threshold (128 KiB until the free
of a larger mapping raises it) afresh and unmaps it when freed, and returns a heap's free top to
the system beyond twice that threshold, so whether those messages came from reused memory or
were page-faulted in again depended on what the process had allocated and freed before: one
64 MiB upload cost the controller 0.06 s of CPU in one process and 0.12 s (~24k page faults)
in another (bench/FINDINGS.md, 2026-11-25 22:45).
"""

from __future__ import annotations

import ctypes
import gc
import logging

log = logging.getLogger(__name__)

# Young collections after this many net allocations (CPython's default is 700): the hot path
# makes a few hundred objects per request, nearly all freed by reference counting.
GEN0_THRESHOLD = 10_000


def settle() -> None:
    """Full collection, then freeze the survivors; raise the young-generation threshold."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)


# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: buffers up to this come from the heap, reused
TRIM_THRESHOLD = 64 << 20  # free memory a heap keeps mapped for the next buffers


def reuse_large_buffers() -> bool:
    """Has glibc's malloc serve buffers up to 32 MiB from its heaps and keep up to 64 MiB free
    in each for reuse, instead of mapping and unmapping each one (this module's docstring).
    False where the C library has no `mallopt` (not glibc): nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.info("mallopt refused the heap thresholds; large buffers are mapped afresh")
    return ok
