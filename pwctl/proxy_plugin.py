"""JAX plugin: the `proxy` platform, so unmodified programs run on a Pathways cluster.

JAX imports this module through the `jax_plugins` entry point in pyproject.toml (before the
program's first JAX call) and calls `initialize()`. It does nothing unless `JAX_PLATFORMS` names
`proxy`; then it registers a backend factory that opens an IFRT proxy session with the controller:

    JAX_PLATFORMS=proxy JAX_BACKEND_TARGET=grpc://127.0.0.1:7070 PATHWAYS_SLICE=train python train.py

- the target: `JAX_BACKEND_TARGET`, else the address `pwctl` would use (`PWCTL_SERVER`, the config
  file, the local default), as `grpc://HOST:PORT`;
- the token: found as `pwctl` finds it (`PWCTL_TOKEN`, the config file, the data directory's token
  file);
- the slice: `PATHWAYS_SLICE` (an existing slice's name), else a fresh one of `PATHWAYS_DEVICES`
  devices (default: the server's choice).

The jaxlib client sends no custom gRPC metadata, so the token and the slice travel in the session's
initialization data (`ClientConnectionOptions.initialization_data`, a `Mapping[str, bytes | bool |
int]`) under the keys in `INIT_KEYS`; the controller reads them from the session metadata header.
The jaxlib client retries a refused session (wrong token, unknown slice) until its connection
timeout and only then raises, with the server's message; `PATHWAYS_CONNECT_TIMEOUT_S` (default
`CONNECT_TIMEOUT_S`) bounds that wait, and a controller's start-up.
The controller speaks plaintext gRPC, which the client refuses unless
`IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS` is true; we set it unless the user set it.

A controller with TLS (found as `pwctl` finds its CA: `PWCTL_TLS_CA`, the config file, the data
directory) is out of the jaxlib client's reach (plaintext or ALTS only): the client is pointed at a
local bridge this process starts instead (serving this process alone), which carries its connection over TLS
(pwctl/tlsbridge.py).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

PLATFORM = "proxy"
# The initialization-data keys the controller's proxy service reads (server/proxy/service.py).
TOKEN_KEY = "pathways.token"
SLICE_KEY = "pathways.slice"
DEVICES_KEY = "pathways.devices"
INIT_KEYS = (TOKEN_KEY, SLICE_KEY, DEVICES_KEY)
INSECURE_ENV = "IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS"
CONNECT_TIMEOUT_S = 10
TIMER_SLACK_ENV = "PATHWAYS_CLIENT_TIMER_SLACK_US"
CLIENT_TIMER_SLACK_US = 2000  # see timer_slack
PR_SET_TIMERSLACK, PR_GET_TIMERSLACK = 29, 30  # linux/prctl.h


def connect_timeout(environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    raw = env.get("PATHWAYS_CONNECT_TIMEOUT_S", "").strip()
    if not raw:
        return CONNECT_TIMEOUT_S
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"PATHWAYS_CONNECT_TIMEOUT_S={raw!r}: expected a positive number of seconds")
    return value


def requested(environ: Mapping[str, str] | None = None) -> bool:
    """True when `JAX_PLATFORMS` names the proxy platform."""
    env = os.environ if environ is None else environ
    return PLATFORM in [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",")]


def target(environ: Mapping[str, str] | None = None) -> str:
    """The `grpc://HOST:PORT` address of the controller's proxy service."""
    env = os.environ if environ is None else environ
    explicit = env.get("JAX_BACKEND_TARGET", "").strip()
    if explicit:
        return explicit if "://" in explicit else f"grpc://{explicit}"
    from pwctl import settings

    return f"grpc://{settings.resolve().address}"


def initialization_data(environ: Mapping[str, str] | None = None) -> dict[str, bytes | bool | int]:
    """What the session's initialization data carries: token, slice name, device count."""
    env = os.environ if environ is None else environ
    from pwctl import settings

    data: dict[str, bytes | bool | int] = {}
    token = settings.resolve().token  # PWCTL_TOKEN, the config file, the token file
    if token:
        data[TOKEN_KEY] = token.encode()
    slice_name = env.get("PATHWAYS_SLICE", "").strip()
    if slice_name:
        data[SLICE_KEY] = slice_name.encode()
    devices = env.get("PATHWAYS_DEVICES", "").strip()
    if devices:
        try:
            count = int(devices)
        except ValueError:
            raise ValueError(f"PATHWAYS_DEVICES={devices!r}: expected a positive integer") from None
        if count <= 0:
            raise ValueError(f"PATHWAYS_DEVICES={devices!r}: expected a positive integer")
        data[DEVICES_KEY] = count
    return data


def client_timer_slack_ns(environ: Mapping[str, str] | None = None) -> int:
    """The timer slack for the threads the jaxlib client starts (`timer_slack`), in ns:
    `PATHWAYS_CLIENT_TIMER_SLACK_US` (0: left as the kernel's default), else CLIENT_TIMER_SLACK_US."""
    env = os.environ if environ is None else environ
    raw = env.get(TIMER_SLACK_ENV, "")
    try:
        us = int(raw) if raw else CLIENT_TIMER_SLACK_US
    except ValueError:
        raise ValueError(f"{TIMER_SLACK_ENV} must be a whole number of microseconds, not {raw!r}") from None
    if us < 0:
        raise ValueError(f"{TIMER_SLACK_ENV} must be 0 or more, not {us}")
    return us * 1000


@contextlib.contextmanager
def timer_slack(ns: int) -> Iterator[None]:
    """Threads started inside get this timer slack (Linux `PR_SET_TIMERSLACK`; a new thread takes
    its creator's); the calling thread's own is put back after.

    Why: the jaxlib IFRT proxy client starts a thread that sleeps 50 µs in a loop to send batched
    array deletions (`RpcHelper::Batcher::PeriodicFlusher`, xla/python/ifrt_proxy/client/
    rpc_helper.cc), ~20,000 wake-ups a second for the life of the program, busy or idle. Each one
    takes a core from the program's own computations (docs/facts.md; bench/FINDINGS.md). With a
    slack of 2 ms the kernel may let such a sleep run up to 2 ms longer, and the thread wakes ~500
    times a second. A timer's lateness is all it changes: a thread woken by I/O or another
    thread (every reply, every result) wakes as before; batched deletions go up to 2 ms later
    (and any request the client sends at once takes them along first)."""
    if ns <= 0 or not sys.platform.startswith("linux"):
        yield
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        before = libc.prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)
        changed = before >= 0 and libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) == 0
    except (OSError, AttributeError):
        changed = False
    try:
        yield
    finally:
        if changed:
            libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(before), 0, 0, 0)


def client_target(environ: Mapping[str, str] | None = None) -> str:
    """Where the jaxlib client connects: `target()`, or with TLS the local bridge to it."""
    address = target(environ)
    from pwctl import settings

    tls = settings.resolve_tls()
    if tls is None:
        return address
    from pwctl import tlsbridge

    scheme, _, hostport = address.partition("://")
    host, _, port = hostport.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"JAX_BACKEND_TARGET={address!r}: expected grpc://HOST:PORT")
    return f"{scheme}://{tlsbridge.bridge(host, int(port), tls).address}"


def make_client() -> Any:
    """The backend factory: a connected IFRT proxy client (JAX calls it on first use)."""
    from jax.extend.backend import ifrt_proxy

    os.environ.setdefault(INSECURE_ENV, "true")  # to the controller, or to the TLS bridge (loopback)
    options = ifrt_proxy.ClientConnectionOptions()
    options.initialization_data = initialization_data()
    options.connection_timeout_in_seconds = connect_timeout()
    address = client_target()
    with timer_slack(client_timer_slack_ns()):
        client = ifrt_proxy.get_client(address, options)
    if not _clients:
        atexit.register(keep_clients_at_exit)
    _clients.add(client)
    return client


# The clients `make_client` made that are still alive (a program may drop a backend and make another).
_clients: weakref.WeakSet[Any] = weakref.WeakSet()


def keep_clients_at_exit() -> None:
    """Keeps this process's proxy clients alive through the interpreter's exit (an `atexit` handler).

    The jaxlib client's teardown at exit (jaxlib 0.10.2) cancels the requests still in flight, and
    their callbacks log the error while the process is being torn down, which crashes it now and
    then (SIGSEGV or SIGABRT, "Mutex corrupt", after the program's output was all written). In
    flight at exit is usual: the arrays freed as the interpreter ends are destructed in one batch,
    and a download's host buffer is deleted after its bytes came; the answers take a round trip.
    With answers 0.1 s late, 17 of 20 exits logged "Batched response from ifrt proxy server:
    CANCELLED" and 1 crashed. Kept alive, the client is never torn down: the process ends, its
    connection closes, and the controller ends the session and frees what it held, as for any
    client that went away (the same as a killed one)."""
    for client in list(_clients):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))


def initialize() -> None:
    """Called by JAX's plugin discovery: registers `proxy` only when it is asked for."""
    if not requested():
        return
    from jax._src import xla_bridge

    xla_bridge.register_backend_factory(PLATFORM, make_client, priority=-1, fail_quietly=False)


JOB_DRIVER = "_pathways_proxy_main.py"  # the driver `pwctl submit --proxy` runs in the job's directory
_DRIVER = '''\
"""Written by `pwctl submit --proxy`: runs {entry!r} unmodified, its JAX on the cluster (IFRT proxy)."""
import os
import runpy
import sys

os.environ["JAX_PLATFORMS"] = "proxy"
os.environ.setdefault("JAX_BACKEND_TARGET", "grpc://" + os.environ["PWCTL_SERVER"])
os.environ.update({extra!r})
entry = os.path.abspath({entry!r})
sys.argv[0] = entry
sys.path.insert(0, os.path.dirname(entry))
from importlib.metadata import entry_points

if not any(e.value == "pwctl.proxy_plugin" for e in entry_points(group="jax_plugins")):
    from pwctl import proxy_plugin  # the project is on PYTHONPATH but not installed: register by hand

    proxy_plugin.initialize()
del entry_points
runpy.run_path(entry, run_name="__main__")
'''


def job_driver(entry: str, environ: Mapping[str, str] | None = None) -> bytes:
    """The driver script of a proxy job: sets JAX_PLATFORMS=proxy and JAX_BACKEND_TARGET (the
    controller the job runs under), carries the submitter's PATHWAYS_SLICE / PATHWAYS_DEVICES,
    and runs `entry` (a path in the job's directory) as `__main__`."""
    env = os.environ if environ is None else environ
    extra = {k: env[k].strip() for k in ("PATHWAYS_SLICE", "PATHWAYS_DEVICES") if env.get(k, "").strip()}
    return _DRIVER.format(entry=entry, extra=extra).encode()
