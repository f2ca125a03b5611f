"""A client's waits on one worker over a long-lived `Waits` stream (worker.proto), instead of a
unary `Wait` each: a blocking call (`block_until_ready`) then costs neither side a call's set-up,
and the worker checks the session credential once, when the stream opens (bench/FINDINGS.md).

One wait rides the stream at a time, in the caller's own thread (it sends the request, then
reads the reply itself: no reader thread to hand the answer on); a second caller meanwhile, or
any caller while the stream cannot be used, gets None and makes the unary call, whose behaviour
is the reference. A stream that breaks (the worker went away, restarted, or does not have
`Waits`) costs its wait nothing but time: that wait is made again as a unary call, whose answer
(or failure) is what the caller sees, and the stream is opened again on a later wait, no sooner
than `REOPEN_S` after (never, for a worker without it). A wait whose reply is overdue (the
caller's deadline passed: a stopped or wedged worker) is ended by a watchdog thread, which
cancels the stream; the caller gets the unary call's DEADLINE_EXCEEDED as a reply.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

from .transport import Transport

log = logging.getLogger(__name__)

REOPEN_S = 1.0  # after a stream broke, waits are unary calls this long before one opens it again
WATCH_S = 0.5  # how often the watchdog looks for an overdue reply
_STOP = object()


def _requests(q: queue.SimpleQueue[object]) -> Iterator[wpb.WaitRequest]:
    """A stream's requests as gRPC's thread takes them: from the queue alone (it must not hold
    the call: worker_client.py `_Stream.requests`)."""
    while True:
        item = q.get()
        if item is _STOP:
            return
        assert isinstance(item, wpb.WaitRequest)
        yield item


class WaitStream:
    """The `Waits` stream of one `WorkerClient`; `ask` sends one wait on it."""

    def __init__(self, transport: Transport, stub: wgrpc.WorkerStub) -> None:
        self._transport = transport
        self._stub = stub
        self._lock = threading.Lock()  # held by the one wait on the stream
        self._call: Any = None
        self._queue: queue.SimpleQueue[object] | None = None
        self._seq = 0
        self._reopen_at = 0.0
        self._unsupported = False
        self._closed = threading.Event()
        self._due: tuple[Any, float] | None = None  # the call a wait is on, and when its reply is overdue
        self._overdue: Any = None  # a call the watchdog cancelled
        self._watchdog: threading.Thread | None = None
        self.opened = 0  # streams opened (tests)

    def ask(self, request: wpb.WaitRequest, deadline_s: float,
            abandoned: Callable[[], bool] | None = None) -> wpb.WaitReply | None:
        """The worker's reply to `request` (its `code` set when refused, or DEADLINE_EXCEEDED when
        none came within `deadline_s`), or None: make the unary call instead, unless `abandoned()`
        says the caller's worker was abandoned since it took its mark (worker_client.py): looked at
        once the wait is where `abandon` finds it, so an `abandon` either ends it or is seen here."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._call is None and not self._open():
                return None
            call, q = self._call, self._queue
            assert q is not None
            self._seq += 1
            request.seq = self._seq
            self._due = (call, time.monotonic() + deadline_s)
            if abandoned is not None and abandoned():
                return None
            q.put(request)
            try:
                while True:
                    reply: wpb.WaitReply = next(call)
                    if reply.seq == request.seq:
                        return reply
            except (grpc.RpcError, StopIteration) as e:
                overdue, self._overdue = self._overdue is call, None
                self._broke(e)
                if overdue:
                    return wpb.WaitReply(code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
                return None
            finally:
                self._due = None
        finally:
            self._lock.release()

    def _open(self) -> bool:
        """Opens a stream (the lock held); False when none may be opened now."""
        if self._closed.is_set() or self._unsupported or time.monotonic() < self._reopen_at:
            return False
        self._queue = queue.SimpleQueue()
        self._call = self._stub.Waits(_requests(self._queue), metadata=self._transport.metadata)
        self.opened += 1
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="pw-wait-watchdog", daemon=True)
            self._watchdog.start()
        return True

    def _broke(self, e: BaseException) -> None:
        """The stream ended under a wait (the lock held): let it go; reopen later."""
        code = e.code() if isinstance(e, grpc.RpcError) else None
        if code == grpc.StatusCode.UNIMPLEMENTED:  # a worker from before `Waits`: unary calls only
            self._unsupported = True
        elif not self._closed.is_set():
            log.info("the wait stream to the worker at %s ended (%s); waits are unary calls for %g s",
                     self._transport.address, code.name if code else "no status", REOPEN_S)
        self._reopen_at = time.monotonic() + REOPEN_S
        self._drop()

    def _drop(self) -> None:
        call, q = self._call, self._queue
        self._call = self._queue = None
        if q is not None:
            q.put(_STOP)
        if call is not None:
            call.cancel()

    def _watch(self) -> None:
        """Cancels the stream under a wait whose reply is overdue (the caller then stops waiting)."""
        while not self._closed.wait(WATCH_S):
            due = self._due
            if due is not None and time.monotonic() > due[1]:
                self._overdue = due[0]
                due[0].cancel()

    def abandon(self) -> None:
        """Ends the wait on the stream now, if one is under way (its worker's host was lost: the
        caller reports that); the stream is opened again on a later wait."""
        due = self._due
        if due is not None:
            due[0].cancel()

    def close(self) -> None:
        """Ends the stream and the watchdog; a wait under way ends (its caller makes the unary
        call, on a channel closed by then)."""
        self._closed.set()
        call, q = self._call, self._queue
        if q is not None:
            q.put(_STOP)
        if call is not None:
            call.cancel()

    def forget(self) -> None:
        """After `close`: lets go of the call (worker_client.py `WorkerClient.join`)."""
        self._call = self._queue = None
        self._overdue = self._due = None
