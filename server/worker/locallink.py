"""Same-host transfers without gRPC: a Unix socket per pair of workers, beside a shared-memory ring.

Between two workers of one host the array bytes travel through the sender's shared-memory ring
(shmring.py); what remains is a ~100-byte notice per array. Over a gRPC stream that notice still
cost a thread hand-off and HTTP/2 framing on each side (~0.2-0.3 ms of CPU per array, measured in
a pipeline). Here it is one `send` on a SOCK_SEQPACKET Unix socket (message boundaries, order kept)
and one blocking `recv` on the receiver's thread for that peer. Each connection owns one ring, so the ring's arrays are
read in the order they were written.

The receiver listens on an abstract socket named after its gRPC address (Linux; no file to clean
up) and accepts only peers of its own user id. Where it cannot (another OS, another network
namespace), the sender falls back to the gRPC stream.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from schemas.arrays import dtype_name
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb

from ..threadnames import name_native_thread
from .shmring import RingReader, RingWriter

log = logging.getLogger(__name__)

__all__ = ["LocalPeer", "LocalPeers", "LocalReceiver", "available", "socket_name"]

MAX_NOTICE = 64 * 1024  # a notice is ~100 bytes; a longer datagram is malformed
RETRY_S = 10.0  # a peer that refused a connection is tried again after this long
SEND_TIMEOUT_S = 30.0


def available() -> bool:
    return sys.platform == "linux" and hasattr(socket, "SO_PEERCRED")


def socket_name(address: str) -> bytes:
    """The abstract socket of the worker serving gRPC at `address`."""
    return b"\0pathways-transfer/" + address.encode()


class LocalReceiver:
    """Accepts same-host peers; hands every notice, with the connection's ring, to `deliver`, in
    the order the peer sent them, from a thread of the connection's own (a blocking `recv`: no
    event-loop round per notice)."""

    def __init__(self, address: str, deliver: Callable[[RingReader, wpb.TransferChunk], None]) -> None:
        self.address = address
        self._deliver = deliver
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> bool:
        if not available():
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(socket_name(self.address))
            sock.listen(64)
        except OSError as e:
            log.info("no same-host transfer socket (%s): peers use gRPC", e)
            sock.close()
            return False
        self._sock = sock
        threading.Thread(target=self._accept_loop, args=(sock,), name="pw-local-accept", daemon=True).start()
        return True

    def _accept_loop(self, sock: socket.socket) -> None:
        name_native_thread()
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid != os.getuid():
                log.warning("refused a transfer connection from user id %d", uid)
                conn.close()
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._read_loop, args=(conn,), name="pw-local-recv", daemon=True).start()

    def _read_loop(self, conn: socket.socket) -> None:
        name_native_thread()
        ring = RingReader()  # the peer's ring: it goes when the peer does
        try:
            while True:
                try:
                    data = conn.recv(MAX_NOTICE)
                except OSError:
                    return
                if not data:
                    return
                notice = wpb.TransferChunk()
                try:
                    notice.ParseFromString(data)
                except Exception:
                    log.warning("malformed transfer notice (%d bytes) dropped", len(data))
                    continue
                try:
                    self._deliver(ring, notice)
                except Exception:  # a bug here must not end the link
                    log.exception("delivering transfer notice for buffer %d failed", notice.buffer_id)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes its reader thread
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._sock = None


class LocalPeer:
    """The sending side of one connection: `send` puts an array in the ring and the notice on the
    socket; False when the ring is full (the caller sends it another way)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(SEND_TIMEOUT_S)  # a receiver that stopped reading breaks the link
        try:
            self._sock.connect(socket_name(address))
            self._ring = RingWriter()
        except OSError:
            self._sock.close()
            raise
        self._lock = threading.Lock()  # ring order = socket order (the reader marks arrays read in order)
        self.broken = False

    def send(self, buffer_id: int, arr: np.ndarray) -> bool:
        with self._lock:
            if self.broken:
                return False
            slot = self._ring.put(arr)
            if slot is None:
                return False
            notice = wpb.TransferChunk(
                buffer_id=buffer_id, array=pb.ArrayProto(dtype=dtype_name(arr.dtype), shape=list(arr.shape)),
                last=True, ring=self._ring.name, ring_offset=slot[0], ring_release=slot[1])
            try:
                self._sock.sendall(notice.SerializeToString())
            except OSError:
                self.broken = True  # the receiver is gone: this array and later ones go by gRPC
                return False
            return True

    def close(self) -> None:
        with self._lock:
            self.broken = True
            self._sock.close()
            self._ring.close()


class LocalPeers:
    """One LocalPeer per same-host receiver, made on first use; None while one cannot be had."""

    def __init__(self) -> None:
        self._peers: dict[str, LocalPeer] = {}
        self._refused: dict[str, float] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> LocalPeer | None:
        if not available():
            return None
        with self._lock:
            peer = self._peers.get(address)
            if peer is not None and not peer.broken:
                return peer
            if time.monotonic() < self._refused.get(address, 0.0):
                return None
            if peer is not None:
                peer.close()
                del self._peers[address]
            try:
                peer = self._peers[address] = LocalPeer(address)
            except OSError as e:
                log.info("no same-host transfer link to %s (%s): using gRPC", address, e)
                self._refused[address] = time.monotonic() + RETRY_S
                return None
            return peer

    def close(self) -> None:
        with self._lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()

