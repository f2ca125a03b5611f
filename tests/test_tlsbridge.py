"""The IFRT proxy's TLS bridge (pwctl/tlsbridge.py) as a process: whom it serves and how long it
lives, against a real TLS server (Python's ssl, a throwaway CA: tests/tlscerts.py).

(a) it serves its parent alone: the parent's connection reaches the controller, another process
of the same user is refused (with mutual TLS the bridge presents the user's client certificate,
so any process that could connect would act as that user's client); (b) it ends with its parent
however the parent ends (returns, SIGKILL, SIGKILL after forking a child that keeps the pipe
open); (c) one that cannot start says why in one line, at once, rather than leaving the jaxlib
client to retry a dead address, and so does a controller that wants a client certificate (mutual
TLS) the bridge does not have or it refuses; (d) hundreds of MiB go through both ways unchanged, and the
server's end reaches the client as its end of stream.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, wait_for
from tlscerts import Cert, make_ca, make_cert

from pwctl import tls, tlsbridge
from pwctl.errors import ConnectionFailed

pytestmark = pytest.mark.timeout(120)


class Certs:
    def __init__(self, folder: Path) -> None:
        self.ca = make_ca(folder)
        self.host: Cert = make_cert(self.ca, folder, "host", ["127.0.0.1"])
        self.client = make_cert(self.ca, folder, "client", ["client.example"])
        other = make_ca(folder, "other")
        self.stranger = make_cert(other, folder / "other", "stranger", ["client.example"])  # another CA's


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return Certs(tmp_path_factory.mktemp("tlsbridge"))


class EchoServer:
    """A TLS server (ALPN h2, as the controller) that reads a length-prefixed message, answers it
    reversed and closes; counts the connections it accepted. (It does not wait for the client's
    end of stream: the bridge passes that on as a TCP FIN without close_notify, after which
    OpenSSL refuses to write, as a gRPC server closes anyway.)"""

    def __init__(self, certs: Certs) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(certs.host.cert, certs.host.key)
        self.ctx.set_alpn_protocols(["h2"])
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), self.ctx.wrap_socket(conn, server_side=True) as t:
            buf = bytearray()
            while len(buf) < 8 or len(buf) < 8 + int.from_bytes(buf[:8], "big"):
                chunk = t.recv(1 << 20)
                if not chunk:
                    return
                buf += chunk
            t.sendall(buf[:7:-1])  # the message, reversed

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def server(certs: Certs) -> EchoServer:
    s = EchoServer(certs)
    yield s  # type: ignore[misc]
    s.close()


def exchange(address: str, payload: bytes, timeout: float = 60) -> bytes:
    """Sends `payload` through the bridge at `address`; returns the answer, read until the server's end."""
    with contextlib.closing(tlsbridge.connect_local(address, timeout)) as s:
        s.sendall(len(payload).to_bytes(8, "big"))
        s.sendall(payload)
        back = bytearray()
        while chunk := s.recv(1 << 20):
            back += chunk
    return bytes(back)


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie no longer does: its parent may not reap it at once)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


OTHER = """
import socket, sys
from pwctl import tlsbridge
s = tlsbridge.connect_local(sys.argv[1], 10)
try:
    s.sendall(len(b"theirs").to_bytes(8, "big") + b"theirs")
    sys.stdout.write(repr(s.recv(100)))
except ConnectionError:  # dropped with the bytes unread
    sys.stdout.write("b''")
"""


@pytest.mark.skipif(not tlsbridge.PEER_CHECK, reason="needs SO_PEERCRED (Linux)")
def test_the_bridge_serves_its_parent_alone(certs: Certs, server: EchoServer) -> None:
    b = tlsbridge.Bridge("127.0.0.1", server.port, tls.TlsConfig(ca=str(certs.ca.cert)))
    try:
        assert exchange(b.address, b"mine") == b"enim"
        assert server.accepted == 1
        other = subprocess.run(  # another process of this user, connecting to the same address
            [sys.executable, "-c", OTHER, b.address], capture_output=True, text=True, timeout=60, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        assert other.returncode == 0 and other.stdout == "b''", other.stdout + other.stderr  # nothing came back
        assert server.accepted == 1  # and it never reached the server
        assert exchange(b.address, b"again") == b"niaga"  # the parent still can
    finally:
        b.close()


SCRIPT = """
import os, signal, sys, time
from pwctl import tls, tlsbridge
b = tlsbridge.Bridge("127.0.0.1", int(sys.argv[2]), tls.TlsConfig(ca=sys.argv[3]))
print(b.proc.pid, flush=True)
how = sys.argv[1]
if how == "fork-kill":  # a child (multiprocessing's fork, say) inherits the pipe and outlives us
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
if how != "return":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("how", ["return", "kill", "fork-kill"])
def test_the_bridge_ends_with_its_parent(certs: Certs, server: EchoServer, how: str) -> None:
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, how, str(server.port), str(certs.ca.cert)],
                         stdout=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert p.stdout is not None
        child = int(p.stdout.readline())
        p.wait(timeout=30)
        wait_for(lambda: not alive(child), 10, f"the bridge (pid {child}) to end after its parent ({how})")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # the forked child, if any


def test_a_bridge_that_cannot_start_says_why_in_one_line(certs: Certs, server: EchoServer, tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(certs.ca.cert.read_bytes())
    config = tls.TlsConfig(ca=str(ca))
    ca.unlink()  # gone before the bridge reads it
    started = time.monotonic()
    with pytest.raises(ConnectionFailed, match=r"^the TLS bridge to 127\.0\.0\.1:\d+ did not start: .*cannot read"):
        tlsbridge.Bridge("127.0.0.1", server.port, config)
    assert time.monotonic() - started < 10
    # no CA file at all (the system's roots): it starts and forwards (the bridge's handshake then
    # fails, the server's private CA not being among those roots, having reached the server)
    b = tlsbridge.Bridge("127.0.0.1", server.port, tls.TlsConfig())
    try:
        assert b.proc.poll() is None
        with contextlib.closing(tlsbridge.connect_local(b.address, 30)):
            wait_for(lambda: server.accepted == 1, 30, "the bridge to reach the server")
    finally:
        b.close()


def test_hundreds_of_mib_both_ways(certs: Certs, server: EchoServer) -> None:
    payload = os.urandom(1 << 20) * 256  # 256 MiB
    b = tlsbridge.Bridge("127.0.0.1", server.port, tls.TlsConfig(ca=str(certs.ca.cert)))
    try:
        back = exchange(b.address, payload, timeout=100)
        assert len(back) == len(payload) and back == payload[::-1]
    finally:
        b.close()


def test_a_controller_wanting_a_client_certificate_is_one_line_at_start(certs: Certs) -> None:
    """Mutual TLS: the handshake itself succeeds without a client certificate (TLS 1.3 checks it
    after), so the bridge's check sends the HTTP/2 preface, which such a server answers by closing."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs.host.cert, certs.host.key)
    ctx.load_verify_locations(certs.ca.cert)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:  # a gRPC server's answer to the preface: its settings; then until the end
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with contextlib.suppress(OSError), ctx.wrap_socket(conn, server_side=True) as t:
                t.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
                while t.recv(1 << 16):
                    pass

    threading.Thread(target=serve, daemon=True).start()
    port = listener.getsockname()[1]
    try:
        ca = str(certs.ca.cert)
        with pytest.raises(ConnectionFailed, match=r"requires a client certificate \(mutual TLS\): set PWCTL_TLS_CERT"):
            tlsbridge.bridge("127.0.0.1", port, tls.TlsConfig(ca=ca))
        with pytest.raises(ConnectionFailed, match="refused this client's certificate"):
            tlsbridge.bridge("127.0.0.1", port, tls.TlsConfig(ca=ca, cert=str(certs.stranger.cert),
                                                              key=str(certs.stranger.key)))
        b = tlsbridge.bridge("127.0.0.1", port, tls.TlsConfig(ca=ca, cert=str(certs.client.cert),
                                                              key=str(certs.client.key)))
        b.close()
    finally:
        listener.close()
