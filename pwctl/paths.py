"""Where the controller and `pwctl` keep their files, and the defaults both agree on.

Client-side (the controller imports it from here, through `server.paths`): `pwctl` must stand
without `server/`.

Everything lives under one data directory: `$PATHWAYS_HOME` when set, else the user's
data directory (platformdirs). Tests point `PATHWAYS_HOME` at a temporary folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "cluster_state_path",
    "data_dir",
    "default_db_url",
    "is_loopback",
    "jobs_dir",
    "logs_dir",
    "server_log_path",
    "server_pid_path",
    "split_address",
    "token_path",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7070
DEFAULT_ADDRESS = f"{DEFAULT_HOST}:{DEFAULT_PORT}"


def data_dir() -> Path:
    root = os.environ.get("PATHWAYS_HOME")
    path = Path(root) if root else Path(platformdirs.user_data_dir("pathways", appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_db_url() -> str:
    return f"sqlite:///{data_dir() / 'pathways.db'}"


def token_path() -> Path:
    return data_dir() / "token"


def server_pid_path() -> Path:
    return data_dir() / "server.pid"


def server_log_path() -> Path:
    return data_dir() / "server.log"


def cluster_state_path() -> Path:
    """What `pwctl up` started (pids and address), so `pwctl down` stops only that."""
    return data_dir() / "cluster.json"


def logs_dir() -> Path:
    path = data_dir() / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def jobs_dir() -> Path:
    path = data_dir() / "jobs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def split_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port); raises ValueError with a readable message."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"invalid address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:7070")
    return host, int(port)
