"""The controller's end of one worker's WorkerConnect stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from schemas.pathways.v1 import controller_pb2 as cpb

_CLOSE = object()

# Sees every message as a stream takes it to hand to gRPC: the dispatch probe's hook
# (dispatch_probe.py, only when the controller runs with PATHWAYS_DISPATCH_PROBE), else None.
on_handed: Callable[[cpb.ControllerToWorker], None] | None = None


class WorkerLink:
    """Outbound queue to one connected worker; messages keep their order."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self.closed = False

    def send(self, msg: cpb.ControllerToWorker) -> None:
        if not self.closed:
            self._queue.put_nowait(msg)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(_CLOSE)

    async def messages(self) -> AsyncIterator[cpb.ControllerToWorker]:
        while True:
            msg = await self._queue.get()
            if msg is _CLOSE:
                return
            assert isinstance(msg, cpb.ControllerToWorker)
            if on_handed is not None:
                on_handed(msg)
            yield msg
