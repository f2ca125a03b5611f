"""A buffer's bytes read from its worker's `Fetch` (the proxy's cluster backend, cluster_backend.py),
its answers left serialized (server/wire.py): no protobuf parse, no copy of the bytes.

The reader takes the next message only when its consumer asks for it, so gRPC's flow control
holds the worker back while the consumer is slow, and closing the generator cancels the call
(a consumer that stopped early, or went away: the worker stops sending). A call whose worker's
host the controller declares lost is cancelled then, and its reader raises the error naming the
host (host_watch.py), rather than waiting for a worker that stopped answering."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from schemas.pathways.v1 import worker_pb2 as wpb

from .. import wire
from .backend import BackendError
from .host_watch import Guard, HostWatch

FETCH_METHOD = "/pathways.v1.Worker/Fetch"


def fetch_method(channel: Any) -> Any:
    """The worker's `Fetch` on `channel`, with its answers left serialized."""
    return channel.unary_stream(FETCH_METHOD, request_serializer=wpb.FetchRequest.SerializeToString,
                                response_deserializer=None)


DOING = "downloading from"


async def data_messages(fetch: Any, request: wpb.FetchRequest, metadata: Any, address: str,
                        watch: HostWatch | None = None) -> AsyncGenerator[bytes, None]:
    """The serialized `FetchData` messages of a fetch with `data_messages`, as they came (each
    one's header checked: `{bytes data = 1}` and nothing else, else INTERNAL); the call's
    FAILED_PRECONDITION (the buffer failed) keeps its code and cause. `watch`: the call ends once
    its worker's host is lost. The call is cancelled when the generator ends or is closed."""
    call = fetch(request, metadata=metadata)
    guard = watch.guard(address, call, DOING) if watch is not None else None
    try:
        async for raw in call:
            try:
                wire.data_length(raw)
            except wire.WireError as e:
                raise BackendError("INTERNAL", f"undecodable fetch message from worker {address}: {e}") from None
            yield raw
    except (grpc.RpcError, asyncio.CancelledError) as e:
        failure = _failure(e, guard, address)
        if failure is e:
            raise
        raise failure from None
    finally:
        _end(call, guard)


def _failure(e: BaseException, guard: Guard | None, address: str) -> BaseException:
    """What a fetch's failure `e` raises: the lost host's error where the guard ended the call
    (host_watch.py), `e` itself for a cancellation of the caller, FAILED_PRECONDITION with the
    worker's cause (the buffer failed), else UNAVAILABLE naming the worker."""
    lost = guard.error() if guard is not None else None
    if lost is not None:
        return lost
    if isinstance(e, asyncio.CancelledError) or not isinstance(e, grpc.RpcError):
        return e
    rpc: Any = e  # grpc.aio's AioRpcError: code() and details()
    if rpc.code() == grpc.StatusCode.FAILED_PRECONDITION:
        return BackendError("FAILED_PRECONDITION", rpc.details() or "")
    return BackendError("UNAVAILABLE", f"downloading from worker {address} failed: {rpc.details()}")


def _end(call: Any, guard: Guard | None) -> None:
    call.cancel()
    if guard is not None:
        guard.stop()
