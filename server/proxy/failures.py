"""Runs of a proxy session that the controller refused or failed, and the output buffers they
fail: the session's events say so (a refused run never reaches a worker), and whoever waits on
those buffers (a download, a readiness check) is woken with the run's error at once instead of
waiting for buffers that will never exist (cluster_backend.py)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from schemas.pathways.v1 import controller_pb2 as cpb

from .backend import BackendError

T = TypeVar("T")
RECENT_RUNS = 4096  # runs whose outputs a refusal can still fail (refusals come at once)


class RunFailures:
    """The failed outputs of one session's runs, read from its event queue."""

    def __init__(self, queue: asyncio.Queue[cpb.SessionEvent | None]) -> None:
        self._queue = queue
        self._recent: OrderedDict[int, list[int]] = OrderedDict()  # run id -> its output buffers
        self._failed: dict[int, str] = {}  # output buffer -> the error of the run that failed
        self._waiters: dict[int, list[asyncio.Future[str]]] = {}  # buffer -> who waits for its failure

    def ran(self, run_id: int, outputs: list[int]) -> None:
        """A run was submitted with these output buffers."""
        self._recent[run_id] = outputs
        if len(self._recent) > RECENT_RUNS:
            self._recent.popitem(last=False)

    def drain(self) -> None:
        """Reads the session's events: a run the controller refused or failed fails its outputs,
        and wakes whoever waits on them (`failure`)."""
        queue = self._queue
        while not queue.empty():
            self._event(queue.get_nowait())

    def _event(self, ev: cpb.SessionEvent | None) -> None:
        if ev is None or not ev.HasField("finished") or ev.finished.ok:
            return
        for b in self._recent.pop(ev.finished.run_id, ()):
            self._failed[b] = ev.finished.error
            for w in self._waiters.pop(b, ()):
                if not w.done():
                    w.set_result(ev.finished.error)

    async def watch(self) -> None:
        """Reads the events as they come (a task for the session's life)."""
        while True:
            self._event(await self._queue.get())

    def check(self, buffer_id: int) -> None:
        """Raises BackendError with the error of the run that failed `buffer_id`, if one did."""
        self.drain()
        error = self._failed.get(buffer_id)
        if error is not None:
            raise BackendError("FAILED_PRECONDITION", error)

    def forget(self, buffer_ids: Sequence[int]) -> None:
        failed = self._failed
        if failed:
            for b in buffer_ids:
                failed.pop(b, None)

    def _failure(self, buffer_ids: Sequence[int]) -> asyncio.Future[str]:
        """Completes with the error of the first of `buffer_ids` whose run fails."""
        self.drain()
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        for b in buffer_ids:
            error = self._failed.get(b)
            if error is not None:
                fut.set_result(error)
                return fut
        for b in buffer_ids:
            self._waiters.setdefault(b, []).append(fut)
        return fut

    def _unwatch(self, buffer_ids: Sequence[int], fut: asyncio.Future[str]) -> None:
        for b in buffer_ids:
            waiters = self._waiters.get(b)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._waiters[b]

    async def unless_failed_here(self, buffer_ids: Sequence[int], work: Coroutine[Any, Any, T]) -> T:
        """`unless_failed` with no task of its own: `work` runs in the caller's task, which the
        failure cancels (as `asyncio.timeout` does), the cancellation caught here. Not for a
        coroutine stepped by hand in another task (an inline first step in the proxy session's
        reader, running.py): that task would be the one cancelled. A task less per download."""
        failure = self._failure(buffer_ids)
        task = asyncio.current_task()
        assert task is not None
        watching, fired = True, False

        def cancel(_: asyncio.Future[str]) -> None:  # scheduled when the failure came: the work may be over
            nonlocal fired
            if watching:
                fired = True
                task.cancel()

        try:
            if failure.done():
                work.close()
                raise BackendError("FAILED_PRECONDITION", failure.result())
            failure.add_done_callback(cancel)
            before = task.cancelling()
            try:
                return await work
            except asyncio.CancelledError:
                if fired and task.uncancel() <= before:  # this failure's cancellation, and no other
                    raise BackendError("FAILED_PRECONDITION", failure.result()) from None
                raise
        finally:
            watching = False
            failure.remove_done_callback(cancel)
            self._unwatch(buffer_ids, failure)

    async def unless_failed(self, buffer_ids: Sequence[int], work: Any) -> Any:
        """Awaits `work` unless one of `buffer_ids` fails first (then BackendError with its error)."""
        failure = self._failure(buffer_ids)
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait([task, failure], return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            raise BackendError("FAILED_PRECONDITION", failure.result())
        finally:
            if not task.done():
                task.cancel()
            self._unwatch(buffer_ids, failure)
