"""Separate hosts on one machine for tests: the `hosts` fixture over bench/netns.py (the
namespace machinery, shared with the multi-host benchmarks), whose names are re-exported here,
and what the tests on such hosts share: a controller started on one of them (`start_controller`)
and reading a program's output lines as they come (`read_until`).

`hosts` (fixture): a factory, `hosts(3)` -> list[Host]; skips with the reason when namespaces
cannot be made (not root, no `ip`/`nsenter`/`unshare`, or the kernel refuses).
"""

from __future__ import annotations

import re
import select
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.netns import (  # noqa: F401  (re-exported for the tests)
    READY_TIMEOUT_S,
    REPO,
    XLA_FLAGS,
    Host,
    Hosts,
    NamespaceUnavailable,
    _pids_in_netns,
    unavailable,
)


def start_controller(host: Host, heartbeat_timeout: float, port: int = 0, *extra: str) -> tuple[str, str]:
    """`pwctl server start` on `host`, listening on its own address, with `extra` options;
    (address, cluster token). Beyond loopback the controller requires the token: it wrote it to
    the host's data directory."""
    r = host.pwctl("server", "start", "--listen", f"{host.ip}:{port}", "--heartbeat-timeout", f"{heartbeat_timeout:g}",
                   *extra)
    assert r.returncode == 0, f"server start: {r.stdout}{r.stderr}"
    m = re.search(r"at (\S+:\d+)", r.stdout)
    assert m, r.stdout
    address = m.group(1)
    assert address.startswith(host.ip + ":"), address
    return address, (host.home / "token").read_text().strip()


def read_until(proc: Any, pattern: str | tuple[str, ...], deadline: float, lines: list[str]) -> str | None:
    """Lines of `proc`'s stdout (collected in `lines`) until one starts with `pattern` (or one of
    them: returned),
    the stream ends or the process exits (None), or the monotonic `deadline` passes (None)."""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if not line:
                return None
            lines.append(line)
            if line.startswith(pattern):
                return line
        elif proc.poll() is not None:
            return None
    return None


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Any]:
    """`hosts(n)` -> n Hosts of one bridge; all torn down after the test, pass or fail."""
    made: list[Hosts] = []

    def make(n: int) -> list[Host]:
        if (why := unavailable()) is not None:
            pytest.skip(why)
        h = Hosts(tmp_path / f"hosts{len(made)}")
        made.append(h)
        try:
            return h.start(n)
        except NamespaceUnavailable as e:
            h.close()
            pytest.skip(f"cannot make network namespaces here: {e}")

    yield make
    for h in made:
        h.close()
