"""The cluster token's check on the servers (controller and workers), on every address."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from .health import is_health_method
from .paths import load_or_create_token

__all__ = ["TokenInterceptor", "load_or_create_token"]


class TokenInterceptor(aio.ServerInterceptor):
    """Rejects every call without `authorization: Bearer <token>` with UNAUTHENTICATED, except the
    standard health service's (probes carry no token; it tells only whether the server is up)."""

    def __init__(self, token: str, open_method: Callable[[str], bool] | None = None) -> None:
        self._expected = f"Bearer {token}".encode()
        # services that authenticate their callers themselves (the IFRT proxy: its client cannot
        # send the header, so its sessions carry the token in their initialization data)
        self._open_method = open_method

        async def deny(_request: Any, context: aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong token",
            )

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream_in = grpc.stream_unary_rpc_method_handler(deny)
        self._deny_stream_out = grpc.unary_stream_rpc_method_handler(deny)
        self._deny_stream_both = grpc.stream_stream_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if is_health_method(method) or (self._open_method is not None and self._open_method(method)):
            return await continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                raw = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(raw, self._expected):
                    return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.request_streaming and handler.response_streaming:
            return self._deny_stream_both
        if handler.request_streaming:
            return self._deny_stream_in
        if handler.response_streaming:
            return self._deny_stream_out
        return self._deny_unary
