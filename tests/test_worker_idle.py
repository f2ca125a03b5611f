"""The worker's reconnect schedule and its idle-time memory release (pure logic, no processes)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

from server.worker import memory
from server.worker.reconnect import Reconnect

REPO = Path(__file__).resolve().parent.parent


def test_reconnect_retries_quickly_while_the_controller_is_unreachable() -> None:
    r = Reconnect(max_s=2.0, fast_s=0.05, fast_for_s=5.0)
    assert [r.delay(t) for t in (0.0, 0.05, 1.0, 4.9)] == [0.05] * 4
    # past the fast window the wait doubles up to max_s
    assert [r.delay(t) for t in (5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 12.0, 20.0)] == [
        0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]
    # once connected, an outage starts over with quick retries
    r.connected()
    assert r.delay(100.0) == 0.05 and r.delay(101.0) == 0.05


def test_reconnect_backs_off_when_rejected() -> None:
    r = Reconnect(max_s=2.0, fast_s=0.05, fast_for_s=5.0)
    assert r.delay(0.0, rejected=True) == 0.05
    assert [r.delay(t, rejected=True) for t in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0]


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_idle_trimmer_fires_once_per_quiet_period() -> None:
    clock, state = _Clock(), [0]
    idle = memory.IdleTrimmer(lambda: state[0], idle_s=1.0, clock=clock)
    assert not idle.due() and not idle.quiet()
    clock.t = 1.0
    assert idle.quiet() and idle.due()  # the first quiet period after start trims (start-up garbage)
    clock.t = 2.0
    assert idle.quiet() and not idle.due()  # nothing happened since
    state[0] = 1  # work
    clock.t = 2.5
    assert not idle.due() and not idle.quiet()
    state[0] = 2  # still busy
    clock.t = 3.0
    assert not idle.due()
    clock.t = 3.9
    assert not idle.due()  # quiet for 0.9 s only
    clock.t = 4.0
    assert idle.due() and idle.trims == 2
    clock.t = 9.0
    assert not idle.due() and idle.quiet()


GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Allocates `count` blocks of `size` bytes from the heap (touched), a live block above them, frees
# the blocks, trims; prints the resident size at each step. In its own process: the allocator's
# settings and state are per process.
FREE_THEN_TRIM = """
import json, os, sys
from server.worker import memory
keep = memory.keep_freed_memory() if sys.argv[1] == "keep" else None
size, count = int(sys.argv[2]), int(sys.argv[3])
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
blocks = [bytes([1]) * size for _ in range(count)]
pin = bytes([2]) * size
high = rss()
del blocks
freed = rss()
trimmed = memory.trim()
print(json.dumps({"keep": keep, "high": high, "freed": freed, "trimmed": trimmed, "low": rss()}))
"""


def free_then_trim(mode: str, size: int, count: int) -> dict[str, int | bool | None]:
    r = subprocess.run([sys.executable, "-c", FREE_THEN_TRIM, mode, str(size), str(count)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_trim_returns_freed_heap_memory() -> None:
    """64 MiB in 64 KiB blocks (heap, below glibc's default mmap threshold) freed below a live
    block, which glibc's automatic top trim cannot return: `trim()` does, and says so."""
    assert memory.trim_available() == GLIBC
    out = free_then_trim("default", 64 << 10, 1024)
    if not GLIBC:
        assert out["trimmed"] is False
        return
    assert out["trimmed"] is True
    assert out["high"] - out["low"] >= 48 << 20, out


def test_workers_keep_freed_memory_until_trimmed() -> None:
    """With the worker's settings, 48 MiB freed in 1 MiB blocks (heap, not mmap) stays resident
    until `trim()` returns it."""
    out = free_then_trim("keep", 1 << 20, 48)
    assert out["keep"] is GLIBC  # glibc took every setting
    if not GLIBC:
        return
    assert out["high"] - out["freed"] < 8 << 20, out  # freeing kept the memory
    assert out["trimmed"] is True and out["freed"] - out["low"] >= 40 << 20, out
