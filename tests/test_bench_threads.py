"""The per-thread scheduler statistics behind `python -m bench.threads` (no cluster)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from bench.threads import ThreadStat, medians, per_call, read_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_read_threads_sees_a_busy_thread_of_this_process() -> None:
    stop = threading.Event()
    tid: list[int] = []

    def spin() -> None:
        tid.append(threading.get_native_id())
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin)
    t.start()
    try:
        while not tid:
            pass
        before = read_threads()[tid[0]]
        stop.wait(0.05)
        after = read_threads(os.getpid())[tid[0]]
    finally:
        stop.set()
        t.join()
    assert after.run_ns > before.run_ns  # it ran meanwhile
    assert after.slices >= before.slices


def test_per_call_and_medians() -> None:
    a = ("worker-a", 11, "python")
    gone = ("worker-a", 12, "python")
    new = ("controller", 13, "python")
    before = {a: ThreadStat("python", 1_000_000, 0, 10), gone: ThreadStat("python", 5, 5, 5)}
    after = {a: ThreadStat("python", 3_000_000, 400_000, 30), new: ThreadStat("python", 7, 7, 7)}
    rows = per_call(before, after, calls=100)
    assert rows == {a: (20.0, 4.0, 0.2)}  # threads not alive at both ends are left out
    assert medians([rows, {a: (10.0, 0.0, 0.1)}, {a: (40.0, 2.0, 0.3)}]) == {a: (20.0, 2.0, 0.2)}
