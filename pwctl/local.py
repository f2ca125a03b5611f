"""Process management for a cluster on this machine: the controller, workers, `up` and `down`.

Client-library code (no CLI in here): `pwctl server|worker|up|down` call it, and so can scripts.

Invariants:
- Every process is found again through a file under the data directory, never by name:
  the controller through `server.pid` (written by the controller once it serves), workers through
  `workers/<name>.pid`, and what `up` started through `cluster.json`.
- Nothing is signalled unless its pid is alive *and* its command line runs the module we started
  (`server.controller` / `server.worker`), so a stale pid file whose pid was reused is harmless.
- Zombies count as gone: a detached process whose parent exited may stay a zombie under an init
  that does not reap.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import psutil

from schemas.pathways.v1 import common_pb2 as pb

from . import paths
from .client import Client
from .errors import ConnectionFailed, InvalidArgument, NotFound, PathwaysError, Rejected

CONTROLLER_MODULE = "server.controller"
WORKER_MODULE = "server.worker"
POLL_S = 0.05
READY_POLL_S = 0.02  # waiting for a starting controller or workers: every poll is cheap
CONTROLLER_START_TIMEOUT_S = 20.0
WORKER_READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0


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


@dataclass(frozen=True)
class UpResult:
    address: str
    islands: list[str]
    devices: int
    controller_started: bool
    worker_pids: dict[str, int]
    started_workers: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DownResult:
    address: str
    stopped_workers: dict[str, int]
    controller_pid: int | None


# ---------------------------------------------------------------------------------------------
# processes


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


def _spawn(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Starts a detached process (own session, so Ctrl-C in this terminal leaves it alone)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
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


# ---------------------------------------------------------------------------------------------
# controller


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


def _answers(address: str, timeout: float = 1.0) -> bool:
    """True when a controller answers GetInfo at `address` (a rejection is an answer too)."""
    try:
        with Client(server=address, timeout=timeout) as c:
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
    log_path = paths.server_log_path()
    offset = _log_size(log_path)
    args = [sys.executable, "-m", CONTROLLER_MODULE,
            *_controller_args(listen, db, dispatch, heartbeat_timeout, extra_args),
            "--pid-file", str(paths.server_pid_path())]
    return _spawn(args, log_path), offset


def _wait_controller(proc: subprocess.Popen[bytes], log_offset: int, db: str,
                     timeout: float = CONTROLLER_START_TIMEOUT_S) -> ControllerHandle:
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
        if address and _answers(address):
            return ControllerHandle(pid=proc.pid, address=address, db=db, log_path=log_path, started=True)
        if time.monotonic() > deadline:
            raise PathwaysError(
                f"the controller (pid {proc.pid}) did not answer within {timeout:g} s (log: {log_path})"
            )
        time.sleep(READY_POLL_S)


def start_controller(
    listen: str = paths.DEFAULT_ADDRESS,
    db: str | None = None,
    foreground: bool = False,
    dispatch: str = "parallel",
    heartbeat_timeout: float = 5.0,
    extra_args: Sequence[str] = (),
) -> ControllerHandle:
    """Starts the controller detached and waits until it answers.

    Returns the running controller's handle (with `started=False`) when the pid file names one
    that answers. `foreground=True` runs it in this process until it stops (see
    `run_controller_foreground`) and returns only then.
    """
    _check_address(listen)
    db = db or paths.default_db_url()
    running = running_controller()
    if running is not None:
        return running
    if foreground:
        run_controller_foreground(listen, db, dispatch, heartbeat_timeout, extra_args)
    proc, offset = _spawn_controller(listen, db, dispatch, heartbeat_timeout, extra_args)
    return _wait_controller(proc, offset, db)


def run_controller_foreground(
    listen: str, db: str, dispatch: str = "parallel", heartbeat_timeout: float = 5.0,
    extra_args: Sequence[str] = (),
) -> NoReturn:
    """This process becomes the controller (exec, same pid), logging to stderr until it stops.

    Exec rather than serving in-process so that the pid file names a `python -m server.controller`
    process, which `pwctl server stop` and `pwctl server start` recognise.
    """
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
    if (_read_json(pid_path) or {}).get("pid") == pid:
        pid_path.unlink(missing_ok=True)
    return pid


def _stop_controller_pid(pid: int, address: str, timeout: float) -> None:
    if address:
        with contextlib.suppress(PathwaysError), Client(server=address, timeout=2.0) as c:
            c.shutdown()
    if _wait_gone([pid], timeout):
        terminate([pid])


# ---------------------------------------------------------------------------------------------
# workers


def worker_pid_path(name: str) -> Path:
    return paths.data_dir() / "workers" / f"{name}.pid"


def worker_log_path(name: str) -> Path:
    return paths.logs_dir() / f"worker-{name}.log"


def default_worker_name(island: str) -> str:
    """The name the worker itself picks when given none (server/worker/__main__.py)."""
    return f"{socket.gethostname()}-{island}"


def _check_name(name: str, what: str) -> None:
    if not name or "/" in name or name.startswith(".") or any(c.isspace() for c in name):
        raise InvalidArgument(f"invalid {what} {name!r}: use letters, digits, '-', '_' or '.'")


def _worker_args(server: str, island: str, devices: str, name: str, listen: str) -> list[str]:
    return [sys.executable, "-m", WORKER_MODULE, "--server", server, "--island", island,
            "--devices", devices, "--name", name, "--listen", listen]


def _worker_env(server: str) -> dict[str, str]:
    from . import settings

    env = dict(os.environ)
    env["PWCTL_SERVER"] = server
    token = settings.resolve(server).token
    if token:
        env["PWCTL_TOKEN"] = token  # the worker reads its token from the environment only
    return env


def running_worker(name: str) -> int | None:
    """The pid of the worker started here under `name`, when it is still running."""
    info = _read_json(worker_pid_path(name))
    pid = int(info.get("pid", 0)) if info else 0
    return pid if pid and runs_module(pid, WORKER_MODULE) else None


def start_worker(
    server: str,
    island: str,
    devices: int | str,
    name: str | None = None,
    listen: str = "127.0.0.1:0",
    detach: bool = True,
) -> int:
    """Starts a worker process; returns its pid. It connects (and reconnects) on its own.

    `devices` is a count of virtual CPU devices or "all" (every accelerator found).
    With `detach=False` this process becomes the worker (exec) and never returns.
    """
    _check_address(server)
    _check_address(listen)
    _check_name(island, "island name")
    devices = str(devices)
    if devices != "all" and (not devices.isdigit() or int(devices) <= 0):
        raise InvalidArgument(f"--devices must be a positive number or 'all', not {devices!r}")
    name = name or default_worker_name(island)
    _check_name(name, "worker name")
    pid = running_worker(name)
    if pid is not None:
        raise Rejected(
            f"worker {name!r} is already running (pid {pid}); stop it with `pwctl worker stop {name}`"
        )
    args = _worker_args(server, island, devices, name, listen)
    env = _worker_env(server)
    if not detach:
        _exec(args, env)
    proc = _spawn(args, worker_log_path(name), env)
    _write_json(worker_pid_path(name), {"pid": proc.pid, "name": name, "island": island, "devices": devices,
                                        "server": server})
    return proc.pid


def _exec(args: list[str], env: dict[str, str]) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(args[0], args, env)


def stop_worker(name: str, grace: float = STOP_GRACE_S) -> int:
    """Stops the worker started here under `name` (SIGTERM, SIGKILL after `grace`); returns its pid."""
    pid = running_worker(name)
    path = worker_pid_path(name)
    if pid is None:
        existed = path.exists()
        path.unlink(missing_ok=True)
        raise NotFound(
            f"no worker named {name!r} is running"
            + (" (removed its stale pid file)" if existed else " from this machine's data directory")
        )
    terminate([pid], grace)
    path.unlink(missing_ok=True)
    return pid


def wait_workers_ready(
    address: str, workers: dict[str, int], timeout: float = WORKER_READY_TIMEOUT_S
) -> None:
    """Polls the controller until every `name -> pid` is registered and ready.

    The pid must match, so a host entry left over from an earlier process of the same name
    does not count. Raises when a worker process dies or the deadline passes.
    """
    deadline = time.monotonic() + timeout
    pending = dict(workers)
    client: Client | None = None
    try:
        while pending:
            for name, pid in list(pending.items()):
                if not is_alive(pid):
                    log_path = worker_log_path(name)
                    why = _log_tail(log_path) or "no log output"
                    raise PathwaysError(f"worker {name} (pid {pid}) exited: {why} (log: {log_path})")
            try:
                client = client or Client(server=address, timeout=2.0)
                for h in client.hosts():
                    if h.name in pending and h.pid == pending[h.name] and h.state == _READY:
                        del pending[h.name]
            except ConnectionFailed:
                # a fresh channel next time: a failed one backs off for a second before retrying
                if client is not None:
                    client.close()
                client = None
            if pending and time.monotonic() > deadline:
                names = ", ".join(sorted(pending))
                raise PathwaysError(
                    f"workers not ready after {timeout:g} s: {names} (logs in {paths.logs_dir()})"
                )
            if pending:
                time.sleep(READY_POLL_S)
    finally:
        if client is not None:
            client.close()


_READY = pb.HOST_STATE_READY


# ---------------------------------------------------------------------------------------------
# up / down


def island_names(n: int) -> list[str]:
    """a, b, ..., z, aa, ab, ..."""
    out = []
    for i in range(n):
        s, k = "", i
        while True:
            s = chr(ord("a") + k % 26) + s
            k = k // 26 - 1
            if k < 0:
                break
        out.append(s)
    return out


def up(
    islands: int = 2,
    devices: int = 4,
    listen: str = paths.DEFAULT_ADDRESS,
    db: str | None = None,
    timeout: float = WORKER_READY_TIMEOUT_S,
) -> UpResult:
    """Starts (or completes) a local cluster: the controller and one worker per island.

    The controller is reused when one is running. Worker `local-<island>` is started unless a
    process of that name already runs. Everything starts at once (workers retry connecting on
    their own); returns when every worker is ready. Idempotent.
    """
    if islands < 1 or devices < 1:
        raise InvalidArgument("--islands and --devices must be at least 1")
    _check_address(listen)
    db = db or paths.default_db_url()
    state = _read_json(paths.cluster_state_path()) or {}
    running = running_controller()
    proc: subprocess.Popen[bytes] | None = None
    log_offset = 0
    if running is not None:
        address = running.address
    else:
        proc, log_offset = _spawn_controller(listen, db, "parallel", 5.0, ())
        address = listen
    if proc is not None and paths.split_address(listen)[1] == 0:
        # the port is known only once the controller serves: workers must wait for it
        address = _wait_controller(proc, log_offset, db).address

    names = island_names(islands)
    worker_pids: dict[str, int] = {}
    for name, pid in dict(state.get("worker_pids", {})).items():
        if runs_module(int(pid), WORKER_MODULE):
            worker_pids[name] = int(pid)
    started: list[str] = []
    for island in names:
        name = f"local-{island}"
        pid = worker_pids.get(name) or running_worker(name)
        if pid is None:
            pid = start_worker(address, island, devices, name)
            started.append(name)
        worker_pids[name] = pid

    controller_pid = state.get("controller_pid")
    if proc is not None:
        address = _wait_controller(proc, log_offset, db).address
        controller_pid = proc.pid
    elif running is not None and controller_pid != running.pid:
        controller_pid = None  # someone else's controller: `down` leaves it alone
    new_state: dict[str, Any] = {"address": address, "worker_pids": worker_pids}
    if controller_pid:
        new_state["controller_pid"] = controller_pid
    # written before waiting, so `down` can clean up even when a worker fails to come up
    _write_json(paths.cluster_state_path(), new_state)
    wait_workers_ready(address, {n: worker_pids[n] for n in (f"local-{i}" for i in names)}, timeout)
    return UpResult(address=address, islands=names, devices=devices, controller_started=proc is not None,
                    worker_pids=worker_pids, started_workers=started)


def down(grace: float = STOP_GRACE_S) -> DownResult | None:
    """Stops exactly what `up` recorded in cluster.json (workers first), by pid; None if nothing."""
    path = paths.cluster_state_path()
    state = _read_json(path)
    if state is None:
        return None
    workers = {str(n): int(p) for n, p in dict(state.get("worker_pids", {})).items()}
    ours = {n: p for n, p in workers.items() if runs_module(p, WORKER_MODULE)}
    terminate(list(ours.values()), grace)
    for name, pid in workers.items():
        if (_read_json(worker_pid_path(name)) or {}).get("pid") == pid:
            worker_pid_path(name).unlink(missing_ok=True)
    controller_pid = state.get("controller_pid")
    stopped_controller: int | None = None
    if controller_pid and runs_module(int(controller_pid), CONTROLLER_MODULE):
        stopped_controller = int(controller_pid)
        _stop_controller_pid(stopped_controller, str(state.get("address", "")), 10.0)
        if (_read_json(paths.server_pid_path()) or {}).get("pid") == stopped_controller:
            paths.server_pid_path().unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    return DownResult(address=str(state.get("address", "")), stopped_workers=ours,
                      controller_pid=stopped_controller)
