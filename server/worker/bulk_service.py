"""A proxy session's bulk bytes from and to the controller on a TCP connection (server/bulklink.py).

The worker's transfer port (tcplink.py) hands over a connection whose hello is a session's;
it is served on its own thread, one request at a time. The checks are the gRPC handlers'
(servicer.py `Fetch`, upload_service.py `PutBuffers`): the hello's cluster token and session
credential (auth.py), then per request the caller's ids and owner, its bounds on waits, the
upload's spec. An upload's checks and store run on the worker's event loop; a fetch's checks and
its read of a buffer already settled run on the connection's thread (the store's lock), only its
wait for one not settled on the loop. The bytes move on the connection's thread: a fetch's
straight from the array's memory (`sendmsg` of views), an upload's straight into its
preallocated, aligned array (`recv_into`).

An upload cut off (the connection closed before its last byte, or before a staged upload's
spec) is dropped as a cancelled `PutBuffers` is: its buffer fails for what already waits on it,
else nothing is kept. A refused upload's remaining bytes are read and dropped, so the
connection stays usable and the controller reads the refusal.

Reads are bounded as tcplink.py's frames (the same DEAD_PEER_S): a connection may idle between
requests for as long as it likes (the wait for a staged upload's spec too: it comes with the
client's MakeArray), but a request's head must be whole within DEAD_PEER_S of its first byte and
an upload's bytes may pause no longer than that. A client that stalls midway (a frozen
controller on a live host, or a caller holding the session's credential that sends half a
request) loses the connection, and an upload's buffer fails as cut off, saying why; before,
the connection's thread, and an upload's preallocated array and its buffer's readers, waited for
ever.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import ssl

import grpc
import numpy as np

from schemas.arrays import aligned_empty, byte_view, to_numpy
from schemas.pathways.v1 import worker_pb2 as wpb

from .. import bulklink, wire
from ..credentials import Caller, check_session
from ..threadnames import name_native_thread
from . import tcplink
from .servicer import WorkerServicer, fetched_range
from .servicer import _bounded as bounded_wait
from .uploads import check_spec

log = logging.getLogger(__name__)

DRAIN_BYTES = 1 << 20


def _code(status: grpc.StatusCode) -> int:
    return int(status.value[0])


class BulkSessions:
    """Serves proxy sessions' bulk connections for `servicer` (its store and checks), whose event
    loop is `loop`; `token`: the cluster token the hello must carry (None: none)."""

    def __init__(self, servicer: WorkerServicer, loop: asyncio.AbstractEventLoop, token: str | None) -> None:
        self._servicer = servicer
        self._loop = loop
        self._token = token or ""

    def _caller(self, secret: bytes) -> Caller | None:
        token, credential = bulklink.split_secret(secret)
        key = self._servicer.auth.key
        if key is None or not credential or not hmac.compare_digest(token.encode(), self._token.encode()):
            return None
        return check_session(key, credential)

    def serve(self, conn: socket.socket, secret: bytes, peer: object) -> None:
        """Serves one connection until it closes (on its own thread, tcplink.py)."""
        name_native_thread()
        caller = self._caller(secret)
        if caller is None:
            log.warning("bulk connection from %s refused: wrong token or session credential", peer)
            return
        conn.sendall(bulklink.reply(0))  # accepted: the controller sends its requests
        log.info("bulk connection from %s for %s%s", peer, caller.owner,
                 " (TLS)" if isinstance(conn, ssl.SSLSocket) else "")
        while True:
            got = _read_request(conn)
            if got is None:
                return
            kind, header = got
            if kind == bulklink.FETCH:
                self._fetch(conn, caller, header)
            elif kind == bulklink.PUT:
                if not self._put(conn, caller, header):
                    return
            else:
                raise ValueError("an upload's spec without its upload")

    def _on_loop(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    # ---- fetch ----
    def _fetch(self, conn: socket.socket, caller: Caller, header: bytes) -> None:
        request = wpb.FetchRequest.FromString(header)
        got = self._fetched(caller, request)
        if isinstance(got, tuple):
            conn.sendall(bulklink.reply(got[0], message=got[1]))
            return
        parts: list[bytes | memoryview] = [bulklink.reply(0, len(got))]
        for off in range(0, len(got), bulklink.DATA_MESSAGE):
            piece = got[off : off + bulklink.DATA_MESSAGE]
            parts += [wire.len_field(1, len(piece)), piece]
        bulklink.send_parts(conn, parts)

    def _fetched(self, caller: Caller, request: wpb.FetchRequest) -> memoryview | tuple[int, str]:
        """The bytes a fetch asks for (a view of the array), or its refusal (code, message): the
        checks and the wait of servicer.py `Fetch`. On the connection's thread: the checks read
        the store under its lock, and a buffer settled already (a proxy download asks only once
        it is) is read here, with no hop to the event loop and its executor and back; only a wait
        for one not settled is the loop's (the owner's wait slots are counted there). The view
        may wait for the buffer's computation: this connection's thread only, as the executor's
        did."""
        s = self._servicer
        if request.parts or not request.data_messages:
            return _code(grpc.StatusCode.INVALID_ARGUMENT), "a bulk fetch is of data messages, not by parts"
        bid = request.buffer_id
        refused = s._refusal(caller, [bid], request.timeout_s)
        if refused is not None:
            return _code(refused[0]), refused[1]
        timeout = bounded_wait(request.timeout_s)
        if not s.store.settled(bid):
            waited: tuple[grpc.StatusCode, str] | str | None = self._on_loop(  # type: ignore[assignment]
                s.settle_for(caller, bid, timeout))
            if isinstance(waited, tuple):
                return _code(waited[0]), waited[1]
            if waited is not None:
                return _code(grpc.StatusCode.FAILED_PRECONDITION), waited
        elif s._foreign(caller, bid):
            return _code(grpc.StatusCode.NOT_FOUND), f"no buffer {bid:#x} on this worker"
        try:
            arr = to_numpy(s.store.wait(bid, 0.0))  # settled: one gone since fails as gone
        except Exception as e:
            failure: str = self._on_loop(self._failure(e))  # type: ignore[assignment]
            return _code(grpc.StatusCode.FAILED_PRECONDITION), failure
        data = fetched_range(byte_view(arr), request)
        return (_code(grpc.StatusCode.OUT_OF_RANGE), data) if isinstance(data, str) else data

    async def _failure(self, e: Exception) -> str:
        return self._servicer._fetch_failure(e)  # on the loop: it may read the collective group's state

    # ---- put ----
    def _put(self, conn: socket.socket, caller: Caller, header: bytes) -> bool:
        """One upload; False when the connection closed in its middle (it was cut off)."""
        try:
            req = wire.put_buffer(header)
        except wire.WireError as e:
            raise ValueError(f"undecodable upload header: {e}") from None
        total, bid = req.total_bytes, req.buffer_id
        if req.offset or len(req.array.data) or total <= 0:
            raise ValueError("a bulk upload's header carries its size, not its bytes")
        if not caller.owns_id(bid):
            log.warning("upload of buffer %#x by %s refused: not its id", bid, caller.owner)
            return self._refused(conn, total, _code(grpc.StatusCode.PERMISSION_DENIED),
                                 f"buffer id {bid:#x} is not one of this session's ids")
        spec: tuple[np.dtype, int] | None = None
        try:
            spec = check_spec(req.array.dtype, req.array.shape) if req.array.dtype else None
            if spec is not None and spec[1] != total:
                raise ValueError(f"{total} bytes announced for {req.array.dtype}{list(req.array.shape)}, "
                                 f"expected {spec[1]}")
            out = aligned_empty((total,), np.uint8)  # XLA on CPU adopts it without a copy (schemas/arrays.py)
        except (ValueError, MemoryError) as e:
            return self._refused(conn, total, *self._refuse(req, caller, e, held=spec is not None))
        cut = f"the upload of buffer {bid:#x} was cut off before its last byte"
        try:
            whole = bulklink.recv_exact(conn, byte_view(out))
        except OSError as e:  # a stall (tcplink's progress timeout) or a broken connection
            self._cut(caller, bid, f"{cut}: {tcplink.why(e)}")
            raise
        if not whole:
            self._cut(caller, bid, cut)
            return False
        if spec is None:  # a staged upload: its spec follows (whenever the client's MakeArray comes)
            unspecified = f"the upload of buffer {bid:#x} ended without its dtype and shape"
            try:
                got = _read_request(conn)
            except (OSError, ValueError) as e:
                self._cut(caller, bid, f"{unspecified}: {tcplink.why(e) if isinstance(e, OSError) else e}")
                raise
            if got is None:  # the controller dropped it unused (staging.py `discard`)
                self._cut(caller, bid, unspecified)
                return False
            kind, raw = got
            if kind != bulklink.SPEC:
                raise ValueError("an upload's bytes without its spec")
            try:
                last = wire.put_buffer(raw)
                spec = check_spec(last.array.dtype, last.array.shape)
                if spec[1] != total:
                    raise ValueError(f"a {last.array.dtype}{list(last.array.shape)} array ({spec[1]} bytes) "
                                     f"from {total} bytes")
            except (ValueError, wire.WireError) as e:
                code, message = self._refuse(req, caller, ValueError(str(e)), held=False)
                conn.sendall(bulklink.reply(code, message=message))
                return True
            arr = out.view(spec[0]).reshape(tuple(last.array.shape))
        else:
            arr = out.view(spec[0]).reshape(tuple(req.array.shape))
        stored: tuple[int, str] = self._on_loop(self._store(caller, req, arr))  # type: ignore[assignment]
        conn.sendall(bulklink.reply(stored[0], message=stored[1]))
        return True

    def _refused(self, conn: socket.socket, total: int, code: int, message: str) -> bool:
        """Reads and drops a refused upload's bytes, then answers the refusal."""
        scratch = memoryview(bytearray(min(total, DRAIN_BYTES)))
        left = total
        while left:
            n = min(left, len(scratch))
            if not bulklink.recv_exact(conn, scratch[:n]):
                return False
            left -= n
        conn.sendall(bulklink.reply(code, message=message))
        return True

    def _refuse(self, req: wire.PutBuffer, caller: Caller, e: ValueError | MemoryError,
                held: bool) -> tuple[int, str]:
        """upload_service.py `_refuse`, on the loop: the buffer fails with the reason."""
        async def refuse() -> tuple[int, str]:
            status, message = self._servicer._refuse(req, caller, e, held=held)
            return _code(status), message

        return self._on_loop(refuse())  # type: ignore[return-value]

    def _cut(self, caller: Caller, bid: int, why: str) -> None:
        """An upload cut off: as a cancelled `PutBuffers`'s (upload_service.py `_uploads`)."""
        store = self._servicer.store
        self._loop.call_soon_threadsafe(lambda: store.refuse(bid, caller.owner, why, held=False))

    async def _store(self, caller: Caller, req: wire.PutBuffer, arr: np.ndarray) -> tuple[int, str]:
        """Stores an uploaded array as `PutBuffers` does (a part of a global array: parts.py)."""
        s = self._servicer
        s.upload_messages += 1
        try:
            value, nbytes = await s._upload_value(arr, req.part_of, caller)
        except ValueError as e:
            status, message = s._refuse(req, caller, e, held=True)
            return _code(status), message
        if not s.store.put(req.buffer_id, value, nbytes, owner=caller.owner, client_ref=True, same_owner=True,
                           again=req.again):
            return _code(grpc.StatusCode.NOT_FOUND), f"no buffer {req.buffer_id:#x} on this worker"
        return 0, ""


def _read_request(conn: socket.socket) -> tuple[bytes, bytes] | None:
    """(kind, header) of the next request, whenever it comes; once its first byte came, whole
    within tcplink.DEAD_PEER_S (tcplink._Late past it). None when the connection closed;
    ValueError when malformed."""
    then = tcplink.DEAD_PEER_S if isinstance(conn, ssl.SSLSocket) else None  # its socket timeout
    got = tcplink.next_prefix(conn, bulklink.REQUEST.size, then, "a request's head")
    if got is None:
        return None
    prefix, deadline = got
    kind, n = bulklink.REQUEST.unpack(prefix)
    if kind not in (bulklink.FETCH, bulklink.PUT, bulklink.SPEC) or n > bulklink.MAX_HEADER:
        raise ValueError("malformed request")
    header = tcplink.head_rest(conn, n, deadline, then, "a request's head")
    return None if header is None else (kind, header)
