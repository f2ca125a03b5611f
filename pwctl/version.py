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


# ---------------------------------------------------------------- the installed JAX
# What this release supports and was tested with. pyproject.toml declares the same range for
# jax and jaxlib (tests/test_operator_edges.py keeps the two in step). The controller builds the
# IFRT proxy's messages from the installed jaxlib and checks a client's protocol versions at its
# GetVersion (server/proxy/protocol.py); multi-host groups use jaxlib internals that move between
# releases (docs/multihost.md). So the controller and workers check the installed versions before
# anything else, and refuse to start outside the range unless told to.
JAX_SUPPORTED = ((0, 10, 2), (0, 12))  # lowest supported, first unsupported
JAX_TESTED = "0.10.2 (CPU, Python 3.11) and 0.11.2 (an H100, Python 3.12)"
ALLOW_UNTESTED_JAX = "PATHWAYS_ALLOW_UNTESTED_JAX"


def _numbers(version: str) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def installed(distribution: str) -> str | None:
    """The installed version of `distribution` (from its metadata: nothing is imported), or None."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def jax_problems(versions: dict[str, str | None] | None = None) -> list[str]:
    """What is wrong with the installed jax and jaxlib for this release ([] when nothing):
    `versions` maps 'jax' and 'jaxlib' to a version (None: not installed); default: installed."""
    found = versions if versions is not None else {d: installed(d) for d in ("jax", "jaxlib")}
    lo, hi = JAX_SUPPORTED
    span = f">={'.'.join(map(str, lo))},<{'.'.join(map(str, hi))}"
    out = []
    for dist in ("jax", "jaxlib"):
        v = found.get(dist)
        n = _numbers(v) if v else None
        if v is None:
            out.append(f"{dist} is not installed: pip install '{dist}{span}'")
        elif n is None or not lo <= n < hi:
            out.append(f"{dist} {v} is installed, but this Pathways release supports {dist}{span} (tested with "
                       f"{JAX_TESTED}): the IFRT proxy protocol and multi-host groups depend on jaxlib's "
                       f"version; install a supported one (pip install 'jax{span}' 'jaxlib{span}'), or set "
                       f"{ALLOW_UNTESTED_JAX}=1 to start anyway")
    jv, lv = found.get("jax"), found.get("jaxlib")
    if not out and jv and lv and _numbers(jv)[:2] != _numbers(lv)[:2]:  # type: ignore[index]
        out.append(f"jax {jv} and jaxlib {lv} are from different releases: install the same version of both "
                   f"(pip install 'jax=={jv}' 'jaxlib=={jv}'), or set {ALLOW_UNTESTED_JAX}=1 to start anyway")
    return out


def check_jax(what: str) -> list[str]:
    """Called at the start of the controller and of a worker (`what` names it). Returns warnings to
    log when the installed jax/jaxlib do not match but $PATHWAYS_ALLOW_UNTESTED_JAX is set; raises
    FailedPrecondition with the first problem otherwise."""
    problems = jax_problems()
    if problems and not os.environ.get(ALLOW_UNTESTED_JAX):
        raise FailedPrecondition(f"{what} not started: {problems[0]}")
    return [f"{p} (starting anyway: {ALLOW_UNTESTED_JAX} is set)" for p in problems]
