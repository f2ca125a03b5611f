"""The acknowledgements of an `Uploads` stream (worker.proto), coalesced.

The client keeps each upload until an acknowledgement covers it, and sends again what a broken
stream did not acknowledge (pwctl/worker_client.py); `UploadAck.handled` counts the messages
handled so far, so one acknowledgement covers everything before it. One per message cost a
pipelined loop of small uploads a third of its calls/s (bench/FINDINGS.md): a gRPC write on the
worker's event loop, a wake-up of the client's acknowledgement thread. So the first message
handled is acknowledged at once, and the ones after it at most every `ACK_EVERY_S`, each
acknowledgement covering all handled until it is written; the last ones when the stream ends
well. The client only holds its uploads' bytes that much longer.
"""

from __future__ import annotations

import asyncio
import contextlib

from grpc import aio

from schemas.pathways.v1 import worker_pb2 as wpb

ACK_EVERY_S = 0.005


class Acknowledger:
    """Writes a stream's acknowledgements: `handled(n)` after each message, `close()` at its end
    (`ok`: the requests ended well, so the last count is written; else nothing more is)."""

    def __init__(self, context: aio.ServicerContext, every_s: float = ACK_EVERY_S) -> None:
        self._context = context
        self._every_s = every_s
        self._count = 0  # handled so far
        self._sent = 0  # covered by the acknowledgements written
        self._due = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._writing = False
        self._closing = False

    def handled(self, count: int) -> None:
        self._count = count
        self._due.set()
        if self._task is None and not self._closing:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while not self._closing:
            await self._due.wait()
            self._due.clear()
            if self._closing:
                return
            if self._count > self._sent:
                await self._write()
            if not self._closing:
                await asyncio.sleep(self._every_s)

    async def _write(self) -> None:
        count = self._count
        self._writing = True
        try:
            await self._context.write(wpb.UploadAck(handled=count))
        finally:
            self._writing = False
        self._sent = max(self._sent, count)

    async def close(self, ok: bool) -> None:
        """Stops the writer (a write under way completes: a gRPC write is not cut in the middle)
        and, when `ok`, writes what is not acknowledged yet."""
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            if not self._writing:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if ok and self._count > self._sent:
            await self._write()
