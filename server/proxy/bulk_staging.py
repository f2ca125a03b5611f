"""A staged upload (staging.py) on a session's TCP connection to the worker (bulk.py): the host
buffer's bytes go on to the worker's transfer port as the client sends them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from .. import bulklink, wire
from .backend import BackendError
from .bulk import POOL, UPLOADING, BulkLinks, Link, broken, seen
from .host_watch import HostWatch
from .staging import Owner, Staging
from .transfer_counts import TransferCounts

CODE_NAMES = {s.value[0]: s.name for s in grpc.StatusCode}


class BulkStaging(Staging):
    """A staged upload (staging.py) on a connection: its header goes with the first bytes, each
    chunk as it comes, its spec at `finish`. Where the session has no connection to the worker,
    `fallback()` makes the gRPC staging, which then does it all. Discarding it closes the
    connection before the spec: the worker keeps nothing."""

    def __init__(self, session: Owner, links: BulkLinks, watch: HostWatch, address: str, buffer_id: int,
                 owner: str, nbytes: int, fallback: Callable[[], Staging],
                 counts: TransferCounts | None = None) -> None:
        super().__init__(session, None, address, buffer_id, owner, nbytes)
        self._counts = counts  # the upload counted on its connection (the fallback counts its own)
        self._links = links
        self._watch = watch
        self._fallback = fallback
        self._link: Link | None = None
        self._inner: Staging | None = None
        self._started = False
        self._sending: asyncio.Future[None] | None = None
        self._head = b""

    async def _start(self) -> None:
        self._started = True
        link = await self._links.take(self.address, self._watch, UPLOADING)
        if link is None:
            self._inner = self._fallback()
            return
        self._link = link
        if self._counts is not None:
            self._counts.started("upload", "tcp", self.nbytes)
        try:
            self._guard = self._watch.guard(self.address, link, UPLOADING)
        except BackendError as e:  # the host was lost already
            self._failed = e
            self._drop()
            return
        header = wire.put_buffer_request(self.buffer_id, self._owner, "", (), [], 0, self.nbytes)
        self._head = bulklink.request(bulklink.PUT, header)  # sent with the first bytes

    def _drop(self) -> None:
        self._close()
        if self._link is not None:
            self._links.drop(self.address, self._link)
            self._link = None

    async def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a pool thread; the connection's failure is the staging's (it is closed)."""
        return await self._wait(asyncio.get_running_loop().run_in_executor(POOL, fn, *args))

    async def _wait(self, done: asyncio.Future[Any]) -> Any:
        try:
            return await done
        except (OSError, ValueError) as e:
            error = broken(self._guard, UPLOADING, self.address, str(e))
            self._drop()
            raise error from None
        except asyncio.CancelledError:
            self._drop()
            raise

    async def write(self, chunk: bytes | memoryview) -> None:
        if not self._started:
            try:
                await self._start()
            except BackendError as e:
                self._failed = e
        if self._inner is not None:
            await self._inner.write(chunk)
            return
        if self._failed is not None or self._link is None:
            return
        try:
            await self._sent()
        except BackendError as e:
            self._failed = e
            return
        if self._link is None:
            return
        # sent while the client's next chunk comes: one send under way at a time
        view = memoryview(chunk).cast("B")
        parts: list[bytes | memoryview] = [self._head, view]
        self._head = b""
        self._sending = asyncio.get_running_loop().run_in_executor(POOL, self._link.send, parts)
        self._sending.add_done_callback(seen)  # a send failed after a discard is nobody's error
        self.sent += len(view)

    async def _sent(self) -> None:
        """Waits for the send under way, whose failure is the staging's (BackendError)."""
        sending, self._sending = self._sending, None
        if sending is not None:
            await self._wait(sending)

    async def finish(self, dtype: str, shape: tuple[int, ...]) -> int:
        if self._inner is not None:
            return await self._inner.finish(dtype, shape)
        if self._failed is None:
            try:
                await self._sent()
            except BackendError as e:
                self._failed = e
        if self._failed is not None:
            raise self._failed
        link = self._link
        assert link is not None and self.sent == self.nbytes and not self._closed
        spec = wire.put_buffer_request(self.buffer_id, self._owner, dtype, shape, [], self.nbytes, self.nbytes)
        # the spec's reply: the worker stores the array at once, waiting for no buffer
        answer = await self._io(link.ask, bulklink.request(bulklink.SPEC, spec))
        if answer is None:
            error = broken(self._guard, UPLOADING, self.address, "before its answer")
            self._drop()
            raise error
        self._close()
        self._link = None
        self._links.give(self.address, link)
        code, _, message = answer
        if code:
            name = CODE_NAMES.get(code, "UNKNOWN")
            raise BackendError(name, f"uploading to worker {self.address}: {message}")
        self._session.adopt(self.buffer_id, self.address)
        return self.buffer_id

    def discard(self) -> None:
        if self._inner is not None:
            self._inner.discard()
        elif not self._closed:
            self._drop()
