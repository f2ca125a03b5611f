"""How the worker answers a `Wait` (servicer.py): buffers settled, their computations over.

Settled is not computed: a launched buffer is ready as soon as its computation is launched
(JAX's asynchronous dispatch). A Wait for buffers computed already is answered on the event
loop; one for launches still computing waits for the executor's completion of them
(Computations.when_computed, called back from the completion thread), so no thread blocks on
them and the answer leaves with one thread hand-off less (bench/FINDINGS.md); anything else (too
many buffers, values that are not launches' outputs) waits in a pool thread.
"""

from __future__ import annotations

import asyncio
import enum
from concurrent.futures import ThreadPoolExecutor

import jax

from schemas.pathways.v1 import worker_pb2 as wpb

from .buffers import BufferFailed, BufferStore
from .readiness import computed_now

MAX_CHECKED_NOW = 64  # a Wait for at most this many buffers is answered on the event loop once all are computed


def wake(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    """Completes `fut` from any thread (the one settling a buffer), once."""
    def resolve() -> None:
        if not fut.done():
            fut.set_result(None)

    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the loop closed: the worker is stopping, nobody waits any more
        pass


async def woken_within(fut: asyncio.Future[None], timeout: float) -> bool:
    """Whether `fut` (completed by `wake`) completed within `timeout` seconds."""
    try:
        await asyncio.wait_for(fut, timeout)
        return True
    except TimeoutError:
        return False


class Verdict(enum.Enum):
    """What `Waits._values_now` says when it has no values to answer with."""

    WAIT = enum.auto()  # something may still be computing, or too many to check on the loop: wait for them
    ANSWER = enum.auto()  # one failed or is gone: `_computed` answers at once (with the error), no waiting


class Waits:
    """The waiting methods of `WorkerServicer` (which sets these attributes up)."""

    store: BufferStore
    _pool: ThreadPoolExecutor

    async def _launches_over(self, buffer_ids: list[int], timeout: float) -> bool | None:
        """Waits for the executor's completion of these launched buffers (computations.py):
        no pool thread blocks on them. False after `timeout`; None when not all are launches'."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        latch = self.store.computations.when_computed(buffer_ids, lambda: wake(loop, fut))
        if latch is False:
            return None
        if latch is True:
            return True
        try:
            return await woken_within(fut, timeout)
        finally:
            self.store.computations.forget_computed(buffer_ids, latch)

    def _values_now(self, buffer_ids: list[int], must_exist: bool) -> list[object] | Verdict:
        """The settled buffers' values when the computations behind them are over; else
        Verdict.ANSWER when the answer needs no waiting either (one failed or is gone), or
        Verdict.WAIT when something may still be computing, or there are too many to check here
        (a pool thread then blocks on them)."""
        try:
            values = self.store.wait_all(buffer_ids, 0.0, must_exist=must_exist)
        except (TimeoutError, BufferFailed):
            return Verdict.ANSWER  # `_computed` reads the error at once
        if len(values) > MAX_CHECKED_NOW:
            return Verdict.WAIT
        # one deleted (None) or computing: a pool thread's wait reports it, or waits for it
        return values if all(computed_now(v) for v in values) else Verdict.WAIT

    def _computed(self, buffer_ids: list[int], must_exist: bool = False,
                  values: list[object] | None = None) -> wpb.WaitReply:
        """Waits for the computations behind settled buffers (launched is not computed);
        `values`: theirs, when the caller read them already (None: they are read here)."""
        try:
            jax.block_until_ready(values if values is not None
                                  else self.store.wait_all(buffer_ids, 0.0, must_exist=must_exist))
        except TimeoutError:
            return wpb.WaitReply(ready=False)
        except BufferFailed as e:
            return wpb.WaitReply(error=str(e))
        except Exception as e:  # the computation behind the array failed
            return wpb.WaitReply(error=f"{type(e).__name__}: {e}")
        return wpb.WaitReply(ready=True)
