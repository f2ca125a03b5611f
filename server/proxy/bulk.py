"""A proxy session's bulk bytes to and from its workers on TCP connections (server/bulklink.py).

Every download's `FetchData` messages (a small array's read whole too: cluster_backend.py `get`)
and uploads of `BULK_MIN_BYTES` or more, or of at most `SMALL_PUT_BYTES`, go on connections to
the worker's transfer port (its `Stats` names it) instead of Python gRPC, whose receive copies
each byte three times: a fetched message is read straight into the `bytes` that goes on to the
client (`recv` with MSG_WAITALL), an upload's host bytes leave
straight from the client's chunks (`sendmsg` of views). The connections are blocking sockets
used from `POOL`'s threads, one request at a time each; a session keeps up to `MAX_LINKS` per
worker, idle ones for its next request, and closes them with its channels. A staged upload
(the client's host buffer sent on as it comes) is bulk_staging.py's.

`POOL` is shared by every session, so a thread is taken only to move bytes: a request's header
goes from the event loop (the socket's buffer is empty between requests), and the worker's
answer, which may come only once a buffer is computed (a fetch waits for it, an uploaded part
for its sources), is awaited on the event loop (`Link.readable`); the thread then reads the
reply and the bytes behind it, or the loop does where they are few and all there already
(`INLINE_BYTES`: a small download's). Many requests waiting on buffers not ready hold no thread. (A
whole array's upload waits for nothing: the thread that sent its bytes reads its reply.)

Not where the cluster has TLS (nor with the controller's --no-bulk-links): there they stay on
gRPC (transfer_counts.py counts which path each took). Over Python's `ssl`
(records of 16 KiB, each a call; a copy out of the read buffer) the A/B of 64 MiB transfers
showed no gain (bench/FINDINGS.md, 2026-11-27 06:15): the worker's CPU fell by a fifth, the
controller's rose a little, uploads read 0.70-0.90x.

Where no connection can be made (no port, refused, the worker not registered
yet) the request goes by gRPC as before, and the worker is not tried again for `RETRY_S`. A
connection that breaks mid-request fails that request (UNAVAILABLE naming the worker, or the
lost host: the call's guard shuts the socket down once the host is lost, host_watch.py) and is
closed: the worker drops an upload cut off. Flow control is TCP's: a download's next message is
read only when the consumer asks, so a slow client holds the worker back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from schemas.pathways.v1 import worker_pb2 as wpb

from .. import bulklink, wire
from ..threadnames import name_native_thread
from ..worker.tcplink import CONNECT_TIMEOUT_S, HELLO, guard
from .backend import BackendError
from .host_watch import Guard, HostWatch
from .transfer_counts import TransferCounts

log = logging.getLogger(__name__)

BULK_MIN_BYTES = 4 << 20  # smaller uploads stay on gRPC (one round trip less to set up), but for
SMALL_PUT_BYTES = 256 << 10  # uploads of at most this, on a connection where one is idle or can be
# made: sent from the event loop, the reply read there (a training step's batch: a gRPC `Put` cost
# the controller and the worker more; bench/FINDINGS.md, 2026-11-27 15:30)
MAX_LINKS = 8  # connections per session and worker; a request beyond them goes by gRPC
RETRY_S = 30.0  # a worker whose connection could not be made is tried again after this
POOL_THREADS = 64  # every session's: a thread is taken only to move bytes (`Link.readable`)
POOL = ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="pw-bulk", initializer=name_native_thread)
UPLOADING, DOWNLOADING = "uploading to", "downloading from"
# a download's messages read per thread hop (each hop costs both threads a wake-up); the next
# hop's read runs while the loop sends these on, so the controller holds at most twice this while
# its client is slow (8 MiB of 2 MiB messages). The first hop reads one message: the client's
# first bytes leave as soon as they came.
READ_AHEAD = 2
# a fetch's answer of at most this many bytes of data (one message), all arrived by the time it is
# readable (the worker sends it in one `sendmsg`), is read on the event loop: no thread hop each
# way, which cost a small download ~1 ms on a busy host (bench/FINDINGS.md, 2026-11-27 12:32)
INLINE_BYTES = 1 << 20


class Link:
    """One connection to a worker's transfer port (blocking: used from `POOL`'s threads)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.closed = False
        self.counted = True  # in its BulkLinks' count of open connections, until dropped
        self._waiting: tuple[asyncio.AbstractEventLoop, int, asyncio.Future[None]] | None = None  # `readable`

    def cancel(self) -> None:
        """Ends the connection, waking a thread blocked on it (a guard's, once the host is lost)."""
        self.close()

    def done(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._unwatch()  # before its descriptor goes: the waiter wakes, and then finds it closed
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                self.sock.close()

    def idle_and_open(self) -> bool:
        """Whether an idle connection is still open: nothing to read on it (an end or a reset
        would be), checked without waiting."""
        if self.closed:
            return False
        poll = select.poll()  # not select(): a controller may hold more than 1,024 descriptors
        poll.register(self.sock, select.POLLIN)
        return not poll.poll(0)

    async def request(self, *parts: bytes | memoryview) -> None:
        """Sends a request (its header, and a small upload's bytes) from the event loop where the
        socket takes it whole at once (its buffer is empty between requests), else the rest
        from a `POOL` thread."""
        views = bulklink.byte_views(parts)
        try:
            bulklink.drop_sent(views, self.sock.sendmsg(views[:64], [], socket.MSG_DONTWAIT))
        except BlockingIOError:
            pass  # nothing sent: all of it from a thread
        if views:
            await asyncio.get_running_loop().run_in_executor(POOL, self.send, views)

    async def readable(self) -> None:
        """Returns once the worker's answer can be read (or the connection's end, or its error),
        waiting on the event loop, not on a thread; at once once the connection is closed."""
        if self.closed:
            return
        loop = asyncio.get_running_loop()
        fd = self.sock.fileno()
        woken: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _wake, woken)
        self._waiting = (loop, fd, woken)
        try:
            await woken
        finally:
            self._unwatch()

    def _unwatch(self) -> None:
        """Ends a `readable` wait (on the loop's thread: the guard's `cancel`, or the wait's end)."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            loop, fd, woken = waiting
            loop.remove_reader(fd)
            _wake(woken)

    async def reply(self) -> tuple[int, int, str] | None:
        """The worker's reply, awaited on the loop (`readable`), read there once it is all here,
        else on a `POOL` thread: (code, length, message); None: the connection closed."""
        await self.readable()
        if bulklink.reply_here(self.sock):
            return bulklink.read_reply(self.sock)
        return await asyncio.get_running_loop().run_in_executor(POOL, bulklink.read_reply, self.sock)

    def ask(self, request: bytes) -> tuple[int, int, str] | None:
        """Sends a request and reads the reply, where the worker answers without waiting for a buffer."""
        self.sock.sendall(request)
        return bulklink.read_reply(self.sock)

    def put(self, parts: Sequence[bytes | memoryview]) -> tuple[int, int, str] | None:
        """Sends an upload's header request and bytes (`parts`) and reads the worker's reply."""
        bulklink.send_parts(self.sock, parts)
        return bulklink.read_reply(self.sock)

    def fetched(self, ahead: int) -> tuple[tuple[int, int, str] | None, list[bytes]]:
        """A fetch's reply (`reply`) and, where it is the bytes, its first `ahead` messages."""
        answer = bulklink.read_reply(self.sock)
        if answer is None or answer[0]:
            return answer, []
        return answer, self.read([size for _, size in bulklink.message_sizes(answer[1])][:ahead])

    def read(self, sizes: Sequence[int]) -> list[bytes]:
        """Messages of these sizes, in order; fewer when the connection closed."""
        out: list[bytes] = []
        for size in sizes:
            data = bulklink.recv_bytes(self.sock, size)
            if data is None:
                break
            out.append(data)
        return out

    def send(self, parts: Sequence[bytes | memoryview]) -> None:
        bulklink.send_parts(self.sock, parts)


def seen(done: asyncio.Future[Any]) -> None:
    """A done callback for a future whose failure nobody awaits: it is retrieved (not logged)."""
    if not done.cancelled():
        done.exception()


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


def _connect(data_address: str, secret: bytes) -> Link:
    host, _, port = data_address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        guard(sock)  # a worker whose host vanished fails the request within tcplink.DEAD_PEER_S
        sock.sendall(HELLO.pack(bulklink.SESSION_MAGIC, len(secret)) + secret)
        answer = bulklink.read_reply(sock)  # the worker's acceptance (or it closes the connection)
        if answer is None or answer[0]:
            raise OSError("the worker refused the session's connection")
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return Link(sock)


class BulkLinks:
    """A session's connections to its workers' transfer ports. `data_address(address)`: the
    worker's transfer port, as its `Stats` names it ("" where it has none)."""

    def __init__(self, secret: bytes, data_address: Callable[[str], Awaitable[str]]) -> None:
        self._secret = secret
        self._data_address = data_address
        self._ports: dict[str, str | float] = {}  # worker -> its transfer port, or when to try again
        self._idle: dict[str, list[Link]] = {}
        self._open: dict[str, int] = {}  # worker -> its connections (idle or in use)
        self._closed = False

    async def take(self, address: str, watch: HostWatch | None = None, doing: str = "") -> Link | None:
        """A connection to the worker at `address` for one request (`give` it back), or None:
        the request goes by gRPC. With `watch`, asking a new worker for its transfer port ends
        once its host is lost, raising the error naming it (`doing` it): a frozen worker's
        `Stats` would hold the request for its whole timeout."""
        idle = self._idle.get(address)
        while idle:
            link = idle.pop()
            if link.idle_and_open():
                return link
            self.drop(address, link)  # the worker closed it (it restarted, or went away)
        port = self._ports.get(address)
        if self._closed or (isinstance(port, float) and time.monotonic() < port) \
                or self._open.get(address, 0) >= MAX_LINKS:
            return None
        self._open[address] = self._open.get(address, 0) + 1
        loop = asyncio.get_running_loop()
        try:
            known = isinstance(port, str)
            if not isinstance(port, str):
                port = self._ports[address] = await self._port(address, watch, doing)
            try:
                if not port:
                    raise OSError("it has no TCP transfer port")
                link = await loop.run_in_executor(POOL, _connect, port, self._secret)
            except OSError:
                if not known:
                    raise
                # the port it had: a worker restarted at this address has another
                port = self._ports[address] = await self._port(address, watch, doing)
                link = await loop.run_in_executor(POOL, _connect, port, self._secret)
        except BaseException as e:
            self._open[address] -= 1
            if not isinstance(e, (OSError, ValueError, grpc.RpcError)):
                raise  # cancelled
            log.info("proxy: no bulk connection to worker %s (%s): gRPC carries its transfers", address, e)
            self._ports[address] = time.monotonic() + RETRY_S
            return None
        if self._closed:
            self.drop(address, link)
            return None
        return link

    async def _port(self, address: str, watch: HostWatch | None, doing: str) -> str:
        """The worker's transfer port (`data_address`), asked until its host is lost (`take`)."""
        if watch is None:
            return await self._data_address(address)
        return str(await watch.unless_lost(address, asyncio.ensure_future(self._data_address(address)), doing))

    def give(self, address: str, link: Link) -> None:
        """A connection back after a request that ended well."""
        if self._closed or link.closed:
            self.drop(address, link)
        else:
            self._idle.setdefault(address, []).append(link)

    def drop(self, address: str, link: Link) -> None:
        """A connection closed (broken, or left mid-request)."""
        link.close()
        if link.counted:
            link.counted = False
            self._open[address] = self._open.get(address, 1) - 1

    def close(self) -> None:
        self._closed = True
        for address, links in self._idle.items():
            for link in links:
                self.drop(address, link)
        self._idle.clear()


def broken(guard: Guard | None, doing: str, address: str, what: str) -> BackendError:
    """The error of a request whose connection broke: the lost host's, else UNAVAILABLE."""
    lost = guard.error() if guard is not None else None
    return lost or BackendError("UNAVAILABLE", f"{doing} worker {address} failed: the connection broke ({what})")


class _Lease:
    """A connection lent to one request, watched by `guard` (its host lost: the connection is shut
    down); given back to the pool if `keep` is set once the request ends, else closed."""

    def __init__(self) -> None:
        self.guard: Guard | None = None
        self.keep = False  # set where the connection is left between two requests


@contextlib.contextmanager
def _lent(links: BulkLinks, address: str, link: Link, watch: HostWatch | None, doing: str) -> Iterator[_Lease]:
    """The request's use of `link`: a socket error is its UNAVAILABLE (or its lost host's error)."""
    lease = _Lease()
    try:
        lease.guard = watch.guard(address, link, doing) if watch is not None else None
        yield lease
    except (OSError, ValueError) as e:
        raise broken(lease.guard, doing, address, str(e)) from None
    finally:
        if lease.guard is not None:
            lease.guard.stop()
        if lease.keep:
            links.give(address, link)
        else:
            links.drop(address, link)


async def data_messages(links: BulkLinks | None, request: wpb.FetchRequest, address: str, watch: HostWatch | None,
                        fallback: Callable[[], AsyncGenerator[bytes, None]],
                        counts: TransferCounts | None = None) -> AsyncGenerator[bytes, None]:
    """fetching.data_messages on a connection (`fallback()`'s, by gRPC, where there is none):
    the serialized `FetchData` messages of the fetch, each read when the consumer asks; the
    worker's FAILED_PRECONDITION keeps its code and cause, its other refusals are UNAVAILABLE
    naming the worker. `counts`: the download counted on its path."""
    if watch is not None:
        watch.check(address, DOWNLOADING)  # a lost host's, at once: not after a connection's timeout
    link = await links.take(address, watch, DOWNLOADING) if links is not None else None
    if link is None or links is None:
        if counts is not None:
            counts.started("download", "grpc")
        async with contextlib.aclosing(fallback()) as by_grpc:
            async for raw in by_grpc:
                if counts is not None:
                    counts.moved("download", "grpc", wire.data_length(raw))
                yield raw
        return
    if counts is not None:
        counts.started("download", "tcp")
    loop = asyncio.get_running_loop()
    with _lent(links, address, link, watch, DOWNLOADING) as lease:
        await link.request(bulklink.request(bulklink.FETCH, request.SerializeToString()))
        await link.readable()  # the worker answers once the buffer is computed: no thread held meanwhile
        if bulklink.fetch_here(link.sock, INLINE_BYTES):  # small, and all here: read on the loop
            answer, batch = link.fetched(1)
        else:  # the answer and its first message, on a thread
            answer, batch = await loop.run_in_executor(POOL, link.fetched, 1)
        if answer is None:
            raise broken(lease.guard, DOWNLOADING, address, "before its answer")
        code, nbytes, message = answer
        if code:
            lease.keep = True
            if code == grpc.StatusCode.FAILED_PRECONDITION.value[0]:
                raise BackendError("FAILED_PRECONDITION", message)
            raise BackendError("UNAVAILABLE", f"downloading from worker {address} failed: {message}")
        if counts is not None:
            counts.moved("download", "tcp", nbytes)
        got = 0
        sizes = [size for _, size in bulklink.message_sizes(nbytes)]
        # the first message came with the answer; each later hop's read runs while the loop sends
        # the last one on
        hops = [sizes[k : k + READ_AHEAD] for k in range(1, len(sizes), READ_AHEAD)]
        reading = (loop.run_in_executor(POOL, link.read, hops[0])
                   if hops and len(batch) == len(sizes[:1]) else None)
        try:
            for data in batch:
                got += len(data)
                yield data
            if len(batch) < len(sizes[:1]):
                raise broken(lease.guard, DOWNLOADING, address, f"after {got} of {sum(sizes)} bytes")
            for k, want in enumerate(hops):
                assert reading is not None
                batch = await reading
                if len(batch) == len(want) and k + 1 < len(hops):
                    reading = loop.run_in_executor(POOL, link.read, hops[k + 1])
                for data in batch:
                    got += len(data)
                    yield data
                if len(batch) < len(want):
                    raise broken(lease.guard, DOWNLOADING, address, f"after {got} of {sum(sizes)} bytes")
        finally:  # a consumer gone mid-download: the connection is closed under the read ahead,
            if reading is not None:  # whose failure nobody awaits
                reading.add_done_callback(seen)
        lease.keep = True


async def put_arrays(links: BulkLinks, link: Link, address: str, watch: HostWatch | None, owner: str,
                     ids: Sequence[int], arrays: Sequence[tuple[str, tuple[int, ...], Any]], part_of: bytes) -> None:
    """uploading.py `_upload_to` on `link`: each array (dtype, shape, HostData) under its id; as
    `PutBuffers`, one refused does not stop the others, and the first refusal is raised at the
    end (UNAVAILABLE naming the worker and its reason)."""
    loop = asyncio.get_running_loop()
    first: str | None = None
    with _lent(links, address, link, watch, UPLOADING) as lease:
        for buffer_id, (dtype, shape, data) in zip(ids, arrays, strict=True):
            header = wire.put_buffer_request(buffer_id, owner, dtype, shape, [], 0, len(data), part_of)
            parts = [bulklink.request(bulklink.PUT, header), *data.parts]
            if len(data) <= SMALL_PUT_BYTES:  # sent from the loop, the reply awaited there: no thread hop
                await link.request(*parts)
                answer = await link.reply()
            elif part_of:  # a part of a global array may wait for its sources: awaited on the loop
                await loop.run_in_executor(POOL, link.send, parts)
                answer = await link.reply()
            else:  # stored at once, waiting for nothing: the reply read by the thread that sent the bytes
                answer = await loop.run_in_executor(POOL, link.put, parts)
            if answer is None:
                raise broken(lease.guard, UPLOADING, address, f"in buffer {buffer_id:#x}")
            if answer[0] and first is None:
                first = answer[2]
        lease.keep = True
    if first is not None:
        raise BackendError("UNAVAILABLE", f"uploading to worker {address} failed: {first}")
