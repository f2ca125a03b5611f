"""A host buffer streamed on to its worker as the client sends it (issue 28: bounded memory).

The jaxlib client stores a host buffer (HostBufferStore, in chunks) before the MakeArray that says
what array it is. Instead of holding the whole buffer, the controller opens a `PutBuffers` stream
to the slice's first worker and forwards each chunk as a piece of a staged upload
(worker/uploads.py: pieces without a dtype). The MakeArray then ends the stream with the array's
dtype and shape (`finish`), which the worker checks against the bytes, and the array moves on,
worker to worker, to the worker holding its devices where that is another (cluster_backend.py
`settle_staged`); a consumer that needs the bytes themselves (a strided buffer, a shard to
assemble, a lookup) gets them back from the worker (`materialize`); a buffer deleted unused is
dropped by cancelling the stream (`discard`), so the worker never stores it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import grpc

from .. import wire
from .backend import BackendError
from .handles import HostData
from .host_watch import Guard

PIECE_BYTES = 4 << 20  # a chunk larger than this goes on in pieces of this size (worker messages ≤ 64 MiB)


class Owner(Protocol):
    """What a staging needs of its session (cluster_backend.SliceSession)."""

    async def get(self, buffer_id: int) -> HostData: ...

    def free(self, buffer_ids: Sequence[int]) -> None: ...

    def adopt(self, buffer_id: int, address: str) -> None: ...


class Staging:
    """One host buffer on its way to a worker: `write` its bytes in order, then exactly one of
    `finish`, `materialize`, `discard`. `call` is the worker's PutBuffers (serialized requests),
    opened without a request iterator; `guard` cancels it once the worker's host is lost (and
    wakes a write waiting on it: host_watch.py), and the staging fails naming the host."""

    def __init__(self, session: Owner, call: Any, address: str, buffer_id: int, owner: str, nbytes: int,
                 guard: Guard | None = None) -> None:
        self._session = session
        self._call = call
        self._guard = guard
        self.address = address
        self.buffer_id = buffer_id
        self._owner = owner
        self.nbytes = nbytes
        self.sent = 0
        self._closed = False
        self._failed: BackendError | None = None  # why the stream failed while the bytes came (`write`)

    @classmethod
    def failed(cls, session: Owner, error: BackendError, nbytes: int) -> Staging:
        """A staging that takes the bytes nowhere: the array made of them fails with `error`."""
        staging = cls(session, None, "", 0, "", nbytes)
        staging._failed = error
        staging._closed = True
        return staging

    def __len__(self) -> int:
        return self.nbytes

    def _close(self) -> None:
        self._closed = True
        if self._guard is not None:
            self._guard.stop()

    async def _step(self, step: Any) -> Any:
        """Awaits `step` (a write, or the end of the stream) of the call; the call's failure is
        the worker's reason (`_error`), or the loss of its host: its guard then cancels the call
        and wakes this task, which a write blocked on the worker's flow control needs."""
        guard = self._guard
        if guard is not None:
            guard.writer = asyncio.current_task()
        try:
            return await step
        except (grpc.RpcError, asyncio.InvalidStateError):
            raise await self._error() from None
        except asyncio.CancelledError:
            lost = guard.error() if guard is not None else None
            if lost is None:  # not the guard's: the task is cancelled
                raise
            self._close()
            raise lost from None
        finally:
            if guard is not None:
                guard.writer = None

    async def _send(self, message: bytes) -> None:
        await self._step(self._call.write(message))

    async def _error(self) -> BackendError:
        """The worker's reason for ending the stream (it aborts with one), or the loss of its host."""
        self._close()
        lost = self._guard.error() if self._guard is not None else None  # None unless the host was lost
        if lost is not None:
            return lost
        try:
            await self._call
        except grpc.RpcError as e:
            return BackendError("UNAVAILABLE" if e.code() == grpc.StatusCode.UNAVAILABLE else e.code().name,
                                f"uploading to worker {self.address}: {e.details()}")
        except asyncio.CancelledError:
            pass
        return BackendError("UNAVAILABLE", f"uploading to worker {self.address}: the stream ended")

    async def write(self, chunk: bytes | memoryview) -> None:
        """Forwards the next bytes of the buffer (the caller checks the total stays in `nbytes`).
        Once the stream failed the bytes go nowhere, and the array made of them (`finish`) fails
        with its error: the client's HostBufferStore ends well, since the jaxlib client ends its
        whole session when one fails."""
        if self._failed is not None:
            return
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), PIECE_BYTES):
            piece = view[start : start + PIECE_BYTES]
            try:
                await self._send(wire.put_buffer_request(self.buffer_id, self._owner, "", (), [piece], self.sent,
                                                         self.nbytes))
            except BackendError as e:
                self._failed = e
                return
            self.sent += len(piece)

    async def finish(self, dtype: str, shape: tuple[int, ...]) -> int:
        """Makes the staged bytes the array `dtype[shape]` on the worker; its buffer id."""
        if self._failed is not None:
            raise self._failed
        assert self.sent == self.nbytes and not self._closed
        await self._send(wire.put_buffer_request(self.buffer_id, self._owner, dtype, shape, [], self.sent,
                                                 self.nbytes))
        await self._step(self._call.done_writing())
        reply = await self._step(self._call)
        self._close()
        if reply.count != 1:
            raise BackendError("INTERNAL", f"worker {self.address} stored {reply.count} buffers of an upload of one")
        self._session.adopt(self.buffer_id, self.address)
        return self.buffer_id

    async def materialize(self) -> HostData:
        """The buffer's bytes, read back from the worker (for consumers that need them here)."""
        buffer_id = await self.finish("uint8", (self.nbytes,))
        try:
            return await self._session.get(buffer_id)
        finally:
            self._session.free([buffer_id])

    def discard(self) -> None:
        """Drops the staged bytes: the worker drops an upload whose stream is cancelled."""
        if not self._closed:
            self._close()
            self._call.cancel()
