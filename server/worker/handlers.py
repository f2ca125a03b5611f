"""The Worker service's method table on a gRPC server: registered as the generated
`add_WorkerServicer_to_server` does, with request parsing that never raises, so undecodable
bytes become INVALID_ARGUMENT (after the caller's credentials are checked), one log line and no
traceback."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from schemas.pathways.v1 import worker_pb2 as wpb

from .. import wire
from .servicer import WorkerServicer

log = logging.getLogger(__name__)


def _serialized(message: Any) -> bytes:
    """A response already serialized (server/wire.py), or a message to serialize."""
    return message if isinstance(message, bytes) else bytes(message.SerializeToString())


class Malformed:
    """What a request that does not decode turns into (instead of gRPC's UNKNOWN and traceback)."""

    def __init__(self, method: str, error: str) -> None:
        self.method, self.error = method, error


def _put_request(data: bytes) -> wire.PutBuffer | Malformed:
    """An upload, parsed without copying its bytes (server/wire.py), or Malformed."""
    try:
        return wire.put_buffer(data)
    except wire.WireError as e:
        return Malformed("PutBuffers", str(e))


def _tolerant(method: str, cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return Malformed(method, str(e) or "undecodable")

    return parse


async def _refuse(context: aio.ServicerContext, bad: Malformed) -> None:
    try:
        peer = str(context.peer())
    except Exception:  # only for the log line
        peer = "?"
    log.warning("malformed %s request from %s refused: %s", bad.method, peer, bad.error)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {bad.method} request: {bad.error}")


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
                await _refuse(context, request)
            return await fn(request, context)
        return handler

    def server_stream(method: str, fn: Any) -> Any:
        async def handler(request: Any, context: aio.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                await authenticate(method, context)
                await _refuse(context, request)
            async for item in fn(request, context):
                yield item
        return handler

    def client_stream(fn: Any) -> Any:
        async def handler(requests: AsyncIterator[Any], context: aio.ServicerContext) -> Any:
            async def checked() -> AsyncIterator[Any]:
                async for r in requests:
                    if isinstance(r, Malformed):
                        await _refuse(context, r)
                    yield r
            return await fn(checked(), context)
        return handler

    handlers = {
        "PutBuffers": grpc.stream_unary_rpc_method_handler(
            client_stream(servicer.PutBuffers),
            request_deserializer=_put_request,
            response_serializer=wpb.PutBuffersResponse.SerializeToString),
        "Fetch": grpc.unary_stream_rpc_method_handler(
            server_stream("Fetch", servicer.Fetch),
            request_deserializer=_tolerant("Fetch", wpb.FetchRequest),
            response_serializer=_serialized),
        "Wait": grpc.unary_unary_rpc_method_handler(
            unary("Wait", servicer.Wait),
            request_deserializer=_tolerant("Wait", wpb.WaitRequest),
            response_serializer=wpb.WaitReply.SerializeToString),
        "Transfer": grpc.stream_unary_rpc_method_handler(
            client_stream(servicer.Transfer),
            request_deserializer=_tolerant("Transfer", wpb.TransferChunk),
            response_serializer=wpb.TransferResponse.SerializeToString),
        "Relayed": grpc.stream_unary_rpc_method_handler(
            client_stream(servicer.Relayed),
            request_deserializer=_tolerant("Relayed", wpb.RelayedMessage),
            response_serializer=wpb.RelayedResponse.SerializeToString),
        "Compile": grpc.unary_unary_rpc_method_handler(
            unary("Compile", servicer.Compile),
            request_deserializer=_tolerant("Compile", wpb.CompileRequest),
            response_serializer=wpb.CompileReply.SerializeToString),
        "Stats": grpc.unary_unary_rpc_method_handler(
            unary("Stats", servicer.Stats),
            request_deserializer=_tolerant("Stats", wpb.WorkerStatsRequest),
            response_serializer=wpb.WorkerStats.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pathways.v1.Worker", handlers),))

