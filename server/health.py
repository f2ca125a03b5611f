"""The standard gRPC health service (`grpc.health.v1.Health`) on the controller's and each worker's port.

Load balancers and Kubernetes' `grpc:` probes ask it whether a server is up without a token
(server/auth.py lets exactly this service through). A server reports NOT_SERVING from the moment it
is built until `serving()`, and NOT_SERVING again, for good, from `shutting_down()`: called before
the gRPC server stops, so a watcher sees NOT_SERVING before its stream ends.

The status is kept for the whole server ("") and for the server's own service name.

With TLS (pwctl/tls.py) the server's port speaks TLS only, which Kubernetes' `grpc:` probes cannot:
`serve_plain` answers the same status on a port of its own, plaintext, with this service alone
(`--health-listen`; it tells nothing but up or down).
"""

from __future__ import annotations

from typing import Any

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer  # grpc_health.v1.health.aio, typed

from pwctl import tls

from .rpcguard import write_or_cancel

SERVICE_PREFIX = "/grpc.health.v1.Health/"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

__all__ = ["NOT_SERVING", "SERVICE_PREFIX", "SERVING", "Health", "is_health_method"]


def is_health_method(method: str) -> bool:
    """True for the health service's RPCs (answered without authentication)."""
    return method.startswith(SERVICE_PREFIX)


class _GuardedWrites:
    """A call's context whose `write` is `write_or_cancel`: the rest is the context's own."""

    def __init__(self, context: Any) -> None:
        self._context = context

    async def write(self, message: Any) -> None:
        await write_or_cancel(self._context, message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class _Servicer(HealthServicer):
    """grpc_health's servicer, its Watch writing through `write_or_cancel`: a watcher killed as the
    status changes ends the stream as a cancellation, not with gRPC's traceback. Watch writes with
    `context.write` itself, which no interceptor (rpcguard.GuardInterceptor) can guard."""

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        await super().Watch(request, _GuardedWrites(context))


class Health:
    """The health servicer of one gRPC server, with the two transitions a server makes."""

    def __init__(self, service: str) -> None:
        self.services = ("", service)
        self._servicer = _Servicer()

    async def attach(self, server: aio.Server) -> None:
        """Registers the service on `server`, NOT_SERVING until `serving()`."""
        for name in self.services:
            await self._servicer.set(name, NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    async def serve_plain(self, listen: str) -> aio.Server:
        """A plaintext server at `listen` answering this health service alone; raises SystemExit
        (one line) when it cannot listen there."""
        server = aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        if tls.add_port(server, listen, None) == 0:  # plaintext: probes cannot speak TLS
            raise SystemExit(f"cannot serve health checks on {listen}: address in use or not available")
        await server.start()
        return server

    async def serving(self) -> None:
        for name in self.services:
            await self._servicer.set(name, SERVING)

    async def shutting_down(self) -> None:
        """NOT_SERVING from now on; later `serving()` calls are ignored."""
        await self._servicer.enter_graceful_shutdown()
