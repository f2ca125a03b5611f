"""The database's one writer: a thread that runs write jobs in the order they came, off the
event loop.

Callers on the event loop hand it a job (a function of an ORM session) and go on; a caller that
needs the outcome (a request that may only answer once its change is durable) awaits the future
`submit` returns, which the event loop does without blocking. Jobs waiting together run in one
transaction (fewer commits, so fewer fsyncs); when that transaction fails, each of its jobs is
retried in its own, so one bad job fails alone and the others still land, in order.

Order: jobs commit in submission order (one thread, one FIFO queue), so a slice created and then
deleted is never written the other way round. `close` runs every job submitted before it.

Cancelling: a write cannot be cancelled. Once submitted it runs; a request that awaits it and
is cancelled (its client went away) only stops waiting. `asyncio.wrap_future` cancels the future
it wraps when its awaiter is cancelled: a writer that honoured that skipped the delete of a
released slice whose session was closing, and the restarted controller then refused the
database (a slice's row carrying an older slice's remaps).

Bound: the queue holds what the control plane submits between two commits (registrations, host
losses, slice changes, job transitions, one heartbeat flush every few seconds and one program
statistics flush a second); the hot path submits nothing. `MAX_BATCH` bounds one transaction.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_BATCH = 256  # jobs per transaction

_Job = tuple[Callable[[Session], Any], "Future[Any]"]


class Write(Protocol):
    """`DbWriter.submit`, as the components that write take it."""

    def __call__(self, job: Callable[[Session], T], /) -> Future[T]: ...


class _WriteFuture(Future[T]):
    """A write's outcome; `cancel` refuses (see the module docstring), so every waiter of the
    same write sees it end as it did."""

    def cancel(self) -> bool:
        return False


class WriterClosed(RuntimeError):
    """A write was submitted after `close`."""


class DbWriter:
    """See the module docstring. `submit` may be called from any thread."""

    def __init__(self, sessions: sessionmaker[Session], name: str = "db-writer") -> None:
        self._sessions = sessions
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders `closed` against submissions
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[Session], T]) -> Future[T]:
        """Queues `job`; its future holds what it returned once committed, or why it failed."""
        fut: Future[T] = _WriteFuture()
        with self._lock:
            if self._closed:
                raise WriterClosed("the database writer is closed")
            self._queue.put((job, fut))
        return fut

    def close(self, timeout: float | None = None) -> bool:
        """Runs every job already submitted, then ends the thread; False if it had not ended
        within `timeout` seconds."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            last = False
            while len(batch) < MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    last = True
                    break
                batch.append(item)
            self._write(batch)
            if last:
                return

    def _write(self, batch: list[_Job]) -> None:
        live = [(job, fut) for job, fut in batch if fut.set_running_or_notify_cancel()]
        if not live:
            return
        results: list[Any] = []
        try:
            with self._sessions.begin() as s:
                for job, _ in live:
                    results.append(job(s))
        except Exception as e:
            if len(live) == 1:
                _fail(live[0][1], e)
                return
            for job, fut in live:  # one transaction each: only the bad job fails
                try:
                    with self._sessions.begin() as s:
                        result = job(s)
                except Exception as e1:
                    _fail(fut, e1)
                else:
                    fut.set_result(result)
            return
        for (_, fut), result in zip(live, results, strict=True):
            fut.set_result(result)



def _fail(fut: Future[Any], error: Exception) -> None:
    # a failed write is a bug or a broken database: its traceback belongs in the log
    log.error("a database write failed", exc_info=error)
    fut.set_exception(error)
