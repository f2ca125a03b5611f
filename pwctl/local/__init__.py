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

One module per noun: `processes` (liveness, signals, spawning, pid files), `controller`, `workers`,
and `cluster` (`up`/`down`); the public names are re-exported here.
"""

from .cluster import DownResult, UpResult, down, island_names, recorded_address, stop_island_services, up
from .controller import (
    ControllerHandle,
    run_controller_foreground,
    running_controller,
    start_controller,
    stop_controller,
)
from .processes import (
    CONTROLLER_MODULE,
    CONTROLLER_START_TIMEOUT_S,
    POLL_S,
    READY_POLL_S,
    STOP_GRACE_S,
    WORKER_MODULE,
    WORKER_READY_TIMEOUT_S,
    is_alive,
    runs_module,
    stop_children,
    terminate,
)
from .workers import (
    default_worker_name,
    running_worker,
    start_worker,
    stop_worker,
    wait_workers_ready,
    worker_log_path,
    worker_pid_path,
)

__all__ = [
    "CONTROLLER_MODULE", "CONTROLLER_START_TIMEOUT_S", "POLL_S", "READY_POLL_S", "STOP_GRACE_S", "WORKER_MODULE",
    "WORKER_READY_TIMEOUT_S", "ControllerHandle", "DownResult", "UpResult", "default_worker_name", "down",
    "is_alive", "island_names", "recorded_address", "run_controller_foreground", "running_controller",
    "running_worker", "runs_module",
    "start_controller", "start_worker", "stop_children", "stop_controller", "stop_island_services", "stop_worker",
    "terminate", "up",
    "wait_workers_ready", "worker_log_path", "worker_pid_path",
]
