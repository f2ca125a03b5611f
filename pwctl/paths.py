"""Where the controller and `pwctl` keep their files, and the defaults both agree on.

Client-side (the controller imports it from here, through `server.paths`): `pwctl` must stand
without `server/`.

Everything lives under one data directory: `$PATHWAYS_HOME` when set, else the user's
data directory (platformdirs). Tests point `PATHWAYS_HOME` at a temporary folder.

It holds the token, the database, logs and job files: it is private to its user (0700, and
its folders too; the database and the logs 0600). A folder or file found more open than
that and owned by this user is tightened when used.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "cluster_state_path",
    "data_dir",
    "default_db_url",
    "is_loopback",
    "island_services_path",
    "jobs_dir",
    "load_or_create_token",
    "logs_dir",
    "private_dir",
    "private_file",
    "read_tls_server_name",
    "server_log_path",
    "server_pid_path",
    "split_address",
    "tls_ca_path",
    "tls_client_cert_path",
    "tls_client_key_path",
    "tls_server_name_path",
    "token_path",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7070
DEFAULT_ADDRESS = f"{DEFAULT_HOST}:{DEFAULT_PORT}"


def _tighten(path: Path, mode: int) -> None:
    """Removes group and other permissions from `path` when it has some and is this user's."""
    try:
        st = path.stat()
        if st.st_mode & 0o077 and st.st_uid == os.getuid():
            os.chmod(path, mode)
    except OSError:
        pass


def private_dir(path: Path) -> Path:
    """`path`, created if missing, mode 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _tighten(path, 0o700)
    return path


def private_file(path: Path) -> Path:
    """`path`, created empty if missing, mode 0600 (before anyone writes into it)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    except OSError:
        return path
    _tighten(path, 0o600)
    return path


def data_dir() -> Path:
    root = os.environ.get("PATHWAYS_HOME")
    if root:
        path = Path(root)
    else:
        import platformdirs  # here: every pwctl command and process imports this module

        path = Path(platformdirs.user_data_dir("pathways", appauthor=False))
    try:
        return private_dir(path)
    except OSError as e:  # a caller's mistake (a file in the way, no permission): one line, not a traceback
        from .errors import InvalidArgument

        where = "$PATHWAYS_HOME" if root else "the user's data directory"
        raise InvalidArgument(f"cannot use {path} ({where}) as the data directory: {e.strerror or e}") from None


def default_db_url() -> str:
    return f"sqlite:///{data_dir() / 'pathways.db'}"


def token_path() -> Path:
    return data_dir() / "token"


def read_token(path: Path | None = None) -> str | None:
    """The cluster token in `path` (default: the data directory's), or None where there is none
    (not made yet, unreadable, or a controller run with --no-token)."""
    try:
        return (path or token_path()).read_text().strip() or None
    except OSError:
        return None


def load_or_create_token(path: Path | None = None) -> str:
    """The cluster token in the data directory, created (mode 0600) on first use. Atomic: a
    token is written whole under a temporary name and linked into place, so concurrent starters
    (`pwctl up` and the controller it spawns) agree on one token and no reader sees half of one."""
    path = path or token_path()
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if existing:
        return existing
    import secrets

    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:  # someone else's won (or an empty file was left: replace it)
            if not path.read_text().strip():
                os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _tighten(path, 0o600)
    return path.read_text().strip()


def tls_ca_path() -> Path:
    """The CA bundle `pwctl up`/`server start` with TLS copy here for clients (pwctl/settings.py)."""
    return data_dir() / "tls-ca.pem"


def tls_client_cert_path() -> Path:
    """With mutual TLS, the client certificate (and `tls_client_key_path`) local clients present."""
    return data_dir() / "tls-client.pem"


def tls_client_key_path() -> Path:
    return data_dir() / "tls-client.key"


def tls_server_name_path() -> Path:
    return data_dir() / "tls-server-name"


def read_tls_server_name() -> str:
    """The server name `pwctl up`/`server start --tls-server-name` left here ("" when none)."""
    try:
        return tls_server_name_path().read_text().strip()
    except OSError:
        return ""


def server_pid_path() -> Path:
    return data_dir() / "server.pid"


def server_log_path() -> Path:
    return data_dir() / "server.log"


def island_services_path() -> Path:
    """The controller's record of its islands' coordination services (server/controller/groups.py):
    its pid and theirs, so that a restarted controller, the services themselves and `pwctl down`
    know which are still wanted."""
    return data_dir() / "island-services.json"


def cluster_state_path() -> Path:
    """What `pwctl up` started (pids and address), so `pwctl down` stops only that."""
    return data_dir() / "cluster.json"


def logs_dir() -> Path:
    return private_dir(data_dir() / "logs")


def jobs_dir() -> Path:
    return private_dir(data_dir() / "jobs")


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
