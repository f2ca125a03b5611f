"""Which controllers this pwctl talks to: the same major and minor version (0.1.x with 0.1.y).

`pwctl` asks the controller's version once per command before it does anything else
(`check_server`), so a mismatch is one clear error up front instead of a confusing failure
halfway (a field the other side does not know). `PWCTL_SKIP_VERSION_CHECK=1` skips it.
"""

from __future__ import annotations

import os
import re
from typing import Protocol

from . import __version__
from .errors import FailedPrecondition


class _HasInfo(Protocol):
    address: str

    def info(self, timeout: float | None = None) -> object: ...


def release(version: str) -> tuple[int, int] | None:
    """'0.1.0' -> (0, 1); None when it is not MAJOR.MINOR[...]."""
    m = re.match(r"(\d+)\.(\d+)", version.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def compatible(ours: str, theirs: str) -> bool:
    a, b = release(ours), release(theirs)
    return a is not None and a == b


def mismatch(server_version: str, address: str) -> str:
    return (f"pwctl {__version__} does not talk to the controller at {address}, which runs version "
            f"{server_version or '(unknown)'}: install the same version on both sides (pip install "
            f"'pathways=={server_version}'), or use the pwctl installed with the controller "
            "(PWCTL_SKIP_VERSION_CHECK=1 skips this check)")


def check_server(c: _HasInfo) -> None:
    """Raises FailedPrecondition (exit 4) when the controller's version is not compatible."""
    if os.environ.get("PWCTL_SKIP_VERSION_CHECK"):
        return
    version = str(getattr(c.info(), "version", ""))
    if not compatible(__version__, version):
        raise FailedPrecondition(mismatch(version, c.address))
