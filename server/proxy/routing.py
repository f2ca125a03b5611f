"""How the controller's gRPC server routes IFRT proxy calls: which methods are the proxy's
(they bypass the token interceptor's metadata check and the request guard), and a handler that
builds the proxy service on its first call, or refuses every call where the installed jaxlib
carries no proxy protocol."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from grpc import aio

from . import protocol as proto_mod

if TYPE_CHECKING:
    from .service import ProxyService

log = logging.getLogger(__name__)

SERVICE_PREFIX = f"/{proto_mod.SERVICE_NAME}/"


def is_proxy_method(method: str) -> bool:
    """True for the proxy service's RPCs. The jaxlib client sends no custom metadata, so they
    cannot carry the bearer token: sessions present it in their initialization data, and the
    host-buffer RPCs name an unguessable session id."""
    return method.startswith(SERVICE_PREFIX)


def guards_itself(method: str) -> bool:
    """The proxy session stream decodes its own requests (an undecodable one ends the session
    with INVALID_ARGUMENT) and answers every error itself, so the controller's
    `rpcguard.GuardInterceptor` leaves it unwrapped: its wrappers cost two generator hops per
    message on the tiny-call hot path (bench/FINDINGS.md)."""
    return method == SERVICE_PREFIX + "IfrtSession"


class LazyProxyHandler(grpc.GenericRpcHandler):
    """Serves the proxy service, building it (and scanning jaxlib for the protocol) on the first
    proxy call, so a controller that never sees a proxy client never pays for it."""

    def __init__(self, make: Callable[[], ProxyService]) -> None:
        self._make = make
        self._handler: grpc.GenericRpcHandler | None = None
        self.built: ProxyService | None = None  # the service, once a proxy call built it

    async def closed(self, timeout: float) -> None:
        """At the controller's stop, once the server stopped: waits (at most `timeout` s) for the
        closes of the proxy sessions under way (ProxyService.closed); nothing when none was built."""
        if self.built is not None:
            await self.built.closed(timeout)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if not is_proxy_method(handler_call_details.method):
            return None
        if self._handler is None:
            try:
                self.built = self._make()
                self._handler = self.built.generic_handler()
            except proto_mod.ProtocolError as e:  # the installed jaxlib: every proxy call says why, once logged
                why = f"this controller cannot serve IFRT proxy clients: {e}"
                log.warning("proxy: %s", why)
                self._handler = _refusing(why)
        return self._handler.service(handler_call_details)


def _refusing(why: str) -> grpc.GenericRpcHandler:
    """Answers every proxy call FAILED_PRECONDITION with `why` (the jaxlib client shows it at its
    first call, GetVersion)."""

    async def refuse(_request: bytes, context: aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        return b""

    handler = grpc.unary_unary_rpc_method_handler(refuse)

    class Refusing(grpc.GenericRpcHandler):
        def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            return handler if is_proxy_method(handler_call_details.method) else None

    return Refusing()
