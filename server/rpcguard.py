"""Malformed requests and known errors as status codes, for every method of a gRPC server.

grpc.aio decodes a request before the handler runs; a request that does not decode raised
inside grpc, which answered UNKNOWN and logged a full traceback for every such request (issue
29, findings 8 and 9). `GuardInterceptor` wraps every handler of the server instead:

- the request deserializer never raises: bytes that do not decode become a `Malformed` value,
  answered INVALID_ARGUMENT ("malformed request ...") with one warning line, no traceback; on a
  streaming request the stream ends there, with that status;
- an exception the `classify` function recognises (the controller's `ControllerError`s, a
  broken invariant) becomes its status code and one-line message, in every kind of handler,
  streaming ones included (they had no mapping at all: an unknown job's `logs -f` was UNKNOWN);
- anything else is a bug: it propagates, and grpc logs its traceback (tracebacks are for bugs);
- a response stream is written by the wrapper (`write_or_cancel`), not by grpc from the handler's
  generator: a caller killed mid-stream ends the handler as a cancellation, no traceback.

Warnings about malformed requests are rate-limited (`LOG_EVERY_S` per method), so a flood of
garbage writes a bounded log.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0  # at most one warning per method per this many seconds (the rest are counted)


async def write_or_cancel(context: Any, message: Any) -> None:
    """Writes one message of a server stream with `context.write`. A write that fails is a caller
    gone (it hung up, was killed, or its connection broke): gRPC can fail the write before it marks
    the call closed by the client, and then logs the failure (ExecuteBatchError, private to grpc)
    as an error with a traceback, as it did for a message of an async generator handler, which
    gRPC writes itself; so the write ends the handler as the cancellation it is (logged at debug)."""
    try:
        await context.write(message)
    except asyncio.CancelledError:
        raise
    except Exception:  # ExecuteBatchError and kin: the call is over
        raise asyncio.CancelledError from None


async def write_stream(context: Any, items: AsyncGenerator[Any, None]) -> None:
    """Writes a handler's response generator with `write_or_cancel` (not gRPC from the generator),
    closing it at once when the stream ends either way (its `finally` runs before the call ends)."""
    async with contextlib.aclosing(items) as messages:
        async for message in messages:
            await write_or_cancel(context, message)


GRPC_LOGGER = "grpc._cython.cygrpc"  # grpc.aio's server, which logs a handler's failures
_BATCH_LOGGED = "ExecuteBatchError raised in core by servicer method ["


class FinalStatusFilter(logging.Filter):
    """Makes one line of the one gRPC error no handler can prevent: the call's final status, which
    grpc.aio sends after the handler returns, failing because the call ended first (its caller
    killed, or gone by its deadline, as the handler finished). grpc.aio logs that with a traceback
    of its own code unless it has already seen the caller's cancellation, a race. Exactly that
    record is rewritten, at INFO: `_BATCH_LOGGED` for an ExecuteBatchError core raised for a batch
    that carried the final status ('Failed "execute_batch": (...SendStatusFromServerOperation...)';
    core fails a batch it had started only when the call is over). Failed message writes are the
    handlers' to end (`write_or_cancel`) and stay errors, as does a batch core refused to start
    ('Failed grpc_call_start_batch', a misuse: a bug); see docs/architecture.md, "Callers that die"."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if (isinstance(record.msg, str) and record.msg.startswith(_BATCH_LOGGED)
                and type(exc).__name__ == "ExecuteBatchError" and str(exc).startswith('Failed "execute_batch"')
                and "SendStatusFromServerOperation" in str(exc)):
            method = record.msg[len(_BATCH_LOGGED):].rstrip("]")
            record.msg, record.args = "%s: final status not sent, the call ended first (its caller gone)", (method,)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_final_status() -> None:
    """Installs `FinalStatusFilter` on gRPC's server logger (once per process)."""
    logger = logging.getLogger(GRPC_LOGGER)
    if not any(isinstance(f, FinalStatusFilter) for f in logger.filters):
        logger.addFilter(FinalStatusFilter())


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes did not decode as the method's message."""

    type_name: str
    error: str

    @property
    def message(self) -> str:
        return f"malformed request: not a valid {self.type_name} ({self.error})"


@dataclass(frozen=True)
class Mapped:
    """How a recognised exception is answered."""

    code: grpc.StatusCode
    message: str
    log_level: int = logging.DEBUG  # a rejected request is the caller's problem, not the log's


Classify = Callable[[BaseException], Mapped | None]


def decoder(parse: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
    """`parse` made total: bytes it cannot decode become a `Malformed` naming `type_name`."""

    def decode(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as e:  # DecodeError, or anything a custom deserializer raises
            return Malformed(type_name, str(e).split(":")[-1].strip() or type(e).__name__)

    return decode


def _safe(deserializer: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    type_name = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    return decoder(deserializer, getattr(type_name, "full_name", method))


class WarningLimiter:
    """One warning per method per `LOG_EVERY_S`; the others are counted into the next one."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warn(self, method: str, peer: str, text: str) -> None:
        now = time.monotonic()
        if now - self._last.get(method, -LOG_EVERY_S) < LOG_EVERY_S:
            self._quiet[method] = self._quiet.get(method, 0) + 1
            return
        self._last[method] = now
        more = self._quiet.pop(method, 0)
        log.warning("%s from %s: %s%s", method, peer or "?", text,
                    f" (and {more} more since the last warning)" if more else "")


class GuardInterceptor(aio.ServerInterceptor):
    """Wraps every handler: malformed requests answered INVALID_ARGUMENT, recognised exceptions
    mapped by `classify` (module docstring)."""

    def __init__(self, classify: Classify, skip: Callable[[str], bool] | None = None) -> None:
        self._classify = classify
        # methods that decode their own requests and answer their own errors (the IFRT proxy's
        # session stream): not wrapped, so their messages skip two generator hops each
        self._skip = skip
        self._limiter = WarningLimiter()
        self.malformed = 0  # requests answered INVALID_ARGUMENT because they did not decode

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if self._skip is not None and self._skip(method):
            return handler
        decode = _safe(handler.request_deserializer, method)
        ser, wrap = handler.response_serializer, self._wrap
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, method, False, False), decode, ser)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, method, True, False), decode, ser)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, method, False, True), decode, ser)
        assert handler.stream_stream is not None
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, method, True, True), decode, ser)

    # ---- pieces ----
    async def _reject(self, context: aio.ServicerContext, method: str, bad: Malformed) -> None:
        self.malformed += 1
        self._limiter.warn(method, context.peer(), bad.message)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.message)

    async def _map(self, context: aio.ServicerContext, method: str, e: Exception) -> None:
        """Answers a recognised exception with its status; re-raises anything else."""
        mapped = self._classify(e)
        if mapped is None:
            raise e
        log.log(mapped.log_level, "%s from %s: %s %s", method, context.peer() or "?", mapped.code.name,
                mapped.message)
        await context.abort(mapped.code, mapped.message)

    def _requests(self, it: AsyncIterator[Any], context: aio.ServicerContext, method: str) -> AsyncIterator[Any]:
        """The decoded messages of a request stream; a malformed one ends it, with the status
        INVALID_ARGUMENT set for when the handler returns."""

        async def gen() -> AsyncIterator[Any]:
            async for msg in it:
                if isinstance(msg, Malformed):
                    self.malformed += 1
                    self._limiter.warn(method, context.peer(), msg.message)
                    context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                    context.set_details(msg.message)
                    return
                yield msg

        return gen()

    def _wrap(self, behavior: Callable[..., Any], method: str, streaming_in: bool,
              streaming_out: bool) -> Callable[..., Any]:
        """`behavior` guarded: a malformed request refused (a request stream's ends at it), a
        recognised exception answered with its status (`_map`). A response stream is written here
        (`write_or_cancel`), not by gRPC from a generator: a caller killed mid-stream ends the
        handler as a cancellation, with no traceback in the log; the handler's generator is
        closed at once (its `finally` runs before the call ends)."""

        async def wrapped(request: Any, context: aio.ServicerContext) -> Any:
            if streaming_in:
                request = self._requests(request, context, method)
            elif isinstance(request, Malformed):
                await self._reject(context, method, request)
            try:
                result = behavior(request, context)
                if streaming_out and hasattr(result, "__aiter__"):
                    await write_stream(context, result)
                    return None
                if inspect.isawaitable(result):
                    result = await result  # a stream's handler that writes with context.write()
                return None if streaming_out else result
            except aio.AbortError:
                raise
            except Exception as e:
                await self._map(context, method, e)

        return wrapped
