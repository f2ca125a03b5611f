"""Runs the controller: migrate the database, serve gRPC, write the pid file, stop cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc import aio

from pwctl import tls
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc

from .. import heap, paths
from ..auth import TokenInterceptor, load_or_create_token
from ..db.engine import SchemaUpgradeFailed, upgrade_schema
from ..health import Health
from ..proxy.routing import LazyProxyHandler, guards_itself, is_proxy_method
from ..rpcguard import GuardInterceptor, quiet_final_status
from .callers import caller_of
from .core import Controller, ControllerConfig
from .errors import Rejected, classify
from .metrics import DEFAULT_LISTEN as DEFAULT_METRICS_LISTEN
from .metrics import ControllerCollector, MetricsServer
from .servicer import ControllerServicer

if TYPE_CHECKING:  # the proxy's modules (and NumPy) load with the first proxy call: `proxy_service`
    from ..proxy.controller_backend import ControllerBackend
    from ..proxy.service import Admit, ProxyService

log = logging.getLogger(__name__)

# gRPC core holds the calls that arrive faster than grpc.aio's loop accepts them (one at a time)
# and cancels new ones once about `max_pending_requests` wait (its default: 1,000, all callers
# together): with nothing in its log or ours, and CANCELLED the only status the caller sees. An
# unmodified JAX program's `device_put`s are one HostBufferStore call per shard, all in flight at
# once (1,000 arrays over 4 devices: 4,000 calls), and the jaxlib client ends its session on the
# first that fails (issue 28). So each connection carries at most `MAX_STREAMS_PER_CONNECTION`
# calls at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): a client's further calls wait in the
# client, back-pressure instead of a cancelled call, and a busy connection cannot fill the
# queue alone. It exceeds every bound on one caller's long-lived streams (`Session`, `Watch`,
# `StreamLogs`: limits.py), so none waits behind the others. The queue's bounds (`MAX_PENDING_CALLS`
# before gRPC starts refusing, twice that refusing all) stay the guard against a flood of
# connections. gRPC's overload protection is off: it refuses (REFUSED_STREAM, which jaxlib's
# client does not retry) a stream under the limit while the server still holds calls the client
# saw end, i.e. it turns the limit into failed calls.
MAX_STREAMS_PER_CONNECTION = 1024
MAX_PENDING_CALLS = 4 * MAX_STREAMS_PER_CONNECTION
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 512 * 1024 * 1024),
    ("grpc.max_receive_message_length", 512 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
    ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ("grpc.http.overload_protection", 0),
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
]
# At an orderly stop, how long the controller waits for proxy sessions' closes under way (each
# releases its buffers and slice, written to the database) before it closes the database and the
# worker links: a close takes milliseconds; the bound keeps a stuck one from holding the stop.
PROXY_CLOSE_WAIT_S = 5.0


def write_pid_file(path: Path, address: str, db: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "address": address, "db": db}))
    tmp.replace(path)


def proxy_backend(core: Controller) -> ControllerBackend:
    """The proxy service's view of the controller (server/proxy/cluster_backend.py)."""
    from ..proxy.cluster_backend import Controls
    from ..proxy.controller_backend import ControllerBackend

    def release_buffers(address: str, ids: list[int]) -> None:
        core.dispatcher.release(address, ids)
        core.dispatcher.flush()

    controls = Controls(release_buffers=release_buffers, release_owner=core.sessions.release_owner,
                        new_id_prefix=core.sessions.new_id_prefix, token=core.config.token,
                        sessions=core.sessions, tls=core.config.tls, bulk_links=core.config.bulk_links,
                        transfers=core.proxy_transfers)
    return ControllerBackend(core.slices, controls)


def proxy_admission(core: Controller) -> Admit:
    """A proxy session's place among its caller's sessions: the per-caller cap counts `pw` and
    proxy sessions together (callers.py)."""
    from ..proxy.backend import BackendError

    @contextlib.contextmanager
    def admit(peer: str) -> Iterator[None]:
        place = core.sessions.callers.enter(caller_of(peer))
        try:
            place.__enter__()
        except Rejected as e:
            raise BackendError("RESOURCE_EXHAUSTED", str(e)) from None
        try:
            yield
        finally:
            place.__exit__(None, None, None)

    return admit


def proxy_service(core: Controller, token: str | None) -> ProxyService:
    """The IFRT proxy service, built on the first proxy call (routing.LazyProxyHandler): its modules
    and NumPy load then, so a controller no proxy client calls starts without them."""
    from ..proxy.service import ProxyService

    return ProxyService(proxy_backend(core), token, core.config.limits.max_sessions, proxy_admission(core))


async def serve(config: ControllerConfig, pid_file: Path | None = None) -> None:
    host, _port = paths.split_address(config.listen)
    sqlite_file = config.db_url.removeprefix("sqlite:///")
    if sqlite_file != config.db_url and sqlite_file and not sqlite_file.startswith(":memory:"):
        paths.private_file(Path(sqlite_file))  # 0600 before SQLite creates it (its WAL follows its mode)
    try:
        upgrade_schema(config.db_url)  # first: it forks, and no thread has started yet
    except SchemaUpgradeFailed as e:
        raise SystemExit(str(e)) from None
    # first the token (an unauthenticated caller learns nothing), then malformed requests and
    # the components' errors as status codes (server/rpcguard.py)
    # on every address, loopback included (a machine's loopback is shared by all its users);
    # `--no-token` opts out on a private machine
    interceptors: list[aio.ServerInterceptor] = []
    if not config.no_token:
        config.token = config.token or load_or_create_token()  # job drivers get it too
        interceptors.append(TokenInterceptor(config.token, open_method=is_proxy_method))
    elif not paths.is_loopback(host):
        log.warning("--no-token on %s: whoever reaches this address can use the cluster", config.listen)
    guard = GuardInterceptor(classify, skip=guards_itself)
    server = aio.server(interceptors=[*interceptors, guard], options=GRPC_OPTIONS)
    core = Controller(config)
    cgrpc.add_ControllerServicer_to_server(ControllerServicer(core), server)
    # unmodified JAX programs (JAX_PLATFORMS=proxy) on the same port; their sessions check the token
    proxy_token = None if config.no_token else config.token
    proxy = LazyProxyHandler(lambda: proxy_service(core, proxy_token))
    server.add_generic_rpc_handlers([proxy])
    health = Health("pathways.v1.Controller")
    await health.attach(server)
    bound = tls.add_port(server, config.listen, config.tls)  # TLS only, where configured
    if bound == 0:
        raise SystemExit(f"cannot listen on {config.listen}: address in use or not available")
    core.address = f"{host}:{bound}"
    metrics = await start_metrics(core, config)  # before start(): an address that is taken ends it here
    await core.start()
    await server.start()
    probes = await health.serve_plain(config.health_listen) if config.health_listen else None
    await health.serving()
    heap.settle()  # start-up objects (SQLAlchemy, protobuf, modules) stay out of later collections
    heap.reuse_large_buffers()  # the proxy's transfer messages: heap buffers, not fresh mappings
    if pid_file is not None:
        write_pid_file(pid_file, core.address, config.db_url)
    secure = " (TLS" + (", client certificates required)" if config.tls.require_client_cert else ")") \
        if config.tls is not None else ""
    log.info("controller listening on %s%s (database %s)", core.address, secure, config.db_url)
    print(f"controller listening on {core.address}{secure}", flush=True)
    loop = asyncio.get_running_loop()
    def on_signal(sig: signal.Signals) -> None:
        log.info("shutdown requested by %s", sig.name)
        core.request_shutdown()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await core.shutdown_event.wait()
    finally:
        log.info("controller shutting down")
        await health.shutting_down()
        core.end_streams()
        if metrics is not None:
            await metrics.stop()
        await server.stop(grace=1.0)
        await proxy.closed(PROXY_CLOSE_WAIT_S)  # proxy sessions' closes (release, slice) before the database goes
        if probes is not None:
            await probes.stop(grace=None)
        await core.stop()
        if pid_file is not None and pid_file.exists():
            try:
                if json.loads(pid_file.read_text()).get("pid") == os.getpid():
                    pid_file.unlink()
            except (OSError, ValueError):
                pass


async def start_metrics(core: Controller, config: ControllerConfig) -> MetricsServer | None:
    """Serves the Prometheus endpoint (None when off). Scrapes need the cluster token as a bearer
    token, as gRPC calls do, on every address (none with `--no-token`). The default address falls
    back to a free port when 9464 is taken (several controllers on one machine); an address given
    explicitly must be free."""
    listen = config.metrics_listen.strip()
    if not listen or listen == "off":
        return None
    try:
        host, port = paths.split_address(listen)
    except ValueError as e:
        raise SystemExit(f"--metrics-listen: {e} (or 'off')") from None
    token = None
    if not config.no_token:
        token = config.token = config.token or load_or_create_token()
    collector = ControllerCollector(core.cluster, core.observer, core.scheduler, core.jobs.jobs, core.hangs,
                                    core.slice_count, dispatch=core.dispatch, policy=config.policy,
                                    relays=core.relays, transfers=core.proxy_transfers)
    metrics = MetricsServer(collector, token, config.tls.ssl_server_context if config.tls is not None else None)
    try:
        bound = await metrics.start(host, port)
    except OSError as e:
        if listen != DEFAULT_METRICS_LISTEN:
            raise SystemExit(f"cannot serve metrics on {listen}: {e.strerror or e}") from None
        log.warning("metrics: %s is taken (%s); serving them on a free port instead", listen, e.strerror or e)
        bound = await metrics.start(host, 0)
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    core.metrics_url = f"{metrics.scheme}://{shown}:{bound}/metrics"
    log.info("metrics at %s%s", core.metrics_url, " (bearer token required)" if token else "")
    return metrics


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("grpc").setLevel(logging.WARNING)
    quiet_final_status()  # one line, not gRPC's traceback (rpcguard.FinalStatusFilter)


__all__ = ["GRPC_OPTIONS", "grpc", "serve"]
