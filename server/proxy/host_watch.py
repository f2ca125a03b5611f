"""A proxy session's calls to workers, ended once the controller declares the worker's host lost.

A worker that stops answering without closing its connections (frozen, cut off by the network)
keeps a call to it waiting with no end: the proxy's calls to workers have no deadline, or a long
one (a download or a readiness check waits up to an hour for a computation, a compile ten
minutes), and the unmodified JAX client waits on them. The controller declares such a host lost
once its heartbeats stop (its --heartbeat-timeout); each call in flight to a worker holds a
`Guard`, a timer that looks at the state of the worker's host every LOST_POLL_S and cancels the
call once it is lost; the caller then raises `Guard.error()`, UNAVAILABLE naming the host. A call
to a worker whose host is lost fails at once, before it is sent: one this session saw lost, or,
where the session never called that worker before (a session opened just before its worker froze:
its first upload), one the cluster's registry holds lost at that address. Such a call is never
left unwatched: a frozen worker's new connection waits for gRPC's 20 s connect timeout, then on.

The cost is one timer a call (re-armed while the call lasts, stopped when it ends), no task: a
call over sooner than LOST_POLL_S costs one `call_later` and its cancel. Streaming calls (a
`Fetch`'s answers, a staged upload's `PutBuffers`) hold their guard for their whole life, and
their reader turns the cancellation into the same error (fetching.py, staging.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from ..controller.cluster_rows import LOST
from .backend import BackendError

LOST_POLL_S = 0.25  # how often a call in flight looks at its worker's host

HostOf = Callable[[str], Any]  # worker address -> its ready host (controller/cluster.py HostInfo), or None


def lost_error(doing: str, address: str, host: str) -> BackendError:
    return BackendError("UNAVAILABLE", f"{doing} worker {address} failed: its host {host} was lost")


class Guard:
    """One call's watch on its worker's host (`HostWatch.guard`): cancels `call` once the host
    is lost; `stop` when the call is over (the timer also stops by itself once the call is done).

    `writer`: a task waiting on a write of the call's request stream, which cancelling the call
    leaves waiting (grpc.aio's `write` blocked by flow control, the worker reading nothing): it is
    cancelled too, and `error` takes that cancellation back."""

    __slots__ = ("_address", "_call", "_doing", "_host", "_loop", "_timer", "_woken", "lost", "writer")

    def __init__(self, host: Any, call: Any, doing: str, address: str) -> None:
        self._host = host
        self._call = call
        self._doing = doing
        self._address = address
        self.lost = False
        self.writer: asyncio.Task[Any] | None = None
        self._woken: asyncio.Task[Any] | None = None
        self._loop = loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = loop.call_later(LOST_POLL_S, self._look)

    def _look(self) -> None:
        if self._host.state == LOST:
            self.lost = True
            self._timer = None
            self._call.cancel()
            if self.writer is not None:
                self._woken, self.writer = self.writer, None
                self._woken.cancel()
        elif self._call.done():
            self._timer = None
        else:
            self._timer = self._loop.call_later(LOST_POLL_S, self._look)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def error(self) -> BackendError | None:
        """The error to raise for the call's failure (a cancellation, or its RpcError) where the
        guard cancelled it because the host was lost; None otherwise, and while the caller's own
        task is being cancelled (that cancellation goes on). Called where the failure was caught."""
        if not self.lost:
            return None
        task = asyncio.current_task()
        if task is not None:
            if task is self._woken:  # this guard cancelled it (`writer`): taken back
                self._woken = None
                task.uncancel()
            if task.cancelling():
                return None
        return lost_error(self._doing, self._address, self._host.name)


class HostWatch:
    """The hosts of one session's worker calls. `host_of`: the controller's ready host at an
    address (the dispatcher's `host_by_address`); None: nothing is watched (no controller).
    `hosts`: the cluster's registry by name, any state (the dispatcher's `hosts`), where a lost
    host at an address this session never called is found (`_lost_at`)."""

    def __init__(self, host_of: HostOf | None, hosts: Mapping[str, Any] | None = None) -> None:
        self._host_of = host_of
        self._hosts = hosts
        self._seen: dict[str, Any] = {}  # address -> the host last found ready there

    def _lost_at(self, address: str) -> Any:
        """The lost host at `address` where no ready host is there (None: none known lost): the
        one this session last saw there, else one of the registry's (scanned: only once a host
        at an address the session calls is no longer ready)."""
        seen = self._seen.get(address)
        if seen is not None:
            return seen if seen.state == LOST else None
        if self._hosts is not None:
            for host in list(self._hosts.values()):
                if host.address == address and host.state == LOST:
                    self._seen[address] = host
                    return host
        return None

    def guard(self, address: str, call: Any, doing: str) -> Guard | None:
        """A guard on `call`, just made, to the worker at `address` (`doing` it: "downloading
        from", for the error: "{doing} worker {address} failed: its host {name} was lost").
        Raises that error at once (the call cancelled) where the host this session last saw at
        `address` is lost; None where no ready host is there now (unwatched: the call says what
        it finds)."""
        if self._host_of is None:
            return None
        host = self._host_of(address)
        if host is None:
            lost = self._lost_at(address)
            if lost is not None:
                call.cancel()
                raise lost_error(doing, address, lost.name)
            return None
        self._seen[address] = host
        return Guard(host, call, doing, address)

    def check(self, address: str, doing: str) -> None:
        """Raises `guard`'s error at once where the host this session last saw at `address` is
        lost: for a request that would otherwise first wait on something else (a bulk connection
        to make, whose hello a frozen worker never answers: bulk.py)."""
        if self._host_of is None or self._host_of(address) is not None:
            return
        lost = self._lost_at(address)
        if lost is not None:
            raise lost_error(doing, address, lost.name)

    async def unless_lost(self, address: str, call: Any, doing: str) -> Any:
        """Awaits `call` (a unary or stream-unary call to the worker at `address`); once its host
        is lost the call is cancelled and this raises the error naming it (`guard`)."""
        guard = self.guard(address, call, doing)
        if guard is None:
            return await call
        try:
            return await call
        except (asyncio.CancelledError, grpc.RpcError):
            error = guard.error()
            if error is not None:
                raise error from None
            raise
        finally:
            guard.stop()
