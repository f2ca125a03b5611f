"""Independent steps of a test run at once: each is mostly a subprocess starting (a `pwctl` call,
~0.5 s of imports on one core), so on a 2-core machine two at a time take about half as long as
one after the other. Only for steps that do not depend on each other's effects (reads of a
cluster, refusals that change nothing, clients on separate state); each result is returned, in
order, for the test to assert on separately.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from conftest import LocalCluster

T = TypeVar("T")

# A few at a time: enough to keep both cores busy while one call waits on its server.
MAX_AT_ONCE = 4


def together(*steps: Callable[[], T], at_once: int = MAX_AT_ONCE) -> list[T]:
    """Runs the steps in threads, `at_once` at a time; their results in order (the first
    exception raised)."""
    with ThreadPoolExecutor(max_workers=min(at_once, max(1, len(steps)))) as pool:
        futures = [pool.submit(step) for step in steps]
        return [f.result() for f in futures]


def pwctls(c: LocalCluster, *calls: Sequence[str], **extra_env: str) -> list[Any]:
    """`c.pwctl(*args)` for each args of `calls`, at once; the CompletedProcesses in order."""
    return together(*(lambda args=args: c.pwctl(*args, **extra_env) for args in calls))
