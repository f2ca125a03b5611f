"""The client's one transport layer: channels, calls, retries and streams to controllers and workers.

Modelled on Temporal's Python SDK (`service.py`): every RPC of the client library goes through a
`Transport`, which owns the channel (options from `CHANNEL_OPTIONS` alone), the call metadata
(the bearer token) and the translation of a failed call into the typed errors of `pwctl.errors`,
so no `grpc.RpcError` reaches a caller.

Retries: only calls marked idempotent (List*, Get*, Describe*, status) are retried, on UNAVAILABLE
only, with exponential backoff and jitter, within the call's own deadline. Submit, Create, Delete,
Cancel, Shutdown and the streams are never retried: a lost reply would repeat their effect.

The hot path (the session stream, uploads) pays nothing per message: the stream is the gRPC call
itself, and errors are translated only when one ends it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from . import tls as tls_
from .errors import PathwaysError, from_rpc_error

R = TypeVar("R")

MAX_MESSAGE_BYTES = 512 * 1024 * 1024
# Keepalive pings find a dead peer on an idle stream (the session waits on the controller for
# minutes). A gRPC server, by default, accepts pings no more often than every 5 minutes and closes
# the connection of a client that pings faster, so the client stays just above that.
KEEPALIVE_MS = 6 * 60 * 1000
KEEPALIVE_TIMEOUT_MS = 20 * 1000
MIN_CONNECT_TIMEOUT_MS = 20 * 1000  # gRPC's default (see CHANNEL_OPTIONS)

# Setting keepalive also makes gRPC set TCP_USER_TIMEOUT to the keepalive timeout on the channel's
# sockets (a client's carry none otherwise: docs/facts.md, "Peers that vanish"): bytes a vanished
# server never acknowledges fail the call within 20 s instead of the kernel's ~15 minutes. The
# workers' own channels use these too (server/worker/transfer.py, relay.py).
KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
]

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *KEEPALIVE_OPTIONS,
    ("grpc.enable_retries", 0),  # retries are ours (RetryPolicy), for idempotent reads only
    # a channel whose server went away tries again within 2 s (gRPC's default backoff grows to
    # 2 minutes): a `pw` session resumes soon after its controller restarted
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # gRPC's name for the least time a connection attempt is given (its handshake: TCP, TLS, the
    # server's HTTP/2 settings), not a backoff. It was 200 ms with the two above: a controller
    # busy or paused for longer (a loaded machine) failed the attempt, and every call waiting on
    # it failed UNAVAILABLE, "cannot reach the server", from a controller that was up
    # (tests/test_slow_server.py). A refused connection (a server not yet listening) still fails
    # at once, so reconnecting stays as quick.
    ("grpc.min_reconnect_backoff_ms", MIN_CONNECT_TIMEOUT_MS),
]


@dataclass(frozen=True)
class RetryPolicy:
    """How an idempotent call is retried: `max_attempts` in all, waiting `initial_backoff_s`, then
    `multiplier` times longer each time up to `max_backoff_s`, each pause off by up to +-`jitter`
    of itself (so clients that failed together do not retry together)."""

    max_attempts: int = 3
    initial_backoff_s: float = 0.1
    multiplier: float = 2.0
    max_backoff_s: float = 1.0
    jitter: float = 0.2
    retryable: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE})

    def backoff(self, attempt: int) -> float:
        """The pause after failed attempt number `attempt` (1-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return base * (1.0 + random.uniform(-self.jitter, self.jitter))


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(max_attempts=1)


def channel(address: str, tls: tls_.TlsConfig | None = None, own_connection: bool = False) -> grpc.Channel:
    """A channel to `address` with the client's options (the only place channels are made):
    TLS with `tls` (pwctl/tls.py), plaintext without. gRPC shares one connection among a
    process's channels to an address; with `own_connection`, this one opens its own (its calls
    do not queue behind what another channel's streams left unread)."""
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)] if own_connection else CHANNEL_OPTIONS
    return tls_.channel(address, options, tls)


class BidiStream(Generic[R]):
    """A bidirectional stream: iterate for the peer's messages (a failure, cancellation included,
    raises a typed error); `cancel()` ends it."""

    def __init__(self, call: Any, transport: Transport) -> None:
        self._call = call
        self._transport = transport

    def __iter__(self) -> Iterator[R]:
        try:
            yield from self._call
        except grpc.RpcError as e:
            raise self._transport.error(e) from None

    def cancel(self) -> None:
        self._call.cancel()


class Transport:
    """One connection to a controller or a worker at `address` ("server" or "worker": `peer`
    names it in error messages), over TLS with `tls`. Cheap to create; close() when done."""

    def __init__(self, address: str, token: str | None = None, *, peer: str = "server", timeout: float = 30.0,
                 retry: RetryPolicy = DEFAULT_RETRY, metadata: tuple[tuple[str, str], ...] = (),
                 tls: tls_.TlsConfig | None = None, own_connection: bool = False) -> None:
        self.address = address
        self.tls = tls
        self.peer = peer
        self.timeout = timeout
        self.retry = retry
        # the bearer token, and what else every call carries (a worker's session credential)
        self.metadata: tuple[tuple[str, str], ...] = (
            ((("authorization", f"Bearer {token}"),) if token else ()) + tuple(metadata))
        self.channel = channel(address, tls, own_connection)

    def close(self) -> None:
        self.channel.close()

    def error(self, e: grpc.RpcError) -> PathwaysError:
        """The typed error for a failed call on this connection; a connection that failed for TLS
        (plaintext to a TLS server, a CA that does not sign its certificate...) says so."""
        err = from_rpc_error(e, self.address, self.peer)
        if err.code == grpc.StatusCode.UNAVAILABLE:
            why = tls_.diagnose(err.details, self.address, self.peer, self.tls)
            if why is not None:
                return type(err)(why, code=err.code, details=err.details)
        return err

    def unary(self, rpc: Callable[..., R], request: Any, *, timeout: float | None = None,
              idempotent: bool = False) -> R:
        """Calls a unary RPC; an idempotent one is retried per `self.retry` within `timeout`."""
        budget = timeout or self.timeout
        deadline = time.monotonic() + budget
        attempt = 1
        while True:
            try:
                return rpc(request, timeout=budget, metadata=self.metadata)
            except grpc.RpcError as e:
                failure = e
            if not idempotent or attempt >= self.retry.max_attempts or failure.code() not in self.retry.retryable:
                raise self.error(failure)
            pause = self.retry.backoff(attempt)
            budget = deadline - time.monotonic() - pause
            if budget <= 0:
                raise self.error(failure)
            time.sleep(pause)
            attempt += 1

    def server_stream(self, rpc: Callable[..., Iterator[R]], request: Any,
                      timeout: float | None = None) -> Iterator[R]:
        """A server-streamed RPC's messages; the stream's cancellation ends it quietly."""
        try:
            yield from rpc(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                return
            raise self.error(e) from None

    def bidi(self, rpc: Callable[..., Any], requests: Iterator[Any]) -> BidiStream[Any]:
        """Opens a bidirectional stream fed by `requests` (consumed by gRPC's own thread)."""
        return BidiStream(rpc(requests, metadata=self.metadata), self)

    def client_stream_future(self, rpc: Any, requests: Iterator[Any]) -> Any:
        """Opens a client-streamed RPC fed by `requests`; returns its future (its reply)."""
        return rpc.future(requests, metadata=self.metadata)
