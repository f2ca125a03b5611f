"""The controller on this machine: start (detached or in the foreground), find, stop."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from .. import paths
from ..client import Client
from ..errors import ConnectionFailed, PathwaysError
from ..tls import TlsConfig
from ..transport import NO_RETRY
from ..version import check_jax
from .processes import (
    CONTROLLER_MODULE,
    CONTROLLER_START_TIMEOUT_S,
    POLL_S,
    READY_POLL_S,
    _check_address,
    _exec,
    _log_size,
    _log_tail,
    _read_json,
    _spawn,
    _wait_gone,
    is_alive,
    remove_pid_file,
    runs_module,
    stop_children,
    terminate,
)
from .tlsfiles import publish as publish_tls


@dataclass(frozen=True)
class ControllerHandle:
    """A controller that answers. `started` is False when it was already running."""

    pid: int
    address: str
    db: str
    log_path: Path
    started: bool = True

    @property
    def already_running(self) -> bool:
        return not self.started


def running_controller(timeout: float = 2.0) -> ControllerHandle | None:
    """The controller named by the pid file when it is alive and answers; None otherwise.

    A live controller process that does not answer within `timeout` is an error: starting a
    second one on the same data directory would fight over the pid file and the database.
    """
    info = _read_json(paths.server_pid_path())
    if not info:
        return None
    pid, address = int(info.get("pid", 0)), str(info.get("address", ""))
    if not runs_module(pid, CONTROLLER_MODULE):
        return None
    handle = ControllerHandle(pid=pid, address=address, db=str(info.get("db", "")),
                              log_path=paths.server_log_path(), started=False)
    deadline = time.monotonic() + timeout
    while True:
        if _answers(address):
            return handle
        if not is_alive(pid):
            return None
        if time.monotonic() > deadline:
            raise PathwaysError(
                f"a controller process (pid {pid}) is running but does not answer at {address}; "
                f"see {paths.server_log_path()} or stop it with `pwctl server stop`"
            )
        time.sleep(POLL_S)


def _answers(address: str, timeout: float = 1.0, tls: TlsConfig | None = None) -> bool:
    """True when a controller answers GetInfo at `address` (a rejection is an answer too); over
    TLS with `tls`, else as `pwctl` finds its settings."""
    try:
        with Client(server=address, timeout=timeout, retry=NO_RETRY, tls=tls) as c:
            c.info(timeout=timeout)
        return True
    except ConnectionFailed:
        return False
    except PathwaysError:
        return True


def _controller_args(listen: str, db: str, dispatch: str, heartbeat_timeout: float,
                     extra_args: Sequence[str]) -> list[str]:
    return [
        "--listen", listen, "--db", db, "--dispatch", dispatch,
        "--heartbeat-timeout", f"{heartbeat_timeout:g}", *extra_args,
    ]


def _spawn_controller(listen: str, db: str, dispatch: str, heartbeat_timeout: float,
                      extra_args: Sequence[str]) -> tuple[subprocess.Popen[bytes], int]:
    """Starts the controller detached; returns the process and where its log output begins."""
    check_jax("the controller")  # it would refuse too, in its log: say it here, before spawning
    log_path = paths.server_log_path()
    offset = _log_size(log_path)
    args = [sys.executable, "-m", CONTROLLER_MODULE,
            *_controller_args(listen, db, dispatch, heartbeat_timeout, extra_args),
            "--pid-file", str(paths.server_pid_path())]
    return _spawn(args, log_path), offset


def _wait_controller(proc: subprocess.Popen[bytes], log_offset: int, db: str,
                     timeout: float = CONTROLLER_START_TIMEOUT_S, tls: TlsConfig | None = None) -> ControllerHandle:
    """Waits until the controller we spawned wrote its pid file and answers."""
    log_path = paths.server_log_path()
    deadline = time.monotonic() + timeout
    address = ""
    while True:
        rc = proc.poll()
        if rc is not None:
            why = _log_tail(log_path, log_offset) or f"exit code {rc}"
            raise PathwaysError(f"the controller failed to start: {why} (log: {log_path})")
        if not address:
            info = _read_json(paths.server_pid_path())
            if info and info.get("pid") == proc.pid:
                address = str(info.get("address", ""))
        if address and _answers(address, tls=tls):
            return ControllerHandle(pid=proc.pid, address=address, db=db, log_path=log_path, started=True)
        if time.monotonic() > deadline:
            # not left running: before its pid file names it, `pwctl server stop` cannot find it
            stop_children([proc])
            remove_pid_file(paths.server_pid_path(), proc.pid)
            raise PathwaysError(
                f"the controller (pid {proc.pid}) did not answer within {timeout:g} s and was stopped "
                f"(log: {log_path})"
            )
        time.sleep(READY_POLL_S)


def start_controller(
    listen: str = paths.DEFAULT_ADDRESS,
    db: str | None = None,
    foreground: bool = False,
    dispatch: str = "parallel",
    heartbeat_timeout: float = 5.0,
    extra_args: Sequence[str] = (),
    tls: TlsConfig | None = None,
    client_tls: TlsConfig | None = None,
) -> ControllerHandle:
    """Starts the controller detached and waits until it answers.

    Returns the running controller's handle (with `started=False`) when the pid file names one
    that answers. `foreground=True` runs it in this process until it stops (see
    `run_controller_foreground`) and returns only then. `tls`: it serves TLS only, and its CA
    (and with mutual TLS `client_tls`, the local clients' own pair) is left in the data directory
    for clients here (tlsfiles.py).
    """
    _check_address(listen)
    db = db or paths.default_db_url()
    running = running_controller()
    if running is not None:
        return running
    publish_tls(tls, client_tls)
    extra_args = [*extra_args, *(tls.args() if tls is not None else ())]
    if foreground:
        run_controller_foreground(listen, db, dispatch, heartbeat_timeout, extra_args)
    proc, offset = _spawn_controller(listen, db, dispatch, heartbeat_timeout, extra_args)
    return _wait_controller(proc, offset, db, tls=tls)


def run_controller_foreground(
    listen: str, db: str, dispatch: str = "parallel", heartbeat_timeout: float = 5.0,
    extra_args: Sequence[str] = (),
) -> NoReturn:
    """This process becomes the controller (exec, same pid), logging to stderr until it stops.

    Exec rather than serving in-process so that the pid file names a `python -m server.controller`
    process, which `pwctl server stop` and `pwctl server start` recognise.
    """
    check_jax("the controller")
    args = [sys.executable, "-m", CONTROLLER_MODULE,
            *_controller_args(listen, db, dispatch, heartbeat_timeout, extra_args),
            "--pid-file", str(paths.server_pid_path())]
    _exec(args, dict(os.environ))


def stop_controller(timeout: float = 10.0) -> int | None:
    """Stops the controller named by the pid file: Shutdown RPC, then SIGTERM, then SIGKILL.

    Returns its pid, or None when none was running (a stale pid file is removed).
    """
    pid_path = paths.server_pid_path()
    info = _read_json(pid_path)
    if not info:
        return None
    pid = int(info.get("pid", 0))
    if not runs_module(pid, CONTROLLER_MODULE):
        pid_path.unlink(missing_ok=True)
        return None
    _stop_controller_pid(pid, str(info.get("address", "")), timeout)
    remove_pid_file(pid_path, pid)
    return pid


def _stop_controller_pid(pid: int, address: str, timeout: float) -> None:
    if address:
        # the local controller's own token, whatever $PWCTL_TOKEN says (it may name another
        # cluster: refused, the controller was only terminated after `timeout`)
        with contextlib.suppress(PathwaysError), Client(server=address, token=paths.read_token(),
                                                        timeout=2.0) as c:
            c.shutdown()
    if _wait_gone([pid], timeout):
        terminate([pid])
