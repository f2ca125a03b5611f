"""Workers on this machine: start, find, stop, and wait until the controller has them ready."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from schemas.pathways.v1 import common_pb2 as pb

from .. import paths, settings
from ..client import Client
from ..errors import ConnectionFailed, InvalidArgument, NotFound, PathwaysError, Rejected
from ..tls import TlsConfig
from ..transport import NO_RETRY
from ..version import check_jax
from .processes import (
    READY_POLL_S,
    STOP_GRACE_S,
    WORKER_MODULE,
    WORKER_READY_TIMEOUT_S,
    _check_address,
    _exec,
    _log_tail,
    _read_json,
    _spawn,
    _write_json,
    is_alive,
    runs_module,
    terminate,
)


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


def _worker_args(server: str, island: str, devices: str, name: str, listen: str, no_token: bool = False,
                 tls: TlsConfig | None = None) -> list[str]:
    return [sys.executable, "-m", WORKER_MODULE, "--server", server, "--island", island,
            "--devices", devices, "--name", name, "--listen", listen, *(["--no-token"] if no_token else []),
            *(tls.args() if tls is not None else [])]


def _worker_env(server: str, token: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PWCTL_SERVER"] = server
    token = token or settings.resolve(server).token
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
    no_token: bool = False,
    token: str | None = None,
    tls: TlsConfig | None = None,
) -> int:
    """Starts a worker process; returns its pid. It connects (and reconnects) on its own.

    `devices` is a count of virtual CPU devices or "all" (every accelerator found).
    With `detach=False` this process becomes the worker (exec) and never returns.
    `no_token`: the worker checks no cluster token (a private machine); its callers still need
    the credentials the controller issues (server/worker/auth.py). `token`: the cluster token
    the worker presents (default: as `pwctl` finds it, `$PWCTL_TOKEN` first). `tls`: it serves TLS
    only and reaches the controller and its peers over TLS (pwctl/tls.py).
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
    check_jax("the worker")  # the process would refuse too, in its log: say it here, before spawning
    args = _worker_args(server, island, devices, name, listen, no_token, tls)
    env = _worker_env(server, token)
    if not detach:
        _exec(args, env)
    proc = _spawn(args, worker_log_path(name), env)
    _write_json(worker_pid_path(name), {"pid": proc.pid, "name": name, "island": island, "devices": devices,
                                        "server": server})
    return proc.pid


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
    address: str, workers: dict[str, int], timeout: float = WORKER_READY_TIMEOUT_S, token: str | None = None,
    tls: TlsConfig | None = None,
) -> None:
    """Polls the controller (over TLS with `tls`) until every `name -> pid` is registered and ready.

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
                client = client or Client(server=address, token=token, timeout=2.0, retry=NO_RETRY, tls=tls)
                for h in client.hosts():
                    if h.name in pending and h.pid == pending[h.name] and h.state == pb.HOST_STATE_READY:
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

