"""Worker -> worker array transfer, chosen per edge: on one host a shared-memory ring with a
notice on a Unix socket (locallink.py; a segment of its own for an array too big for the ring),
a chunked gRPC stream otherwise. The controller never carries these bytes."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from pwctl import tls as tls_
from pwctl.tls import TlsConfig
from pwctl.transport import KEEPALIVE_OPTIONS
from schemas.arrays import byte_view, c_order, dtype_name, from_bytes, from_parts, resolve_dtype, to_numpy
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

from ..credentials import PEER_HEADER, peer_credential
from ..envsetting import env_number
from ..threadnames import name_native_thread
from .locallink import LocalPeers
from .parts import local_parts
from .shards import is_partial
from .shmring import put_segment, take_segment
from .tcplink import TcpPeer

log = logging.getLogger(__name__)

CHUNK = 4 * 1024 * 1024  # a fetch's messages (servicer.py)
# a data-message fetch's (FetchRequest.data_messages), which the controller forwards unchanged as a
# proxy download's lookup messages: a download's first bytes reached the controller 3-6 ms after
# its lookup began in 1 MiB messages, against 13-24 ms in 4 MiB ones (bench/FINDINGS.md,
# 2026-11-25 22:45); 2 MiB ones cost the controller ~7 ms less per 64 MiB than 1 MiB (half the
# messages, each a gRPC write), the jaxlib client no more (2026-11-27 08:56)
DATA_CHUNK = 2 * 1024 * 1024
# a peer transfer's messages: 64 MiB between two hosts (network namespaces) by the stream alone went
# 1.2-2.5x faster in 1 MiB chunks than in 4 MiB ones (six runs); making 4 MiB messages page-faults
# every buffer afresh (~21k minor faults per 64 MiB, none at 1 MiB) (bench/FINDINGS.md, "Multi-host")
TRANSFER_CHUNK = 1024 * 1024
SHM_MIN_BYTES = 1024 * 1024  # a full ring sends smaller arrays inline: a segment costs more than copying them


# peers on other hosts with a sending thread of their own (`TransferSender`; the rest share the
# pool); PATHWAYS_SEND_LANES sets it (0: every send from the pool, as the tests of the pool's path do)
MAX_LANES = env_number("PATHWAYS_SEND_LANES", "8", int, 0, 1024, "a number of peers from 0 to 1024")
CHANNEL_OPTIONS = [  # the worker's server's, and with keepalive its channels'
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
# the worker's channels (to the controller, to peers): keepalive, hence TCP_USER_TIMEOUT 20 s, so a
# stream to a host that vanished fails within ~20 s of its first unanswered bytes (pwctl/transport.py)
CLIENT_OPTIONS = [*CHANNEL_OPTIONS, *KEEPALIVE_OPTIONS]


def chunks(buffer_id: int, arr: np.ndarray, part_start: tuple[int, ...] = (),
           global_shape: tuple[int, ...] = ()) -> Iterator[wpb.TransferChunk]:
    """The stream messages of one array (with `global_shape`: one part of a multi-host slice's
    array, starting at `part_start`; the first message says so)."""
    data = byte_view(arr)
    n = len(data)
    head = pb.ArrayProto(dtype=dtype_name(arr.dtype), shape=list(arr.shape))
    if n <= TRANSFER_CHUNK:
        head.data = bytes(data)
        yield wpb.TransferChunk(buffer_id=buffer_id, array=head, last=True, part_start=part_start,
                                global_shape=global_shape)
        return
    for off in range(0, n, TRANSFER_CHUNK):
        part = pb.ArrayProto(data=bytes(data[off : off + TRANSFER_CHUNK]))
        if off == 0:
            part.dtype, part.shape[:] = head.dtype, head.shape
            yield wpb.TransferChunk(buffer_id=buffer_id, array=part, last=off + TRANSFER_CHUNK >= n,
                                    part_start=part_start, global_shape=global_shape)
            continue
        yield wpb.TransferChunk(buffer_id=buffer_id, array=part, last=off + TRANSFER_CHUNK >= n)


class _PeerStream:
    """One long-lived Transfer stream to a peer worker: buffers go out in order as messages
    of one call instead of one call each (~0.5 ms a call on loopback: docs/facts.md, "Moving bytes")."""

    def __init__(self, stub: wgrpc.WorkerStub, metadata: Any, address: str) -> None:
        self.stub, self.metadata, self.address = stub, metadata, address
        self._queue: queue.SimpleQueue[wpb.TransferChunk | None] = queue.SimpleQueue()
        self._call: Any = None
        self._lock = threading.Lock()

    def _messages(self) -> Iterator[wpb.TransferChunk]:
        while True:
            msg = self._queue.get()
            if msg is None:
                return
            yield msg

    def send(self, msgs: Iterable[wpb.TransferChunk]) -> None:
        with self._lock:
            if self._call is None or self._call.done():
                if self._call is not None and self._call.exception() is not None:
                    log.warning("transfer stream to %s ended: %s", self.address, self._call.exception())
                    self._queue = queue.SimpleQueue()
                self._call = self.stub.Transfer.future(self._messages(), metadata=self.metadata)
            for m in msgs:
                self._queue.put(m)

    def close(self) -> None:
        self._queue.put(None)


# the transports of a peer transfer, as logged on first use per peer
RING = "shared-memory ring"
SEGMENT = "shared-memory segment"
STREAM = "gRPC stream"
TCP = "TCP link"
TCP_SETUP_S = 5.0  # asking a peer for its TCP port
TCP_RETRY_S = 30.0  # a peer without a usable TCP link is asked again after this long


def _head(arr: np.ndarray) -> pb.ArrayProto:
    return pb.ArrayProto(dtype=dtype_name(arr.dtype), shape=list(arr.shape))


class _Lane:
    """One peer's network sends, in order, on a thread of its own (`TransferSender.send`)."""

    def __init__(self, send: Callable[[int, Any, str, bool, Callable[[], None]], None], name: str) -> None:
        self._send = send
        self._queue: queue.SimpleQueue[tuple[int, Any, str, Callable[[], None]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def put(self, buffer_id: int, value: Any, address: str, done: Callable[[], None]) -> None:
        self._queue.put((buffer_id, value, address, done))

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        name_native_thread()
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._send(item[0], item[1], item[2], False, item[3])  # never raises (it reports failures)
            item = None  # hold no array while idle


class TransferSender:
    """Sends buffers to peers: to a peer on another host (by its TCP link, else its stream) from
    a thread of that peer's own (a lane, for the first MAX_LANES such peers), the rest from a
    small thread pool. A lane saves each array the pool's bookkeeping and the turns its threads
    took at one link's lock (a pipeline stage's outputs go to one peer, one after another)."""

    def __init__(self, token: str | None = None, threads: int = 2, tls: TlsConfig | None = None) -> None:
        self._tls = tls  # streams and TCP links over TLS, this worker's certificate presented (pwctl/tls.py)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pw-transfer",
                                        initializer=name_native_thread)
        self._lanes: dict[str, _Lane] = {}  # peer on another host -> its sending thread
        self._max_lanes = MAX_LANES  # 0 once closed: a send then meets the pool's refusal
        self._peers: dict[str, _PeerStream] = {}
        self._local = LocalPeers()  # same-host peers: shared-memory ring + Unix socket
        self._lock = threading.Lock()
        self._metadata: tuple[tuple[str, str], ...] | None = (("authorization", f"Bearer {token}"),) if token else None
        # PATHWAYS_TRANSFER: "auto" (shared memory on one host, else the TCP link, else the gRPC
        # stream); "grpc" or "tcp" send by that network path even between workers of one host
        # (tests and benchmarks of the cross-host paths on one machine)
        mode = os.environ.get("PATHWAYS_TRANSFER", "auto")
        self.network_only = mode in ("grpc", "tcp")
        self.use_tcp = mode != "grpc"
        self._token = token
        self._peer_secret = ""  # the peer credential (set_key): what TCP links present in their hello
        self._tcp: dict[str, TcpPeer | float] = {}  # peer -> its TCP link, or when to try again
        self._tcp_setup: dict[str, threading.Lock] = {}  # peer -> held while its link is opened
        # peers already sent to, per transport: the first send of each kind to a peer is logged
        # ("first transfer to ADDRESS by KIND"), which is how tests see which transport an edge used
        self._used: dict[str, set[str]] = {RING: set(), SEGMENT: set(), STREAM: set(), TCP: set()}

    def set_key(self, key: bytes) -> None:
        """The controller's key (at registration): transfers carry the peer credential made with
        it, which receivers check (auth.py). Streams opened before are reopened with it."""
        secret = peer_credential(key)
        metadata = [(PEER_HEADER, secret)]
        if self._token:
            metadata.append(("authorization", f"Bearer {self._token}"))
        with self._lock:
            if self._metadata == tuple(metadata):
                return
            self._metadata, self._peer_secret = tuple(metadata), secret
            peers, self._peers = list(self._peers.values()), {}
            links = [e for e in self._tcp.values() if isinstance(e, TcpPeer)]
            self._tcp = {}
        for peer in peers:
            peer.close()
        for link in links:
            link.close()

    def _peer(self, address: str) -> _PeerStream:
        with self._lock:
            peer = self._peers.get(address)
            if peer is None:
                stub = wgrpc.WorkerStub(tls_.channel(address, CLIENT_OPTIONS, self._tls))
                peer = self._peers[address] = _PeerStream(stub, self._metadata, address)
            return peer

    def send(self, buffer_id: int, value: Any, address: str, same_host: bool, done: Callable[[], None]) -> None:
        local = same_host and not self.network_only
        lane = None if local or not self.use_tcp else self._lane(address)
        if lane is not None:
            lane.put(buffer_id, value, address, done)
        else:
            self._pool.submit(self._send, buffer_id, value, address, local, done)

    def _lane(self, address: str) -> _Lane | None:
        with self._lock:
            lane = self._lanes.get(address)
            if lane is None and len(self._lanes) < self._max_lanes:
                lane = self._lanes[address] = _Lane(self._send, f"pw-send_{len(self._lanes)}")
            return lane

    def _tcp_peer(self, address: str) -> TcpPeer | None:
        """The TCP link to the worker at `address` (opened on first use: its `Stats` names the
        port), or None where it has none or it failed lately (then the gRPC stream carries it)."""
        known, entry = self._tcp_known(address)
        if known:
            return entry
        with self._lock:
            setup = self._tcp_setup.setdefault(address, threading.Lock())
        # one thread opens a peer's link and the others wait for it: two pool threads opening it at
        # once (a burst of first sends, as a pipeline's first micro-batches) made two links, the
        # second closing the first under the send on it (EBADF), after which the transfers to that
        # peer went by the gRPC stream for TCP_RETRY_S (tests/test_transfer_link.py)
        with setup:
            known, entry = self._tcp_known(address)
            return entry if known else self._tcp_open(address)

    def _tcp_known(self, address: str) -> tuple[bool, TcpPeer | None]:
        """(True, the link) where it is up, (True, None) while a failed one waits for its retry,
        (False, None) where one is to be opened."""
        with self._lock:
            entry = self._tcp.get(address)
        if isinstance(entry, TcpPeer) and not entry.broken:
            return True, entry
        if isinstance(entry, float) and time.monotonic() < entry:
            return True, None
        return False, None

    def _tcp_open(self, address: str) -> TcpPeer | None:
        try:
            stats = self._peer(address).stub.Stats(wpb.WorkerStatsRequest(), metadata=self._metadata,
                                                    timeout=TCP_SETUP_S)
            if not stats.data_address:
                raise OSError("it has no TCP transfer port")
            peer: TcpPeer | float = TcpPeer(stats.data_address, self._peer_secret, self._tls)
        except (grpc.RpcError, OSError, ValueError) as e:
            log.info("no TCP link to %s (%s): the gRPC stream carries its transfers", address, e)
            peer = time.monotonic() + TCP_RETRY_S
        with self._lock:
            old = self._tcp.get(address)
            if isinstance(old, TcpPeer):
                old.close()
            self._tcp[address] = peer
        return peer if isinstance(peer, TcpPeer) else None

    def _send_tcp(self, buffer_id: int, value: Any, address: str) -> bool:
        """Sends by the TCP link; False (nothing sent) where there is none or it broke."""
        peer = self._tcp_peer(address)
        if peer is None:
            return False
        try:
            if is_partial(value):  # a multi-host slice's array: this member's shards, for the reader to gather
                shape = tuple(value.shape)
                for start, part in local_parts(value):
                    peer.send(wpb.TransferChunk(buffer_id=buffer_id, array=_head(part), part_start=start,
                                                global_shape=shape), part)
            else:
                arr = c_order(to_numpy(value))
                peer.send(wpb.TransferChunk(buffer_id=buffer_id, array=_head(arr)), arr)
        except OSError as e:
            log.warning("TCP link to %s broke (%s): the gRPC stream carries its transfers for a while", address, e)
            with self._lock:
                self._tcp[address] = time.monotonic() + TCP_RETRY_S
            peer.close()
            return False
        self._note(TCP, address)
        return True

    def _send(self, buffer_id: int, value: Any, address: str, same_host: bool, done: Callable[[], None]) -> None:
        try:
            if not same_host and self.use_tcp and self._send_tcp(buffer_id, value, address):
                return
            if is_partial(value):  # a multi-host slice's array: this member's shards, for the reader to gather
                shape = tuple(value.shape)
                self._peer(address).send(
                    [c for start, part in local_parts(value) for c in chunks(buffer_id, part, start, shape)])
                self._note(STREAM, address)
                return
            arr = c_order(to_numpy(value))
            local = self._local.get(address) if same_host else None
            if local is not None and local.send(buffer_id, arr):
                self._note(RING, address)
                return  # through the ring
            if same_host and arr.nbytes >= SHM_MIN_BYTES:
                name = put_segment(arr)
                msg = wpb.TransferChunk(
                    buffer_id=buffer_id,
                    array=pb.ArrayProto(dtype=dtype_name(arr.dtype), shape=list(arr.shape), shm_name=name),
                    last=True,
                )
                self._peer(address).send([msg])
                self._note(SEGMENT, address)
            else:
                self._peer(address).send(chunks(buffer_id, arr))
                self._note(STREAM, address)
        except Exception as e:
            log.warning("transfer of buffer %d to %s failed: %s", buffer_id, address, e)
            self.send_error(buffer_id, wpb.OutputRoute(address=address), f"transfer to {address} failed: {e}")
        finally:
            done()

    def _note(self, kind: str, address: str) -> None:
        seen = self._used[kind]
        if address not in seen:  # a race adds it twice at worst: one more log line
            seen.add(address)
            log.info("first transfer to %s by %s", address, kind)

    def send_error(self, buffer_id: int, route: wpb.OutputRoute, error: str) -> None:
        try:
            self._peer(route.address).send([wpb.TransferChunk(buffer_id=buffer_id, last=True, error=error)])
        except Exception as e:
            log.warning("failure notice for buffer %d to %s failed: %s", buffer_id, route.address, e)

    def close(self) -> None:
        self._local.close()
        with self._lock:
            lanes, self._lanes, self._max_lanes = list(self._lanes.values()), {}, 0
        for lane in lanes:
            lane.close()
        for entry in list(self._tcp.values()):
            if isinstance(entry, TcpPeer):
                entry.close()
        for peer in list(self._peers.values()):
            peer.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def peer_array(first: pb.ArrayProto, parts: list[bytes]) -> np.ndarray:
    """A peer's array as the receiving worker stores it: inline bytes, or a segment the peer made
    (its name checked by the caller)."""
    if first.shm_name:
        return take_segment(first.shm_name, resolve_dtype(first.dtype), tuple(first.shape))
    if len(parts) == 1:
        return from_bytes(first.dtype, list(first.shape), parts[0])
    return from_parts(first.dtype, list(first.shape), parts)  # aligned: XLA takes it without a copy
