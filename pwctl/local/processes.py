"""Processes on this machine: liveness, signals, detached spawning, pid and state files."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import psutil

from .. import paths
from ..errors import InvalidArgument

CONTROLLER_MODULE = "server.controller"
WORKER_MODULE = "server.worker"
POLL_S = 0.05
READY_POLL_S = 0.02  # waiting for a starting controller or workers: every poll is cheap
CONTROLLER_START_TIMEOUT_S = 20.0
WORKER_READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0


def _status(pid: int) -> str | None:
    """The process's psutil status, or None when it is gone (zombies are reaped if ours)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reaps it when it is our child; a no-op otherwise
    try:
        status = psutil.Process(pid).status()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return None if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else str(status)


def is_alive(pid: int) -> bool:
    return pid > 0 and _status(pid) is not None


def runs_module(pid: int, module: str) -> bool:
    """True when `pid` is alive and is a `python -m <module>` process (not a reused pid)."""
    if not is_alive(pid):
        return False
    try:
        cmdline = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return any(a == module for a in cmdline[1:]) and "-m" in cmdline


def _wait_gone(pids: Iterable[int], timeout: float) -> set[int]:
    """Polls until every pid is gone; returns those still alive at the deadline."""
    left = {p for p in pids if is_alive(p)}
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        time.sleep(POLL_S)
        left = {p for p in left if is_alive(p)}
    return left


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def terminate(pids: Sequence[int], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL for whatever is still alive after `grace` seconds."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    left = _wait_gone(pids, grace)
    for pid in left:
        _signal(pid, signal.SIGKILL)
    _wait_gone(left, 5.0)


def stop_children(procs: Iterable[subprocess.Popen[Any]], grace: float = STOP_GRACE_S) -> None:
    """Stops child processes started here: SIGTERM the live ones, SIGKILL what is left after
    `grace` seconds, and reap them all (no zombies)."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def remove_pid_file(path: Path, pid: int) -> None:
    """Removes the pid file `path` if it still names `pid` (not one a later start wrote)."""
    if (_read_json(path) or {}).get("pid") == pid:
        path.unlink(missing_ok=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def _log_tail(path: Path, offset: int = 0) -> str:
    """The last non-empty line written to `path` after `offset` (what usually says why)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            lines = [ln.strip() for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _server_env(env: dict[str, str] | None) -> dict[str, str]:
    """`env` (default this process's) without the gRPC log level `pwctl` set for itself (cli/main.py)."""
    env = dict(os.environ if env is None else env)
    if env.pop("PWCTL_QUIETED_GRPC", None):
        env.pop("GRPC_VERBOSITY", None)
    return env


def _spawn(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Starts a detached process (own session, so Ctrl-C in this terminal leaves it alone)."""
    env = _server_env(env)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    paths.private_file(log_path)  # 0600 before the first line (pwctl/paths.py)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            close_fds=True,
        )


def _check_address(address: str) -> None:
    try:
        paths.split_address(address)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def _exec(args: list[str], env: dict[str, str]) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(args[0], args, _server_env(env))
