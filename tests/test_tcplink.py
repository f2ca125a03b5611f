"""The TCP transfer link (server/worker/tcplink.py) in process: arrays of every kind arrive whole
and in order, parts carry where they sit, a failure notice arrives as one, and a peer with a
wrong token or a malformed frame is dropped without anything delivered."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import wait_for
from tlscerts import make_ca, make_cert

from pwctl import tls
from schemas.arrays import ALIGN
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb
from server.worker import tcplink
from server.worker.tcplink import FRAME, FRAME_MAGIC, HELLO, HELLO_MAGIC, TcpPeer, TcpReceiver

pytestmark = pytest.mark.timeout(30)


class Inbox:
    def __init__(self) -> None:
        self.items: list[tuple[wpb.TransferChunk, np.ndarray | None]] = []
        self.cond = threading.Condition()

    def deliver(self, header: wpb.TransferChunk, arr: np.ndarray | None) -> None:
        with self.cond:
            self.items.append((header, arr))
            self.cond.notify_all()

    def wait(self, n: int, timeout: float = 10.0) -> list[tuple[wpb.TransferChunk, np.ndarray | None]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.items) >= n, timeout), self.items
            return list(self.items)


def _head(bid: int, arr: np.ndarray, **kw: object) -> wpb.TransferChunk:
    return wpb.TransferChunk(buffer_id=bid, array=pb.ArrayProto(dtype=arr.dtype.name, shape=list(arr.shape)),
                             **kw)  # type: ignore[arg-type]


def _half_an_array(raw: socket.socket, bid: int, x: np.ndarray) -> None:
    """A hello with the token "right", then a frame of `x` as buffer `bid` that stops after half of its bytes."""
    h = _head(bid, x).SerializeToString()
    raw.sendall(HELLO.pack(HELLO_MAGIC, 5) + b"right" + FRAME.pack(FRAME_MAGIC, len(h)) + h)
    raw.sendall(x.view(np.uint8)[: x.nbytes // 2].tobytes())


def _only_the_whole_one_arrives(peer: TcpPeer, inbox: Inbox, x: np.ndarray) -> None:
    """`peer` sends `x` as buffer 7: it is delivered, the array cut off before it never was."""
    peer.send(_head(7, x), x)
    got = inbox.wait(1)
    assert [h.buffer_id for h, _ in got] == [7]
    np.testing.assert_array_equal(got[0][1], x)
    peer.close()


def test_arrays_parts_and_failures_arrive_in_order() -> None:
    inbox = Inbox()
    rx = TcpReceiver("127.0.0.1", "s3cret", inbox.deliver)
    address = rx.start()
    assert address.startswith("127.0.0.1:")
    peer = TcpPeer(address, "s3cret")
    big = np.arange(3 * 1024 * 1024, dtype=np.float32).reshape(1024, 3072)  # 12 MiB
    bf = np.linspace(0, 1, 10).astype(ml_dtypes.bfloat16)
    empty = np.zeros((0, 4), np.int64)
    part = np.ones((2, 3), np.float64)
    peer.send(_head(1, big), big)
    peer.send(_head(2, bf), bf)
    peer.send(_head(3, empty), empty)
    peer.send(_head(4, part, part_start=[2, 0], global_shape=[4, 3]), part)
    peer.send(wpb.TransferChunk(buffer_id=5, error="producer failed"), None)
    got = inbox.wait(5)
    assert [h.buffer_id for h, _ in got] == [1, 2, 3, 4, 5]
    np.testing.assert_array_equal(got[0][1], big)
    assert got[1][1] is not None and got[1][1].dtype == bf.dtype and np.array_equal(got[1][1], bf)
    assert got[2][1] is not None and got[2][1].shape == (0, 4)
    assert list(got[3][0].part_start) == [2, 0] and list(got[3][0].global_shape) == [4, 3]
    assert got[4][1] is None and got[4][0].error == "producer failed"
    peer.close()
    rx.close()


def test_a_received_array_is_aligned_so_jax_takes_it_without_a_copy() -> None:
    """The receiver's array starts on a 64-byte boundary: XLA on CPU then adopts its memory
    (device_put, or a jit call's argument) instead of copying it (schemas/arrays.py)."""
    import jax

    inbox = Inbox()
    rx = TcpReceiver("127.0.0.1", "s3cret", inbox.deliver)
    peer = TcpPeer(rx.start(), "s3cret")
    arrays = [np.arange(n, dtype=np.float32) for n in (1, 17, 1 << 20)]
    for i, a in enumerate(arrays):
        peer.send(_head(i, a), a)
    got = inbox.wait(len(arrays))
    cpu = jax.devices("cpu")[0]
    for (_, arr), want in zip(got, arrays, strict=True):
        assert arr is not None and arr.ctypes.data % ALIGN == 0
        np.testing.assert_array_equal(arr, want)
        on_device = jax.device_put(arr, cpu)
        assert on_device.unsafe_buffer_pointer() == arr.ctypes.data  # the same memory: no copy
        np.testing.assert_array_equal(np.asarray(on_device), want)
    peer.close()
    rx.close()


def _closed(raw: socket.socket) -> bool:
    raw.settimeout(5)
    try:
        return raw.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_wrong_token_or_a_malformed_frame_delivers_nothing() -> None:
    inbox = Inbox()
    rx = TcpReceiver("127.0.0.1", "right", inbox.deliver)
    address = rx.start()
    host, port = address.rsplit(":", 1)
    wrong = TcpPeer(address, "wrong")
    x = np.ones(4, np.float32)
    with pytest.raises(OSError):  # the receiver drops the connection: a later send fails
        for _ in range(50):
            wrong.send(_head(1, x), x)
            time.sleep(0.05)
    with socket.create_connection((host, int(port))) as raw:  # right token, then garbage
        raw.sendall(HELLO.pack(HELLO_MAGIC, 5) + b"right" + FRAME.pack(b"XXXX", 3) + b"abc")
        assert _closed(raw)
    with socket.create_connection((host, int(port))) as raw:  # a header that claims a huge array
        h = wpb.TransferChunk(buffer_id=9, array=pb.ArrayProto(dtype="float64", shape=[1 << 40])).SerializeToString()
        raw.sendall(HELLO.pack(HELLO_MAGIC, 5) + b"right" + FRAME.pack(FRAME_MAGIC, len(h)) + h)
        assert _closed(raw)
    ok = TcpPeer(address, "right")  # the receiver still serves
    ok.send(_head(7, x), x)
    got = inbox.wait(1)
    assert [h.buffer_id for h, _ in got] == [7]
    ok.close()
    rx.close()


def test_a_sender_gone_in_the_middle_of_an_array_delivers_nothing_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    """A peer that closes (or dies) after half of an array's bytes: nothing is delivered, one
    warning names the buffer, and the receiver serves the next connection."""
    inbox = Inbox()
    rx = TcpReceiver("127.0.0.1", "right", inbox.deliver)
    address = rx.start()
    host, port = address.rsplit(":", 1)
    x = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    with caplog.at_level("WARNING", logger="server.worker.tcplink"):
        with socket.create_connection((host, int(port))) as raw:
            _half_an_array(raw, 0x51, x)
        deadline = time.monotonic() + 10
        while "closed in the middle of buffer 0x51" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "closed in the middle of buffer 0x51 (4194304 bytes)" in caplog.text, caplog.text
    _only_the_whole_one_arrives(TcpPeer(address, "right"), inbox, x)
    rx.close()


def _receivers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "pw-tcp-recv"}


@pytest.fixture(scope="module")
def tls_config(tmp_path_factory: pytest.TempPathFactory) -> tls.TlsConfig:
    folder: Path = tmp_path_factory.mktemp("tcplink-tls")
    ca = make_ca(folder)
    host = make_cert(ca, folder, "host", ["127.0.0.1"])
    config = tls.server_config(str(host.cert), str(host.key), str(ca.cert), require_client_cert=True)
    assert config is not None
    return config


def test_over_tls_arrays_arrive_whole_and_the_wrong_peers_get_clean_errors(
        tls_config: tls.TlsConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Mutual TLS on the link: a 96 MiB array arrives whole (SSL sockets read and write in
    records: every partial read and write is carried on); a plaintext peer and a peer that
    connects and says nothing (before or after the handshake) are dropped, their threads gone
    within the hello's timeout; a TLS peer to a plaintext receiver fails at once (transfer.py then
    sends by gRPC), and that receiver says why."""
    monkeypatch.setattr(tcplink, "CONNECT_TIMEOUT_S", 1.0)
    inbox = Inbox()
    rx = TcpReceiver("127.0.0.1", "s3cret", inbox.deliver, tls=tls_config)
    host, _, port = rx.start().rpartition(":")
    before = _receivers()
    try:
        peer = TcpPeer(rx.address, "s3cret", tls_config)
        big = np.random.default_rng(0).integers(0, 1 << 30, size=(24 << 20,), dtype=np.int32).reshape(3, -1)
        peer.send(_head(1, big), big)
        [(h, arr)] = inbox.wait(1, timeout=60)
        assert h.buffer_id == 1 and arr is not None and np.array_equal(arr, big)
        peer.close()

        plain = socket.create_connection((host, int(port)), timeout=5)
        plain.sendall(HELLO.pack(HELLO_MAGIC, 6) + b"s3cret")
        silent = socket.create_connection((host, int(port)), timeout=5)
        handshaken = tls_config.wrap_client(socket.create_connection((host, int(port)), timeout=5), host)
        ended = wait_for(lambda: (lambda e: e if len(e) == 3 else None)(
            [r.getMessage() for r in caplog.records if "ended" in r.getMessage()]), 10, "three connections dropped")
        assert any("WRONG_VERSION_NUMBER" in e for e in ended) and sum("timed out" in e for e in ended) == 2, ended
        wait_for(lambda: not _receivers() - before, 5, "the receiver's threads of those peers to end")
        for s in (plain, silent, handshaken):
            s.close()
    finally:
        rx.close()

    plain_rx = TcpReceiver("127.0.0.1", "s3cret", inbox.deliver)
    plain_rx.start()
    try:
        started = time.monotonic()
        with pytest.raises(OSError):
            TcpPeer(plain_rx.address, "s3cret", tls_config)
        assert time.monotonic() - started < 5
        wait_for(lambda: any("speaks TLS and this worker does not" in r.getMessage() for r in caplog.records), 5,
                 "the plaintext receiver to say why")
    finally:
        plain_rx.close()


@pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])
def test_a_sender_silent_in_the_middle_of_an_array_is_dropped_but_an_idle_one_stays(
        use_tls: bool, tls_config: tls.TlsConfig, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The progress timeout (DEAD_PEER_S, 1 s here): a sender that stops in the middle of an
    array while its host lives on (a frozen process: its kernel answers the keepalive) is
    dropped, its thread ends, nothing is delivered; a sender idle between frames for three times
    as long keeps its connection and then delivers. Plain (SO_RCVTIMEO) and TLS (socket timeout)."""
    monkeypatch.setattr(tcplink, "DEAD_PEER_S", 1.0)
    config = tls_config if use_tls else None
    inbox = Inbox()
    rx = TcpReceiver("127.0.0.1", "right", inbox.deliver, tls=config)
    host, _, port = rx.start().rpartition(":")
    before = _receivers()
    try:
        idle = TcpPeer(rx.address, "right", config)
        x = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
        raw = socket.create_connection((host, int(port)), timeout=5)
        if config is not None:
            raw = config.wrap_client(raw, host)
        with caplog.at_level("WARNING", logger="server.worker.tcplink"):
            _half_an_array(raw, 0x52, x)
            started = time.monotonic()
            said = wait_for(lambda: [r.getMessage() for r in caplog.records if "0x52" in r.getMessage()], 10,
                            "the silent sender dropped")
            took = time.monotonic() - started
        assert "lost in the middle of buffer 0x52 (4194304 bytes): no bytes for 1 s" in said[0], said
        assert 0.5 < took < 5, took
        wait_for(lambda: len(_receivers() - before) == 1, 5, "the silent sender's thread to end")
        time.sleep(max(0.0, idle.opened + 3.0 - time.monotonic()))  # idle for three times the timeout
        _only_the_whole_one_arrives(idle, inbox, x)
        raw.close()
    finally:
        rx.close()


@pytest.mark.parametrize("how", ["stalls", "trickles"])
@pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])
def test_a_sender_slow_partway_through_a_header_is_dropped_within_the_dead_peer_time(
        use_tls: bool, how: str, tls_config: tls.TlsConfig, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A frame's prefix and header have one deadline, DEAD_PEER_S (2 s here) after its first
    byte: a sender that sends half a header and stalls, or sends its header a byte every 0.4 s
    (each read's own timeout never passing), is dropped within it and nothing is delivered.
    Before, a plain connection's MSG_WAITALL read and the read after it waited DEAD_PEER_S each,
    and a trickle held the thread for as long as it went on."""
    dead = 2.0
    monkeypatch.setattr(tcplink, "DEAD_PEER_S", dead)
    config = tls_config if use_tls else None
    inbox = Inbox()
    rx = TcpReceiver("127.0.0.1", "right", inbox.deliver, tls=config)
    host, _, port = rx.start().rpartition(":")
    before = _receivers()
    stop = threading.Event()
    try:
        raw = socket.create_connection((host, int(port)), timeout=5)
        if config is not None:
            raw = config.wrap_client(raw, host)
        x = np.arange(256, dtype=np.float32)
        h = _head(0x53, x).SerializeToString()
        frame = FRAME.pack(FRAME_MAGIC, len(h)) + h
        with caplog.at_level("WARNING", logger="server.worker.tcplink"):
            raw.sendall(HELLO.pack(HELLO_MAGIC, 5) + b"right")
            started = time.monotonic()
            if how == "stalls":
                raw.sendall(frame[: FRAME.size + len(h) // 2])
            else:
                def trickle() -> None:
                    for i in range(len(frame)):
                        raw.sendall(frame[i:i + 1])
                        if stop.wait(0.4):
                            return

                threading.Thread(target=trickle, daemon=True).start()
            said = wait_for(lambda: [r.getMessage() for r in caplog.records if "ended" in r.getMessage()], 10,
                            "the slow sender dropped")
            took = time.monotonic() - started
        assert dead - 0.5 < took < dead + 0.9, took  # the old code: 2 x dead, or the whole trickle (~30 s)
        assert "timed out: a frame's head not whole in time (2 s after its first byte)" in said[0], said
        wait_for(lambda: not _receivers() - before, 5, "the slow sender's thread to end")
        assert not inbox.items
        raw.close()
    finally:
        stop.set()
        rx.close()


def test_a_peer_that_trickles_its_hello_is_dropped_within_the_connect_timeout(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The hello has one deadline, CONNECT_TIMEOUT_S (1.5 s here) after the connection: a peer
    sending it a byte every 0.4 s (each read's own timeout never passing; the old code waited out
    the whole trickle, ~20 s) is dropped then, unheard."""
    monkeypatch.setattr(tcplink, "CONNECT_TIMEOUT_S", 1.5)
    inbox = Inbox()
    rx = TcpReceiver("127.0.0.1", "right" * 10, inbox.deliver)
    host, _, port = rx.start().rpartition(":")
    stop = threading.Event()
    try:
        raw = socket.create_connection((host, int(port)), timeout=5)
        hello = HELLO.pack(HELLO_MAGIC, 50) + b"right" * 10

        def trickle() -> None:
            for i in range(len(hello)):
                raw.sendall(hello[i:i + 1])
                if stop.wait(0.4):
                    return

        with caplog.at_level("WARNING", logger="server.worker.tcplink"):
            started = time.monotonic()
            threading.Thread(target=trickle, daemon=True).start()
            said = wait_for(lambda: [r.getMessage() for r in caplog.records if "ended" in r.getMessage()], 10,
                            "the trickling peer dropped")
            took = time.monotonic() - started
        assert took < 2.4, took
        assert "ended: timed out: the hello not whole in time" in said[0], said
        raw.close()
    finally:
        stop.set()
        rx.close()


@pytest.mark.parametrize(("name", "value", "want"), [
    ("PATHWAYS_TCP_DEAD_PEER_S", "abc", "a number of seconds, at least 1"),
    ("PATHWAYS_TCP_DEAD_PEER_S", "0.5", "a number of seconds, at least 1"),
    ("PATHWAYS_TCP_DEAD_PEER_S", "nan", "a number of seconds, at least 1"),
    ("PATHWAYS_SEND_LANES", "-1", "a number of peers from 0 to 1024"),
    ("PATHWAYS_SEND_LANES", "many", "a number of peers from 0 to 1024"),
])
def test_a_bad_tuning_setting_stops_the_worker_in_one_line(name: str, value: str, want: str) -> None:
    """A worker with a malformed PATHWAYS_* tuning setting stops at start with one line and exit 2;
    it printed the traceback of the module import that read it."""
    r = subprocess.run([sys.executable, "-m", "server.worker", "--island", "x", "--server", "127.0.0.1:9"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, name: value},
                       cwd=Path(__file__).resolve().parent.parent)
    assert (r.returncode, r.stderr) == (2, f"error: {name}={value!r}: want {want}\n"), (r.returncode, r.stderr)
