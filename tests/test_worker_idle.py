"""The worker's reconnect schedule and its idle-time memory release (pure logic, no processes)."""

from __future__ import annotations

import platform

from server.worker import memory
from server.worker.reconnect import Reconnect


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


def test_trim_is_safe_everywhere() -> None:
    assert memory.trim_available() == (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
    assert isinstance(memory.trim(), bool)


def test_workers_keep_freed_memory_until_trimmed() -> None:
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert memory.keep_freed_memory() == glibc  # glibc took every setting
    assert isinstance(memory.trim(), bool)
