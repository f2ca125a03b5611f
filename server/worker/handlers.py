"""The Worker service's method table on a gRPC server: registered as the generated
`add_WorkerServicer_to_server` does, with request parsing that never raises, so undecodable
bytes become INVALID_ARGUMENT (after the caller's credentials are checked), one log line and no
traceback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc import aio

from schemas.pathways.v1 import worker_pb2 as wpb

from .. import wire
from ..rpcguard import Malformed, WarningLimiter, decoder, write_or_cancel, write_stream
from .servicer import WorkerServicer


def _serialized(message: Any) -> bytes:
    """A response already serialized (server/wire.py), or a message to serialize."""
    return message if isinstance(message, bytes) else bytes(message.SerializeToString())


def _put_request(data: bytes) -> wire.PutBuffer | Malformed:
    """An upload, parsed without copying its bytes (server/wire.py), or Malformed."""
    try:
        return wire.put_buffer(data)
    except wire.WireError as e:
        return Malformed(wpb.PutBufferRequest.DESCRIPTOR.full_name, str(e))


def _tolerant(cls: Any) -> Callable[[bytes], Any]:
    return decoder(cls.FromString, cls.DESCRIPTOR.full_name)


_warnings = WarningLimiter()  # a flood of garbage writes a bounded log, as on the controller


async def _refuse(context: aio.ServicerContext, method: str, bad: Malformed) -> None:
    try:
        peer = str(context.peer())
    except Exception:  # only for the log line
        peer = "?"
    _warnings.warn(f"Worker/{method}", peer, bad.message)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.message)


class _OneAtATime:
    """A bidirectional stream's context whose writes and abort never overlap: gRPC refuses a
    status sent while a write is under way (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS: the caller never
    hears it, and waits out its deadline), so `abort` waits for the write in progress, and
    writes from several tasks (`Waits`' answers) wait for each other."""

    def __init__(self, context: aio.ServicerContext) -> None:
        self._context = context
        self._lock = asyncio.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def write(self, message: Any) -> None:
        """A failed write (the caller is gone) raises CancelledError (rpcguard.write_or_cancel)."""
        async with self._lock:
            await write_or_cancel(self._context, message)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        async with self._lock:
            await self._context.abort(code, details, trailing_metadata)


def add_to_server(servicer: WorkerServicer, server: aio.Server) -> None:
    """Registers the Worker service as the generated `add_WorkerServicer_to_server` does, with
    request parsing that turns undecodable bytes into INVALID_ARGUMENT after the caller's
    credentials are checked (UNAUTHENTICATED first), with one log line and no traceback."""

    async def authenticate(method: str, context: aio.ServicerContext) -> None:
        if method == "Transfer":
            await servicer.auth.peer(context)
        elif method != "Stats":
            await servicer.auth.session(context, method)

    def unary(method: str, fn: Any) -> Any:
        async def handler(request: Any, context: aio.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                await authenticate(method, context)
                await _refuse(context, method, request)
            return await fn(request, context)
        return handler

    def server_stream(method: str, fn: Any) -> Any:
        """A response stream written here (`context.write`), not by gRPC from a generator: a write
        to a caller that is gone (killed mid-fetch) ends the handler as a cancellation, where gRPC
        logged its failed write with a traceback (rpcguard.write_or_cancel)."""
        async def handler(request: Any, context: aio.ServicerContext) -> None:
            if isinstance(request, Malformed):
                await authenticate(method, context)
                await _refuse(context, method, request)
            await write_stream(context, fn(request, context))
        return handler

    async def checked(method: str, requests: AsyncIterator[Any], context: aio.ServicerContext) -> AsyncIterator[Any]:
        """A stream's requests, ended with the refusal at the first that did not decode."""
        async for r in requests:
            if isinstance(r, Malformed):
                await _refuse(context, method, r)
            yield r

    def client_stream(method: str, fn: Any) -> Any:
        async def handler(requests: AsyncIterator[Any], context: aio.ServicerContext) -> Any:
            return await fn(checked(method, requests, context), context)
        return handler

    def bidi_stream(method: str, fn: Any) -> Any:
        """A bidirectional stream whose handler writes its answers itself (`context.write`, one
        at a time and never under an abort: `_OneAtATime`)."""
        async def handler(requests: AsyncIterator[Any], context: aio.ServicerContext) -> None:
            one = _OneAtATime(context)
            await fn(checked(method, requests, one), one)
        return handler

    kinds: dict[Callable[[str, Any], Any], Any] = {  # how a method is served: its kind of gRPC handler
        unary: grpc.unary_unary_rpc_method_handler, client_stream: grpc.stream_unary_rpc_method_handler,
        server_stream: grpc.unary_stream_rpc_method_handler, bidi_stream: grpc.stream_stream_rpc_method_handler}
    table: list[tuple[str, Callable[[str, Any], Any], Callable[[bytes], Any], Callable[[Any], bytes]]] = [
        # the method, how it is served, its requests' parser, its responses' serializer
        ("PutBuffers", client_stream, _put_request, wpb.PutBuffersResponse.SerializeToString),
        ("Uploads", bidi_stream, _put_request, wpb.UploadAck.SerializeToString),
        ("Fetch", server_stream, _tolerant(wpb.FetchRequest), _serialized),
        ("Wait", unary, _tolerant(wpb.WaitRequest), wpb.WaitReply.SerializeToString),
        ("Waits", bidi_stream, _tolerant(wpb.WaitRequest), wpb.WaitReply.SerializeToString),
        ("Transfer", client_stream, _tolerant(wpb.TransferChunk), wpb.TransferResponse.SerializeToString),
        ("Relayed", client_stream, _tolerant(wpb.RelayedMessage), wpb.RelayedResponse.SerializeToString),
        ("Compile", unary, _tolerant(wpb.CompileRequest), wpb.CompileReply.SerializeToString),
        ("Stats", unary, _tolerant(wpb.WorkerStatsRequest), wpb.WorkerStats.SerializeToString),
    ]
    handlers = {method: kinds[serve](serve(method, getattr(servicer, method)), request_deserializer=parse,
                                     response_serializer=serialize)
                for method, serve, parse, serialize in table}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pathways.v1.Worker", handlers),))

