"""`up` and `down`: a whole local cluster (the controller and one worker per island)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import paths
from ..errors import InvalidArgument, PathwaysError
from ..tls import TlsConfig
from .controller import _spawn_controller, _stop_controller_pid, _wait_controller, running_controller
from .processes import (
    CONTROLLER_MODULE,
    STOP_GRACE_S,
    WORKER_MODULE,
    WORKER_READY_TIMEOUT_S,
    _check_address,
    _read_json,
    _write_json,
    remove_pid_file,
    runs_module,
    terminate,
)
from .tlsfiles import publish as publish_tls
from .workers import running_worker, start_worker, wait_workers_ready, worker_pid_path

TLS_FIELDS = ("ca", "cert", "key", "server_name", "require_client_cert")  # what cluster.json keeps of TLS


@dataclass(frozen=True)
class UpResult:
    address: str
    islands: list[str]
    devices: int | str  # per island, or "all"
    controller_started: bool
    worker_pids: dict[str, int]
    started_workers: list[str] = field(default_factory=list)
    token: str | None = None  # the cluster's own token (None: it requires none)
    foreign_controller: int | None = None  # the pid of a running controller `up` did not start: `down` leaves it
    tls: TlsConfig | None = None  # the cluster's TLS (as given, or as cluster.json kept it); None: plaintext


@dataclass(frozen=True)
class DownResult:
    address: str
    stopped_workers: dict[str, int]
    controller_pid: int | None
    left_controller: int | None = None  # a controller of this data directory `up` did not start, left running
    left_workers: dict[str, int] = field(default_factory=dict)  # `worker start` ones of this cluster, left running


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
    devices: int | str = 4,
    listen: str = paths.DEFAULT_ADDRESS,
    db: str | None = None,
    timeout: float = WORKER_READY_TIMEOUT_S,
    no_token: bool = False,
    tls: TlsConfig | None = None,
    bulk_links: bool = True,
    client_tls: TlsConfig | None = None,
    starting: Callable[[bool, list[str]], None] | None = None,
) -> UpResult:
    """Starts (or completes) a local cluster: the controller and one worker per island.

    The controller is reused when one is running. Worker `local-<island>` is started unless a
    process of that name already runs. Everything starts at once (workers retry connecting on
    their own); returns when every worker is ready. Idempotent. `devices` "all": one worker with
    every accelerator of this machine. The cluster token is made first (in the data directory,
    0600) so that the controller and the workers starting beside it agree on it; `no_token`: the
    controller and the workers it starts require none (a private machine). `bulk_links` False: the
    controller it starts sends the IFRT proxy's bulk bytes by gRPC (--no-bulk-links). `tls`: the controller
    and the workers serve TLS only, with these files (one certificate for this machine), and
    clients here find the CA in the data directory (tlsfiles.py), and with mutual TLS
    `client_tls`, their own certificate and key, where given. `starting(controller, workers)` is
    called once before anything starts, with whether the controller starts and the names of the
    workers that do; not at all when everything already runs.
    """
    if islands < 1 or (devices != "all" and (not str(devices).isdigit() or int(devices) < 1)):
        raise InvalidArgument("--islands must be at least 1 and --devices at least 1 or 'all'")
    if devices == "all" and islands != 1:
        raise InvalidArgument("--devices all gives every accelerator of this machine to one worker: one island")
    _check_address(listen)
    db = db or paths.default_db_url()
    state = _read_json(paths.cluster_state_path()) or {}
    running = running_controller()
    if tls is None and running is not None and isinstance(state.get("tls"), dict):
        # run again without the flags: workers it starts join the running cluster with its TLS
        tls = TlsConfig(**{k: v for k, v in state["tls"].items() if k in TLS_FIELDS})
    names = island_names(islands)
    worker_pids: dict[str, int] = {}
    for name, pid in dict(state.get("worker_pids", {})).items():
        if runs_module(int(pid), WORKER_MODULE):
            worker_pids[name] = int(pid)
    for name in (f"local-{island}" for island in names):
        pid = worker_pids.get(name) or running_worker(name)
        if pid is not None:
            worker_pids[name] = pid
    missing = [island for island in names if f"local-{island}" not in worker_pids]
    if starting is not None and (running is None or missing):
        starting(running is None, [f"local-{island}" for island in missing])
    proc: subprocess.Popen[bytes] | None = None
    log_offset = 0
    # the local cluster's own token: workers started here present it even where the caller's
    # environment names another cluster's ($PWCTL_TOKEN), which the controller would refuse
    token = None if no_token else paths.load_or_create_token()
    if running is not None:
        address = running.address
    else:
        publish_tls(tls, client_tls)
        flags = [*(("--no-token",) if no_token else ()), *(() if bulk_links else ("--no-bulk-links",)),
                 *(tls.args() if tls is not None else ())]
        proc, log_offset = _spawn_controller(listen, db, "parallel", 5.0, flags)
        address = listen
    if proc is not None and paths.split_address(listen)[1] == 0:
        # the port is known only once the controller serves: workers must wait for it
        address = _wait_controller(proc, log_offset, db, tls=tls).address

    started: list[str] = []
    for island in missing:
        name = f"local-{island}"
        worker_pids[name] = start_worker(address, island, devices, name, no_token=no_token, token=token, tls=tls)
        started.append(name)

    controller_pid = state.get("controller_pid")
    if proc is not None:
        try:
            address = _wait_controller(proc, log_offset, db, tls=tls).address
        except PathwaysError:  # e.g. its port is taken: the workers started for it must not stay,
            # retrying that address (another process's) with nothing recorded for `down` to stop
            _stop_workers({n: worker_pids[n] for n in started})
            raise
        controller_pid = proc.pid
    elif running is not None and controller_pid != running.pid:
        # the cluster's controller restarted since (`pwctl server stop`/`start`) stays the cluster's;
        # one `up` never started (`pwctl server start` before the first `up`) is left alone by `down`
        controller_pid = running.pid if _cluster_controller(state) == running.pid else None
    new_state: dict[str, Any] = {"address": address, "worker_pids": worker_pids}
    if tls is not None:
        new_state["tls"] = {k: getattr(tls, k) for k in TLS_FIELDS}
    if controller_pid:
        new_state["controller_pid"] = controller_pid
    # written before waiting, so `down` can clean up even when a worker fails to come up
    _write_json(paths.cluster_state_path(), new_state)
    wait_workers_ready(address, {n: worker_pids[n] for n in (f"local-{i}" for i in names)}, timeout, token, tls)
    return UpResult(address=address, islands=names, devices=devices, controller_started=proc is not None,
                    worker_pids=worker_pids, started_workers=started, token=token,
                    foreign_controller=None if controller_pid or running is None else running.pid, tls=tls)


def recorded_address() -> str | None:
    """The controller address of the cluster `up` recorded here, or None if there is none."""
    state = _read_json(paths.cluster_state_path())
    return str(state.get("address", "")) or None if state is not None else None


def _cluster_controller(state: dict[str, Any]) -> int | None:
    """The pid of the cluster's controller, running now: the one `up` started or, when that one was
    restarted since (`pwctl server stop`/`start`), the controller this data directory runs at the
    cluster's address. None when `up` reused someone else's controller or none runs."""
    recorded = state.get("controller_pid")
    if not recorded:
        return None
    if runs_module(int(recorded), CONTROLLER_MODULE):
        return int(recorded)
    return _controller_at(str(state.get("address", "")))


def _controller_at(address: str) -> int | None:
    """The pid of this data directory's controller (its pid file) when it runs at `address`."""
    info = _read_json(paths.server_pid_path()) or {}
    pid = int(info.get("pid", 0) or 0)
    if pid and info.get("address") == address and runs_module(pid, CONTROLLER_MODULE):
        return pid
    return None


ISLAND_SERVICE_MODULE = "server.controller.coordsvc"


def stop_island_services(record_path: Path | None = None) -> None:
    """The coordination services of islands spanning hosts (they outlive a controller restart,
    so stopping the controller leaves them; they would end by themselves a minute later), as
    the data directory's record (`record_path`, default this one's) lists them."""
    record = _read_json(record_path or paths.island_services_path()) or {}
    pids = [p for p in record.get("pids", []) if isinstance(p, int) and runs_module(p, ISLAND_SERVICE_MODULE)]
    terminate(pids, 2.0)


def _stop_workers(pids: dict[str, int], grace: float = STOP_GRACE_S) -> None:
    """Stops these workers (name -> pid) and removes the pid files that still name them."""
    terminate(list(pids.values()), grace)
    for name, pid in pids.items():
        remove_pid_file(worker_pid_path(name), pid)


def down(grace: float = STOP_GRACE_S) -> DownResult | None:
    """Stops the cluster `up` recorded in cluster.json (workers first), by pid, also the controller
    and workers restarted since under the same names and address; None if nothing was recorded."""
    path = paths.cluster_state_path()
    state = _read_json(path)
    if state is None:
        return None
    workers = {str(n): int(p) for n, p in dict(state.get("worker_pids", {})).items()}
    ours: dict[str, int] = {}
    for name, pid in workers.items():
        if runs_module(pid, WORKER_MODULE):
            ours[name] = pid
        else:  # restarted since (`pwctl worker start --name local-a`): its pid file names it
            again = running_worker(name)
            if again is not None:
                ours[name] = again
    _stop_workers(ours, grace)
    controller_pid = _cluster_controller(state)
    stopped_controller: int | None = None
    left_controller: int | None = None  # a controller `up` did not start, serving the cluster's address
    if controller_pid is not None:
        stopped_controller = int(controller_pid)
        _stop_controller_pid(stopped_controller, str(state.get("address", "")), 10.0)
        remove_pid_file(paths.server_pid_path(), stopped_controller)
    else:
        left_controller = _controller_at(str(state.get("address", "")))
    stop_island_services()
    path.unlink(missing_ok=True)
    address = str(state.get("address", ""))
    return DownResult(address=address, stopped_workers=ours, controller_pid=stopped_controller,
                      left_controller=left_controller, left_workers=_other_workers(address, set(ours)))


def _other_workers(address: str, stopped: set[str]) -> dict[str, int]:
    """Workers `pwctl worker start` started from this data directory for the cluster at `address`
    under other names than `up`'s, still running: `down` leaves them, and says so."""
    left: dict[str, int] = {}
    for pid_file in sorted((paths.data_dir() / "workers").glob("*.pid")):
        info = _read_json(pid_file) or {}
        name = str(info.get("name", pid_file.stem))
        if name in stopped or str(info.get("server", "")) != address:
            continue
        pid = running_worker(name)
        if pid is not None:
            left[name] = pid
    return left
