"""Bounds on what one request may ask of the controller, checked before it costs anything.

A worker declaring 50,000 devices once froze the controller for ~107 s and left an island no
command could remove (issue 29, finding 2). Every size a caller chooses is bounded here; each
bound has a name, a default and, where an operator may need another, a controller flag:

| limit | default | flag |
| --- | --- | --- |
| devices per host | 1,024 | `--max-devices-per-host` |
| hosts | 4,096 (the scale target is 2,048) | `--max-hosts` |
| open client sessions | 1,024 | `--max-sessions` |
| open sessions of one caller (callers.py), `pw` and IFRT proxy together | 256 | `--max-sessions-per-caller` |
| open IFRT proxy sessions | 1,024 (the same flag's value) | `--max-sessions` |
| open `Watch` streams | 64 | `--max-watches` |
| open `StreamLogs` streams | 256 | - |
| host / island names | 1-128 / 1-64 characters of `A-Z a-z 0-9 _ . : + -`, not starting with a sign | - |
| a worker's address / machine id | 256 / 128 characters (the database's columns) | - |
| a listing page (`ListHosts`, `ListDevices`) | 10,000 entries (0 or more asks for a full page) | - |
| events queued for a client that does not read them | 10,000, then its session ends (`client_session.py`) | - |
| calls at once on one connection (HTTP/2 streams) | 1,024; the client's further calls wait for one (`app.py`) | - |

A request over a bound is answered INVALID_ARGUMENT (a size) or RESOURCE_EXHAUSTED (a count of
things open at once) with one line naming the limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from schemas.pathways.v1 import controller_pb2 as cpb

from .errors import InvalidArgument

DEFAULT_MAX_DEVICES_PER_HOST = 1024
DEFAULT_MAX_HOSTS = 4096
DEFAULT_MAX_SESSIONS = 1024
DEFAULT_MAX_SESSIONS_PER_CALLER = 256  # a quarter: one caller cannot take every place
DEFAULT_MAX_WATCHES = 64
MAX_LOG_STREAMS = 256
MAX_HOST_NAME = 128
MAX_ISLAND_NAME = 64
MAX_ADDRESS = 256
MAX_MACHINE_ID = 128
MAX_KIND = 16
MAX_PAGE = 10_000
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:+-]*")


@dataclass(frozen=True)
class Limits:
    max_devices_per_host: int = DEFAULT_MAX_DEVICES_PER_HOST
    max_hosts: int = DEFAULT_MAX_HOSTS
    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_sessions_per_caller: int = DEFAULT_MAX_SESSIONS_PER_CALLER
    max_watches: int = DEFAULT_MAX_WATCHES
    max_log_streams: int = MAX_LOG_STREAMS


def shown(text: str, longest: int = 40) -> str:
    """`text` as an error quotes a caller's string: at most `longest` characters, then "..."."""
    return text if len(text) <= longest else text[:longest] + "..."


def check_name(what: str, name: str, longest: int) -> None:
    """Raises InvalidArgument unless `name` is a valid host or island name."""
    if len(name) > longest or not NAME_RE.fullmatch(name):
        raise InvalidArgument(f"invalid {what} name {shown(name)!r} ({len(name)} characters): use 1-{longest} of "
                              "letters, digits and _ . : + -, not starting with a sign")


def check_registration(reg: cpb.RegisterWorker, limits: Limits) -> None:
    """Raises InvalidArgument when a worker's registration is out of bounds."""
    check_name("host", reg.name, MAX_HOST_NAME)
    check_name("island", reg.island, MAX_ISLAND_NAME)
    if reg.device_count <= 0:
        raise InvalidArgument(f"a host needs at least one device, got {reg.device_count}")
    if reg.device_count > limits.max_devices_per_host:
        raise InvalidArgument(
            f"host {reg.name} declares {reg.device_count} devices, over the limit of "
            f"{limits.max_devices_per_host} per host (the controller's --max-devices-per-host)")
    if len(reg.address) > MAX_ADDRESS:
        raise InvalidArgument(f"address of {len(reg.address)} characters, over the limit of {MAX_ADDRESS}")
    if len(reg.machine_id) > MAX_MACHINE_ID:
        raise InvalidArgument(f"machine id of {len(reg.machine_id)} characters, over the limit of {MAX_MACHINE_ID}")
    if len(reg.device_kind) > MAX_KIND:
        raise InvalidArgument(f"device kind of {len(reg.device_kind)} characters, over the limit of {MAX_KIND}")
    if reg.pid < 0:
        raise InvalidArgument(f"pid must not be negative, got {reg.pid}")


def page_size(limit: int) -> int:
    """The entries one listing page holds: `limit`, at most `MAX_PAGE` (0: a full page)."""
    if limit < 0:
        raise InvalidArgument(f"limit must not be negative, got {limit}")
    return MAX_PAGE if limit == 0 or limit > MAX_PAGE else limit
