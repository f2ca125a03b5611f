"""A download's wait on a failed run in the fetch's own task (server/proxy/failures.py
`RunFailures.unless_failed_here`): the run's failure ends the fetch with its error, a cancellation
from elsewhere stays a cancellation, and a failure that comes as the fetch ends leaves the task alone."""

from __future__ import annotations

import asyncio

import pytest

from schemas.pathways.v1 import controller_pb2 as cpb
from server.proxy.backend import BackendError
from server.proxy.failures import RunFailures

RUN, BUF = 7, 70


def failures() -> tuple[RunFailures, asyncio.Queue[cpb.SessionEvent | None]]:
    queue: asyncio.Queue[cpb.SessionEvent | None] = asyncio.Queue()
    out = RunFailures(queue)
    out.ran(RUN, [BUF])
    return out, queue


def fail(out: RunFailures, queue: asyncio.Queue[cpb.SessionEvent | None]) -> None:
    queue.put_nowait(cpb.SessionEvent(finished=cpb.RunFinished(run_id=RUN, ok=False, error="the run broke")))
    out.drain()


@pytest.mark.timeout(30)
def test_a_failure_ends_the_fetch_with_the_runs_error() -> None:
    async def main() -> None:
        out, queue = failures()
        closed = asyncio.Event()

        async def fetch() -> bytes:
            try:
                await asyncio.sleep(30)
            finally:
                closed.set()
            return b"never"

        async def fetching() -> bytes:
            return await out.unless_failed_here([BUF], fetch())

        task = asyncio.create_task(fetching())
        await asyncio.sleep(0.01)
        fail(out, queue)
        with pytest.raises(BackendError, match="the run broke") as e:
            await task
        assert e.value.code == "FAILED_PRECONDITION" and closed.is_set()
        # a fetch of a buffer already failed does not start
        with pytest.raises(BackendError, match="the run broke"):
            await asyncio.create_task(out.unless_failed_here([BUF], fetch()))

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_cancellation_from_elsewhere_stays_one() -> None:
    async def main() -> None:
        for failure_first in (False, True):  # the session's end, say, and the run's failure in one turn
            out, queue = failures()

            async def fetching(out: RunFailures = out) -> bytes:
                return await out.unless_failed_here([BUF], asyncio.sleep(30, b""))

            task = asyncio.create_task(fetching())
            await asyncio.sleep(0.01)
            if failure_first:
                fail(out, queue)
            task.cancel()
            if not failure_first:
                fail(out, queue)
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_failure_as_the_fetch_ends_leaves_its_task_alone() -> None:
    """The fetch's bytes and the run's failure in the same turn of the loop: the task has its
    bytes, and the failure's callback, run after, does not cancel what the task does next."""

    async def main() -> None:
        out, queue = failures()
        arrived: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def fetch() -> bytes:
            return await arrived

        async def fetching() -> tuple[bytes, str]:
            got = await out.unless_failed_here([BUF], fetch())
            await asyncio.sleep(0.05)  # the caller's next step: not cancelled by the stale failure
            return got, "went on"

        task = asyncio.create_task(fetching())
        await asyncio.sleep(0.01)
        arrived.set_result(b"bytes")  # the task's wake-up is scheduled first,
        fail(out, queue)  # then the failure's callback
        assert await task == (b"bytes", "went on")

    asyncio.run(main())
