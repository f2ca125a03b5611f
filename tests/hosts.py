"""Separate hosts on one machine for tests: the `hosts` fixture over bench/netns.py (the
namespace machinery, shared with the multi-host benchmarks), whose names are re-exported here.

`hosts` (fixture): a factory, `hosts(3)` -> list[Host]; skips with the reason when namespaces
cannot be made (not root, no `ip`/`nsenter`/`unshare`, or the kernel refuses).
"""

from __future__ import annotations

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
