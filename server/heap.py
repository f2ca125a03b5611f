"""Keeping Python's cyclic garbage collector off the hot path of long-running server processes.

A worker imports JAX and compiles programs: hundreds of thousands of long-lived Python objects.
Every full collection walks all of them, and the hot path's allocations (protobuf messages,
futures, closures) trigger collections often: measured with perf, 30-40% of a pipeline worker's
event-loop thread was `gc_collect_main` and its visitors. `settle()` collects once and moves the
survivors to the permanent generation (`gc.freeze()`), so later collections scan only objects
made since; the servers call it when they are ready and again when they go idle (after
`gc.unfreeze()`, so garbage among earlier survivors is still found).
"""

from __future__ import annotations

import gc

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
