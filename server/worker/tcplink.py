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

A peer whose host vanishes (power lost, a network cut: no FIN, no RST reaches this end) is found
within DEAD_PEER_S on both ends, set up once per connection, nothing per frame:
- TCP keepalive (probes after DEAD_PEER_S/2 of silence, every DEAD_PEER_S/6) with TCP_USER_TIMEOUT
  DEAD_PEER_S: the kernel resets a connection whose peer stopped answering, idle or not. Between
  two live hosts the probes are answered, so a connection may stay idle between transfers for as
  long as it likes. On the sending end TCP_USER_TIMEOUT also fails a `sendall` whose bytes stay
  unacknowledged (or whose receiver stopped reading, a zero window) for DEAD_PEER_S, instead of
  SEND_TIMEOUT_S or the kernel's ~15 minutes of retransmissions; the sender then falls back.
- A progress timeout on the receiver: no byte for DEAD_PEER_S in the middle of a frame's array
  drops the frame and the connection (the reader's run fails as when a sender dies), which also
  covers a sender process frozen on a live host (its kernel answers the keepalive). Plain
  connections use the kernel's SO_RCVTIMEO (a Python socket timeout would poll before every recv:
  40 recv calls per 64 MiB instead of 21, ~10% slower on loopback); TLS ones the socket timeout,
  as the ssl module retries a read that SO_RCVTIMEO interrupted. Before a frame's first byte the
  timeout only wakes the thread, which waits on. A frame's prefix and header have one deadline,
  DEAD_PEER_S after the frame's first byte, not one per read: a peer that stalls partway through
  a header, or sends it a byte now and then, is dropped within DEAD_PEER_S (the hello likewise
  within CONNECT_TIMEOUT_S of the connection). The array's bytes keep the progress timeout: a
  large array on a slow link may take longer than DEAD_PEER_S as a whole.
DEAD_PEER_S is 30 s: a live sender writes a frame straight from memory and never pauses for
seconds, and the controller finds a silent host within its heartbeat timeout (5 s by default,
at most ~15 s in a large cluster), so by then
the reader's run has failed anyway; 30 s bounds how long a thread and a frame's buffer outlive it.
PATHWAYS_TCP_DEAD_PEER_S (seconds, >= 1) sets it (the tests use a few seconds).

The same port takes the controller's connections for a proxy session's bulk bytes: their hello
has its own magic (server/bulklink.py) and is handed, connection and secret, to `session`
(server/worker/bulk_service.py), which checks the session credential and serves it. Its reads
are bounded as a frame's are (`next_prefix`, `head_rest`, the progress timeout): none while it
idles between requests (a session may idle for hours), a request's head whole within DEAD_PEER_S
of its first byte, an upload's bytes no pause of DEAD_PEER_S.
"""

from __future__ import annotations

import contextlib
import errno
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

from ..bulklink import SESSION_MAGIC, recv_bytes, recv_exact
from ..envsetting import env_number
from ..threadnames import name_native_thread

log = logging.getLogger(__name__)

__all__ = ["TcpPeer", "TcpReceiver", "guard", "head_rest", "next_prefix", "progress_timeout", "why"]

HELLO = struct.Struct("!4sH")  # magic, token length; the token follows
FRAME = struct.Struct("!4sI")  # magic, header length; the header and the payload follow
HELLO_MAGIC = b"PWH1"
TLS_HANDSHAKE = b"\x16"  # the first byte of a TLS ClientHello
FRAME_MAGIC = b"PWF1"
MAX_HEADER = 64 * 1024
MAX_PAYLOAD = 1 << 36  # 64 GiB: a larger frame is malformed
CONNECT_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 120.0


# a peer silent this long is gone (module docstring)
DEAD_PEER_S = env_number("PATHWAYS_TCP_DEAD_PEER_S", "30", float, 1, math.inf, "a number of seconds, at least 1")
KEEPCNT = 3  # probes unanswered, where TCP_USER_TIMEOUT is not there to decide

Deliver = Callable[[wpb.TransferChunk, "np.ndarray | None"], object]  # what it returns is not read
# a proxy session's connection (its hello's secret, the peer's address): served on its thread
SessionServe = Callable[[socket.socket, bytes, object], None]


def _stalled(e: OSError) -> bool:
    """The progress timeout (no byte for DEAD_PEER_S: SO_RCVTIMEO's EAGAIN, or the socket timeout
    of a TLS connection), not the kernel's ETIMEDOUT of a peer that stopped answering."""
    return isinstance(e, BlockingIOError) or (isinstance(e, TimeoutError) and e.errno != errno.ETIMEDOUT)


def why(e: OSError) -> str:
    """A read's failure, in words (a timeout's says which and how long)."""
    if isinstance(e, _Late):
        return f"{e} ({DEAD_PEER_S:g} s after its first byte)"
    if _stalled(e):
        return f"no bytes for {DEAD_PEER_S:g} s"
    if e.errno == errno.ETIMEDOUT:
        return f"the peer stopped answering for {DEAD_PEER_S:g} s"
    return str(e)


class _Late(TimeoutError):
    """What was read under a deadline (`_fill`) was not all here by it."""


def _fill(conn: socket.socket, view: memoryview, deadline: float, what: str, then: float | None) -> bool:
    """Fills `view` by `deadline` (time.monotonic()): each read waits at most what is left of it
    (a socket timeout), so a peer that sends a few bytes now and then cannot stretch it; False
    when the peer closed first; `_Late` ("`what` not whole ...") past it. The connection's socket
    timeout is `then` again afterwards (None on a plain framing one: its SO_RCVTIMEO stays)."""
    got = 0
    try:
        while got < len(view):
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Late(f"timed out: {what} not whole in time")
            conn.settimeout(max(left, 1e-3))
            try:
                n = conn.recv_into(view[got:])
            except OSError as e:
                if _stalled(e):
                    continue  # the deadline passed: said above
                raise
            if n == 0:
                return False
            got += n
    finally:
        conn.settimeout(then)
    return True


def next_prefix(conn: socket.socket, size: int, then: float | None,
                what: str = "a frame's head") -> tuple[bytes, float | None] | None:
    """The next frame's prefix (`size` bytes), however long the peer stays idle before it (a connection waits
    between transfers; keepalive ends it if the peer's host vanishes), and the frame's deadline
    for its header: DEAD_PEER_S after its first byte. The deadline is None where the prefix came
    whole in its first read (the common case): the connection's read timeout, DEAD_PEER_S, then
    starts within microseconds of that first byte and stands for it (`head_rest`). None when the
    peer closed. `then`: the connection's socket timeout (`_fill`); `what`: the frame's head, in
    the error past the deadline."""
    buf = bytearray(size)
    while True:
        try:
            n = conn.recv_into(buf)
        except OSError as e:
            if _stalled(e):
                continue
            raise
        break
    if n == 0:
        return None
    if n == len(buf):
        return bytes(buf), None
    deadline = time.monotonic() + DEAD_PEER_S
    if not _fill(conn, memoryview(buf)[n:], deadline, what, then):
        return None
    return bytes(buf), deadline


def head_rest(conn: socket.socket, n: int, deadline: float | None, then: float | None,
              what: str = "a frame's head") -> bytes | None:
    """A frame's header of `n` bytes, whole by the frame's `deadline` (`next_prefix`); None when
    the peer closed first. A plain connection reads it in one MSG_WAITALL call where the deadline
    is the read timeout just started: the kernel bounds that call's waits together, by
    SO_RCVTIMEO; what a cut-short call left, and a TLS connection, read under the deadline
    (bulklink.recv_bytes, with `_fill` for the deadline)."""
    fresh = deadline is None
    end = time.monotonic() + DEAD_PEER_S if deadline is None else deadline
    return recv_bytes(conn, n, lambda c, view: _fill(c, view, end, what, then), waitall=fresh)


def _hello_bytes(conn: socket.socket, n: int, deadline: float) -> bytes | None:
    """`n` bytes of a hello, here by `deadline` (CONNECT_TIMEOUT_S after the connection came);
    None when the peer closed first."""
    buf = bytearray(n)
    return bytes(buf) if _fill(conn, memoryview(buf), deadline, "the hello", CONNECT_TIMEOUT_S) else None


def guard(sock: socket.socket) -> None:
    """Keepalive and TCP_USER_TIMEOUT on a connection (either end): a peer whose host vanished
    is found within DEAD_PEER_S (module docstring). Options this platform lacks are left out."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", DEAD_PEER_S / 2), ("TCP_KEEPINTVL", DEAD_PEER_S / 6),
                        ("TCP_KEEPCNT", KEEPCNT), ("TCP_USER_TIMEOUT", DEAD_PEER_S * 1000)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, max(1, int(value)))


def progress_timeout(conn: socket.socket, tls: bool) -> None:
    """No byte for DEAD_PEER_S fails a read: the kernel's SO_RCVTIMEO on a plain connection
    (nothing per read), the socket timeout on a TLS one (module docstring)."""
    if tls:
        conn.settimeout(DEAD_PEER_S)
        return
    conn.settimeout(None)
    sec = int(DEAD_PEER_S)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, int((DEAD_PEER_S - sec) * 1e6)))


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
        framing = False  # past the hello: timeouts are the progress timeout's
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            guard(conn)
            # the hello whole within CONNECT_TIMEOUT_S of the connection (one deadline, as a frame's
            # head: a peer that trickles it cannot stretch it), each of the TLS handshake's reads
            # within it: a peer that connects and says nothing does not hold this thread (a peer
            # sends its hello at once); then the progress timeout, which lets the connection idle
            # between frames
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            conn.settimeout(CONNECT_TIMEOUT_S)
            if self._tls is not None:
                conn = self._tls.ssl_server_context.wrap_socket(conn, server_side=True)
            secret = self._hello(conn, deadline)
            if isinstance(secret, bytes):  # a proxy session's bulk connection (server/bulklink.py)
                assert self._session is not None
                progress_timeout(conn, self._tls is not None)  # its reads are bounded as a frame's
                framing = True
                self._session(conn, secret, peer)
                return
            if not secret:
                log.warning("TCP transfer connection from %s refused: wrong token", peer)
                return
            progress_timeout(conn, self._tls is not None)
            framing = True
            while self._frame(conn, peer):
                pass
        except OSError as e:  # ssl.SSLError too: a failed handshake, in one line
            log.warning("TCP transfer connection from %s ended: %s", peer, why(e) if framing else e)
        except ValueError as e:
            log.warning("TCP transfer connection from %s ended: %s", peer, e)
        finally:
            with contextlib.suppress(OSError):
                conn.close()

    def _hello(self, conn: socket.socket, deadline: float) -> bool | bytes:
        """Whether a peer's hello, whole by `deadline`, is right; a proxy session's hello: its
        secret (bytes)."""
        head = _hello_bytes(conn, HELLO.size, deadline)
        if head is None:
            return False
        magic, n = HELLO.unpack(head)
        if magic == SESSION_MAGIC and self._session is not None:
            secret = _hello_bytes(conn, n, deadline)
            return secret or False
        if magic != HELLO_MAGIC:
            if head[:1] == TLS_HANDSHAKE and self._tls is None:
                raise ValueError("the peer speaks TLS and this worker does not (no --tls-cert)")
            return False
        token = _hello_bytes(conn, n, deadline)
        if token is None:
            return False
        return self._check(token) if self._check is not None else hmac.compare_digest(token, self._token)

    def _frame(self, conn: socket.socket, peer: object) -> bool:
        """Reads one frame and delivers it; False when the peer closed the connection."""
        then = DEAD_PEER_S if self._tls is not None else None  # the socket timeout (progress_timeout)
        got = next_prefix(conn, FRAME.size, then)
        if got is None:
            return False
        prefix, deadline = got
        magic, n = FRAME.unpack(prefix)
        if magic != FRAME_MAGIC or n > MAX_HEADER:
            raise ValueError("malformed frame")
        raw = head_rest(conn, n, deadline, then)
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
        try:
            whole = recv_exact(conn, byte_view(arr)) if arr.nbytes else True
        except OSError as e:
            # a sender gone silent (its host vanished, or it froze) or a broken connection: as
            # below. Said here, in a string: a log record holding `e` would keep `arr` alive
            log.warning("TCP transfer connection from %s lost in the middle of buffer %#x (%d bytes): %s", peer,
                        header.buffer_id, arr.nbytes, why(e))
            return False
        if not whole:
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
        guard(sock)
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
