"""The proxy's bulk bytes between the controller and a worker on plain TCP connections.

A proxy upload's or download's bytes between the controller and a worker went over Python gRPC,
whose receive copies every byte three times (bench/FINDINGS.md, 2026-11-25 22:45): per 64 MiB
~50-80 ms of the receiver's CPU where a socket's `recv_into` costs ~10-15. These connections
carry them as the workers' peer links do (server/worker/tcplink.py, whose port they share):
one kernel copy each way. The controller uses them on clusters without TLS only
(server/proxy/bulk.py says why); the helpers here also work on a TLS socket, which is what a
worker with TLS hands over.

A connection serves one proxy session: its hello (tcplink's, with `SESSION_MAGIC`) carries the
cluster token and the session credential the controller issued (server/credentials.py), which
the worker checks as it checks the gRPC calls' metadata; then its requests come one at a time:

- fetch: a `REQUEST` with `FETCH` and a `FetchRequest`; the worker answers a `REPLY` (code 0
  and the byte count, or a gRPC status code and its message) and, on success, the bytes as the
  `FetchData` messages its gRPC `Fetch` with `data_messages` sends (`message_sizes`), back to back.
- put: a `REQUEST` with `PUT` and a `PutBufferRequest` without data (`total_bytes` set; a staged
  upload's without dtype and shape), then exactly `total_bytes` raw bytes; a staged upload's
  spec follows as a `REQUEST` with `SPEC` (the `PutBufferRequest` of an empty last piece);
  then the worker's `REPLY`. A connection closed before the reply is an upload cut off: the
  worker drops it as a cancelled `PutBuffers` (nothing is kept).

The worker reads a request (bulk_service.py `_read_request`) with tcplink.py's deadlines: none
while the connection idles, DEAD_PEER_S for a request's head once its first byte came.
"""

from __future__ import annotations

import fcntl
import socket
import ssl
import struct
import termios
from collections.abc import Callable, Iterator, Sequence

from . import wire

SESSION_MAGIC = b"PWS1"  # a hello's magic for a session's connection (tcplink.HELLO)
REQUEST = struct.Struct("!4sI")  # kind, header length; the header follows
REPLY = struct.Struct("!4sIQ")  # magic, status code (0: OK), length of what follows
FETCH, PUT, SPEC = b"PWGF", b"PWGP", b"PWGS"
REPLY_MAGIC = b"PWGR"
MAX_HEADER = 1 << 20  # a request's header (a `PartOf` names every device of the slice)
MAX_ERROR = 64 * 1024
DATA_MESSAGE = 2 << 20  # bytes of array data per fetched message (server/worker/transfer.py DATA_CHUNK)


def hello_secret(token: str, credential: str) -> bytes:
    """What a session connection's hello carries: the cluster token and the session credential."""
    return f"{token}\n{credential}".encode()


def split_secret(secret: bytes) -> tuple[str, str]:
    """(token, credential) of a hello's secret; ("", "") for one that is not such."""
    token, sep, credential = secret.decode(errors="replace").partition("\n")
    return (token, credential) if sep else ("", "")


def message_sizes(nbytes: int) -> Iterator[tuple[int, int]]:
    """(data bytes, message bytes) of each `FetchData` message carrying `nbytes` of data, in
    order: one empty message for none, as the gRPC `Fetch` sends."""
    if nbytes == 0:
        yield 0, 0
        return
    for start in range(0, nbytes, DATA_MESSAGE):
        n = min(DATA_MESSAGE, nbytes - start)
        yield n, len(wire.len_field(1, n)) + n


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fills `view`; False when the other end closed the connection first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def recv_bytes(sock: socket.socket, n: int, fill: Callable[[socket.socket, memoryview], bool] = recv_exact,
               waitall: bool = True) -> bytes | None:
    """`n` bytes read into a fresh `bytes`; None when the connection closed first. A plain socket
    with `waitall`: straight into it, one MSG_WAITALL call, and what a signal (or the socket's read
    timeout) left of it by `fill`, joined; else (TLS, or not `waitall`) all of it by `fill`,
    through a bytearray. `fill(sock, view)` fills `view`, False when the peer closed first:
    `recv_exact` (no deadline), or a deadline's (tcplink.py `head_rest`: a frame's or request's head)."""
    if n == 0:
        return b""
    if waitall and not isinstance(sock, ssl.SSLSocket):
        data = sock.recv(n, socket.MSG_WAITALL)
        if len(data) == n:
            return data
        if not data:
            return None
        rest = bytearray(n - len(data))
        return data + bytes(rest) if fill(sock, memoryview(rest)) else None
    buf = bytearray(n)
    return bytes(buf) if fill(sock, memoryview(buf)) else None


def byte_views(parts: Sequence[bytes | memoryview]) -> list[memoryview]:
    """`parts` as flat byte views, the empty ones left out (what a gathered send takes)."""
    return [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]


def drop_sent(views: list[memoryview], sent: int) -> None:
    """Drops from `views`, in place, the `sent` bytes a gathered send (`sendmsg`) took."""
    while sent and views:
        if sent >= len(views[0]):
            sent -= len(views.pop(0))
        else:
            views[0] = views[0][sent:]
            sent = 0


def send_parts(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """Sends `parts` one after another (a plain socket: gathered, `sendmsg`, no copy)."""
    views = byte_views(parts)
    if isinstance(sock, ssl.SSLSocket):
        for v in views:
            sock.sendall(v)
        return
    while views:
        drop_sent(views, sock.sendmsg(views[:64]))


def request(kind: bytes, header: bytes) -> bytes:
    return REQUEST.pack(kind, len(header)) + header


def reply(code: int, length: int = 0, message: str = "") -> bytes:
    text = message.encode()[:MAX_ERROR]
    return REPLY.pack(REPLY_MAGIC, code, len(text) if code else length) + text


def _peeked_reply(sock: socket.socket) -> bool | tuple[int, int, int]:
    """A reply's head (magic, code, n) when all of it is here, peeked at; else whether reading it
    cannot wait: True at the connection's end, False before the head is all here, and on TLS."""
    if isinstance(sock, ssl.SSLSocket):
        return False
    try:
        head = sock.recv(REPLY.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    if len(head) < REPLY.size:
        return not head
    return REPLY.unpack(head)


def reply_here(sock: socket.socket) -> bool:
    """Whether the whole reply (or the connection's end) is here, so that `read_reply` returns
    without waiting (peeked at; a reply is one send: a success's is its 16 bytes); False on TLS."""
    head = _peeked_reply(sock)
    if isinstance(head, bool):
        return head
    magic, code, n = head
    if not code or magic != REPLY_MAGIC or n > MAX_ERROR:
        return True  # all of it (a success), or malformed: read_reply raises at once
    return len(sock.recv(REPLY.size + n, socket.MSG_PEEK | socket.MSG_DONTWAIT)) == REPLY.size + n


def fetch_here(sock: socket.socket, most: int) -> bool:
    """Whether a fetch's whole answer is here, so that reading it returns without waiting: a
    success's reply and all its messages, of at most `most` bytes of data (the worker sends them
    in one `sendmsg`), a refusal's whole reply (`reply_here`), or the connection's end; False on TLS."""
    head = _peeked_reply(sock)
    if isinstance(head, bool):
        return head
    magic, code, n = head
    if code or magic != REPLY_MAGIC:
        return reply_here(sock)
    if n > most:
        return False
    here = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    return bool(here >= REPLY.size + sum(size for _, size in message_sizes(n)))


def read_reply(sock: socket.socket) -> tuple[int, int, str] | None:
    """(code, length, error message) of the worker's reply; None when the connection closed first;
    ValueError when malformed."""
    head = recv_bytes(sock, REPLY.size)
    if head is None:
        return None
    magic, code, n = REPLY.unpack(head)
    if magic != REPLY_MAGIC or (code and n > MAX_ERROR):
        raise ValueError("malformed reply")
    if not code:
        return 0, n, ""
    text = recv_bytes(sock, n)
    return None if text is None else (code, 0, text.decode(errors="replace"))
