"""Cross-host transfers on one plain TCP connection per pair of workers.

Measured on two network-namespace hosts (bench/FINDINGS.md, "multihost"), a 64 MiB array over
the worker's gRPC stream moved at ~0.2x of raw TCP on the same link: chunking into protobuf
messages, HTTP/2 framing and joining the chunks again copy the bytes about eight times. Here the
bytes leave straight from the array's memory (`sendall` of a memoryview) and land straight in the
receiver's preallocated array (`recv_into`): one kernel copy each way, as raw TCP.

Framing: after a hello (magic, the cluster token), each array is a frame: a fixed prefix (magic,
length of the header), a `TransferChunk` protobuf header without data (buffer id, dtype, shape,
part_start/global_shape for a part of a multi-host slice's array, or an error), then exactly
dtype.itemsize * prod(shape) raw C-order bytes. A connection carries one peer's arrays in order.

The receiver listens on the worker's own host address, on a port of its own, which peers learn
from the worker's `Stats` (`data_address`). A peer that presents a wrong token is dropped
without a reply. With TLS (the worker's `--tls-cert`, pwctl/tls.py) the connection is TLS from
its first byte, checked as the gRPC links are: the hello and the arrays never cross in clear. Where a connection
cannot be made or breaks, the sender falls back to the gRPC stream (transfer.py).

The same port takes the controller's connections for a proxy session's bulk bytes: their hello
has its own magic (server/bulklink.py) and is handed, connection and secret, to `session`
(server/worker/bulk_service.py), which checks the session credential and serves it.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from pwctl.tls import TlsConfig
from schemas.arrays import aligned_empty, byte_view, resolve_dtype
from schemas.pathways.v1 import worker_pb2 as wpb

from ..bulklink import SESSION_MAGIC
from ..threadnames import name_native_thread

log = logging.getLogger(__name__)

__all__ = ["TcpPeer", "TcpReceiver"]

HELLO = struct.Struct("!4sH")  # magic, token length; the token follows
FRAME = struct.Struct("!4sI")  # magic, header length; the header and the payload follow
HELLO_MAGIC = b"PWH1"
TLS_HANDSHAKE = b"\x16"  # the first byte of a TLS ClientHello
FRAME_MAGIC = b"PWF1"
MAX_HEADER = 64 * 1024
MAX_PAYLOAD = 1 << 36  # 64 GiB: a larger frame is malformed
CONNECT_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 120.0

Deliver = Callable[[wpb.TransferChunk, "np.ndarray | None"], object]  # what it returns is not read
# a proxy session's connection (its hello's secret, the peer's address): served on its thread
SessionServe = Callable[[socket.socket, bytes, object], None]


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    """Fills `view` from the connection; False when the peer closed it first."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _read(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    return bytes(buf) if _recv_exact(conn, memoryview(buf)) else None


class TcpReceiver:
    """Accepts peers on `host`; hands each array (or failure notice) to `deliver(header, array)`
    from the connection's own thread, in the order the peer sent them."""

    def __init__(self, host: str, token: str | None, deliver: Deliver,
                 check: Callable[[bytes], bool] | None = None, tls: TlsConfig | None = None,
                 session: SessionServe | None = None) -> None:
        self.host = host
        self._session = session
        self._tls = tls
        self._token = (token or "").encode()
        # what the hello must carry: `check(secret)` when given (the worker's peer credential,
        # server/worker/auth.py: a tenant's cluster token is not enough), else the token
        self._check = check
        self._deliver = deliver
        self._sock: socket.socket | None = None
        self.address = ""

    def start(self) -> str:
        """Listens; returns HOST:PORT, or "" where it cannot (peers then use gRPC)."""
        try:
            sock = socket.create_server((self.host, 0), backlog=64)
        except OSError as e:
            log.info("no TCP transfer port on %s (%s): peers use the gRPC stream", self.host, e)
            return ""
        self._sock = sock
        self.address = f"{self.host}:{sock.getsockname()[1]}"
        threading.Thread(target=self._accept_loop, args=(sock,), name="pw-tcp-accept", daemon=True).start()
        return self.address

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()

    def _accept_loop(self, sock: socket.socket) -> None:
        name_native_thread()
        while True:
            try:
                conn, peer = sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, peer), name="pw-tcp-recv", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        name_native_thread()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # the handshake and the hello within CONNECT_TIMEOUT_S: a peer that connects and says
            # nothing does not hold this thread (a peer sends its hello at once); then no timeout
            conn.settimeout(CONNECT_TIMEOUT_S)
            if self._tls is not None:
                conn = self._tls.ssl_server_context.wrap_socket(conn, server_side=True)
            secret = self._hello(conn)
            if isinstance(secret, bytes):  # a proxy session's bulk connection (server/bulklink.py)
                conn.settimeout(None)
                assert self._session is not None
                self._session(conn, secret, peer)
                return
            if not secret:
                log.warning("TCP transfer connection from %s refused: wrong token", peer)
                return
            conn.settimeout(None)
            while self._frame(conn, peer):
                pass
        except (OSError, ValueError) as e:  # ssl.SSLError too: a failed handshake, in one line
            log.warning("TCP transfer connection from %s ended: %s", peer, e)
        finally:
            with contextlib.suppress(OSError):
                conn.close()

    def _hello(self, conn: socket.socket) -> bool | bytes:
        """Whether a peer's hello is right; a proxy session's hello: its secret (bytes)."""
        head = _read(conn, HELLO.size)
        if head is None:
            return False
        magic, n = HELLO.unpack(head)
        if magic == SESSION_MAGIC and self._session is not None:
            secret = _read(conn, n) if n else b""
            return secret or False
        if magic != HELLO_MAGIC:
            if head[:1] == TLS_HANDSHAKE and self._tls is None:
                raise ValueError("the peer speaks TLS and this worker does not (no --tls-cert)")
            return False
        token = _read(conn, n) if n else b""
        if token is None:
            return False
        return self._check(token) if self._check is not None else hmac.compare_digest(token, self._token)

    def _frame(self, conn: socket.socket, peer: object) -> bool:
        """Reads one frame and delivers it; False when the peer closed the connection."""
        prefix = _read(conn, FRAME.size)
        if prefix is None:
            return False
        magic, n = FRAME.unpack(prefix)
        if magic != FRAME_MAGIC or n > MAX_HEADER:
            raise ValueError("malformed frame")
        raw = _read(conn, n)
        if raw is None:
            return False
        header = wpb.TransferChunk.FromString(raw)
        if header.error:
            self._deliver(header, None)
            return True
        dtype = resolve_dtype(header.array.dtype)
        shape = tuple(int(d) for d in header.array.shape)
        if any(d < 0 for d in shape) or dtype.itemsize * math.prod(shape) > MAX_PAYLOAD:
            raise ValueError(f"malformed array {header.array.dtype}{list(shape)}")
        arr = aligned_empty(shape, dtype)  # XLA on CPU then takes it without a copy (schemas/arrays.py)
        if arr.nbytes and not _recv_exact(conn, byte_view(arr)):
            # the sender died or closed mid-array: nothing is delivered; the reader's run fails
            # when the controller learns the sender is gone
            log.warning("TCP transfer connection from %s closed in the middle of buffer %#x (%d bytes)", peer,
                        header.buffer_id, arr.nbytes)
            return False
        self._deliver(header, arr)
        return True


class TcpPeer:
    """The sending end of one connection; arrays go out in order, one at a time."""

    def __init__(self, data_address: str, token: str | None, tls: TlsConfig | None = None) -> None:
        host, _, port = data_address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            try:
                sock = tls.wrap_client(sock, host)
            except OSError:
                sock.close()
                raise
        sock.settimeout(SEND_TIMEOUT_S)
        secret = (token or "").encode()
        sock.sendall(HELLO.pack(HELLO_MAGIC, len(secret)) + secret)
        self._sock = sock
        self._lock = threading.Lock()
        self.broken = False
        self.opened = time.monotonic()

    def send(self, header: wpb.TransferChunk, arr: np.ndarray | None) -> None:
        """Sends one array (C-contiguous) under `header` (dtype and shape filled here), or a
        failure notice (arr None, header.error set). Raises OSError when the connection broke."""
        raw = header.SerializeToString()
        with self._lock:
            try:
                self._sock.sendall(FRAME.pack(FRAME_MAGIC, len(raw)) + raw)
                if arr is not None and arr.nbytes:
                    self._sock.sendall(byte_view(arr))
            except OSError:
                self.broken = True
                raise

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
