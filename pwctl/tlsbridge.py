"""A loopback bridge that lets the jaxlib IFRT proxy client reach a TLS controller.

The jaxlib client (`JAX_PLATFORMS=proxy`) makes only plaintext or ALTS channels
(xla/python/ifrt_proxy/common/grpc_credentials.cc): no TLS. When the controller serves TLS
(pwctl/tls.py), the plugin (pwctl/proxy_plugin.py) starts one `Bridge` for the user's process: a
plaintext listener on 127.0.0.1 (an ephemeral port) that the jaxlib client is pointed at, each
accepted connection forwarded byte for byte over TLS (ALPN "h2", the cluster's CA, the client
certificate where one is configured) to the controller. Nothing of gRPC is parsed: the bytes on
the loopback are the bytes inside the TLS stream.

The forwarding runs in a small child process (`python -m pwctl.tlsbridge`), not a thread of the
user's process: jaxlib calls such as `jax.device_put` hold the GIL while they wait on the proxy
connection, so a forwarder needing the GIL would stall them (measured: a device_put waited 20 s
for its connection's first frame, then failed). The parent binds the listening socket (so its port
is known at once) and hands it over; the child ends when the parent does (the pipe on its stdin
closes), however the parent ends. One thread and a selector move the bytes (`Forwarder`): up to
`CHUNK` buffered each way per connection, read only while there is room (backpressure). Half-close:
either side's end of stream, once its bytes are written, ends the other side's sending direction
(a TCP half-close; toward the controller without TLS close_notify, which it reads as the end)
while the other direction goes on; the connection is over when both are. gRPC closes both
directions together anyway. Only processes on this machine reach the loopback port: the trust the
plaintext proxy connection to a local controller had.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import selectors
import signal
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

from .errors import ConnectionFailed
from .tls import TlsConfig

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # bytes per read: a 64 MiB transfer in 64 reads, not thousands
HANDSHAKE_TIMEOUT_S = 10.0
ALPN = ["h2"]  # gRPC's HTTP/2: the controller's TLS handshake requires it


def client_context(tls: TlsConfig) -> ssl.SSLContext:
    ctx = tls.new_client_context()
    ctx.set_alpn_protocols(ALPN)
    return ctx


class _Flow:
    """One direction of one connection: what `src` gave waits in `buf` until `dst` took it."""

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src, self.dst = src, dst
        self.buf = memoryview(bytearray(CHUNK))
        self.start = self.end = 0
        self.eof = False  # `src` ended
        self.done = False  # ... and all of it went out, and `dst`'s sending side was ended

    @property
    def room(self) -> bool:
        return not self.eof and self.end < len(self.buf)

    @property
    def waiting(self) -> bool:
        return self.start < self.end

    def fill(self) -> bool:
        """Reads what `src` has, until it would block or `buf` is full; True when it read anything.
        (A TLS socket gives one record, 16 KiB at most, a call: it is read until it would block.)"""
        if self.start == self.end:
            self.start = self.end = 0
        moved = False
        while self.room:
            try:
                n = self.src.recv_into(self.buf[self.end:])
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            if n == 0:
                self.eof = True
            self.end += n
            moved = True
        return moved

    def drain(self) -> bool:
        """Writes what waits, until `dst` would block; at the end of `src`, ends `dst`'s sending side
        (a TCP half-close: under TLS without close_notify, which the controller sees as its end)."""
        moved = False
        while self.waiting:
            try:
                n = self.dst.send(self.buf[self.start:self.end])
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return moved
            self.start += n
            moved = True
        if self.eof and not self.done:
            self.done = True
            socket.socket.shutdown(self.dst, socket.SHUT_WR)  # not SSLSocket's: that drops the TLS session
            moved = True
        return moved


class _Pair:
    """A local connection and its TLS connection to the controller."""

    def __init__(self, local: socket.socket, remote: ssl.SSLSocket) -> None:
        self.local, self.remote = local, remote
        self.up, self.down = _Flow(local, remote), _Flow(remote, local)

    def step(self) -> bool:
        """Moves what can move both ways; False once the connection is over (both ways ended)."""
        progress = True
        while progress:
            progress = False
            for flow in (self.up, self.down):
                progress |= flow.fill()
                progress |= flow.drain()
        return not (self.up.done and self.down.done)

    def interest(self, sock: socket.socket) -> int:
        out, into = (self.up, self.down) if sock is self.local else (self.down, self.up)
        return (selectors.EVENT_READ if out.room else 0) | (selectors.EVENT_WRITE if into.waiting else 0)

    def close(self) -> None:
        for s in (self.local, self.remote):
            with contextlib.suppress(OSError):
                s.close()


class Forwarder:
    """The child's side: one thread, one selector: accepts on the listener and forwards each
    connection to host:port over TLS. C does the TLS and the copies (`recv_into` a 1 MiB buffer,
    `send` from it); Python only moves offsets (asyncio's streams cost ~2x more CPU per byte)."""

    def __init__(self, host: str, port: int, tls: TlsConfig) -> None:
        self.host, self.port = host, port
        self.server_name = tls.server_name or host
        self.ctx = client_context(tls)
        self.sel = selectors.DefaultSelector()

    def _connect(self, local: socket.socket) -> _Pair | None:
        """The TLS connection for a new local one (its handshake blocks the loop for a moment:
        the jaxlib client opens two connections in all)."""
        try:
            raw = socket.create_connection((self.host, self.port), timeout=HANDSHAKE_TIMEOUT_S)
            remote = self.ctx.wrap_socket(raw, server_hostname=self.server_name)
        except (OSError, ssl.SSLError) as e:
            sys.stderr.write(f"pathways TLS bridge: cannot reach {self.host}:{self.port}: {e}\n")
            local.close()
            return None
        for s in (local, remote):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Pair(local, remote)

    def _watch(self, pair: _Pair) -> None:
        for s in (pair.local, pair.remote):
            events = pair.interest(s)
            key = self.sel.get_map().get(s)
            if key is None and events:
                self.sel.register(s, events, pair)
            elif key is not None and not events:
                self.sel.unregister(s)
            elif key is not None and key.events != events:
                self.sel.modify(s, events, pair)

    def _end(self, pair: _Pair) -> None:
        for s in (pair.local, pair.remote):
            if s in self.sel.get_map():
                self.sel.unregister(s)
        pair.close()

    def run(self, listener: socket.socket) -> None:
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, None)
        while True:
            for key, _ in self.sel.select():
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        local, _ = listener.accept()
                        pair = self._connect(local)
                        if pair is not None:  # a first step: the handshake may have read data already
                            self._advance(pair)
                    continue
                self._advance(key.data)

    def _advance(self, pair: _Pair) -> None:
        try:
            alive = pair.step()
        except (OSError, ssl.SSLError):  # reset, broken pipe, a TLS error: the connection is over
            alive = False
        if alive:
            self._watch(pair)
        else:
            self._end(pair)


class Bridge:
    """127.0.0.1:PORT (plaintext) -> `host`:`port` over TLS; `address` is where to connect."""

    def __init__(self, host: str, port: int, tls: TlsConfig) -> None:
        self.host, self.port = host.strip("[]"), port
        self.tls = tls
        self.server_name = tls.server_name or self.host
        listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.address = f"127.0.0.1:{listener.getsockname()[1]}"
        args = [sys.executable, "-m", "pwctl.tlsbridge", "--fd", str(listener.fileno()), "--host", self.host,
                "--port", str(port), "--ca", str(tls.ca),
                *(["--server-name", tls.server_name] if tls.server_name else []),
                *(["--cert", str(tls.cert), "--key", str(tls.key)] if tls.has_cert else [])]
        root = str(Path(__file__).resolve().parents[1])  # this pwctl, whatever the child's sys.path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
        keep, child_end = os.pipe()[::-1]  # the child reads its end until this process's end closes
        try:
            self.proc = subprocess.Popen(args, stdin=child_end, pass_fds=(listener.fileno(),), env=env,
                                         stdout=subprocess.DEVNULL)
        except OSError as e:
            os.close(keep)
            raise ConnectionFailed(f"cannot start the TLS bridge to {self.host}:{port}: {e}") from None
        finally:
            os.close(child_end)
            listener.close()
        self._keep = keep  # never written; closed when this process ends

    def check(self, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        """One TLS handshake with the controller now, so that a wrong CA, name or a plaintext
        controller is one clear error rather than the jaxlib client's retries until its timeout.
        A controller not listening yet passes (the client waits for it, within its timeout)."""
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except OSError:
            return
        where = f"the server at {self.host}:{self.port}"
        try:
            with client_context(self.tls).wrap_socket(sock, server_hostname=self.server_name):
                return
        except ssl.SSLCertVerificationError as e:
            if "mismatch" in str(e.verify_message):
                raise ConnectionFailed(
                    f"TLS: the certificate of {where} does not name {self.server_name}: issue it with that IP or DNS "
                    "name as a subject alternative name, or set PATHWAYS_TLS_SERVER_NAME to the name it names"
                ) from None
            raise ConnectionFailed(f"TLS: {where} presented a certificate the CA bundle ({self.tls.ca}) does not "
                                   f"sign ({e.verify_message}): give the cluster's CA (PWCTL_TLS_CA)") from None
        except ssl.SSLError as e:
            if "WRONG_VERSION_NUMBER" in str(e) or "record layer failure" in str(e):
                raise ConnectionFailed(f"TLS: {where} does not speak TLS: connect without a CA bundle") from None
            raise ConnectionFailed(f"TLS handshake with {where} failed: {e}") from None
        except OSError:
            return
        finally:
            sock.close()


_bridges: dict[tuple[str, int], Bridge] = {}
_lock = threading.Lock()


def bridge(host: str, port: int, tls: TlsConfig) -> Bridge:
    """The process's bridge to `host:port` (started on first use, after one checked handshake)."""
    with _lock:
        found = _bridges.get((host, port))
        if found is None:
            found = Bridge(host, port, tls)
            try:
                found.check()
            except ConnectionFailed:
                found.proc.kill()
                found.proc.wait()
                raise
            _bridges[(host, port)] = found
        return found


def main() -> None:
    """The child: forwards until its stdin (the parent's pipe) closes."""
    p = argparse.ArgumentParser(prog="python -m pwctl.tlsbridge")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ca", required=True)
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--server-name", default="")
    ns = p.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle; its end ends this

    def parent_gone() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os._exit(0)

    threading.Thread(target=parent_gone, daemon=True).start()
    tls = TlsConfig(ca=ns.ca, cert=ns.cert, key=ns.key, server_name=ns.server_name)
    Forwarder(ns.host, ns.port, tls).run(socket.socket(fileno=ns.fd))


if __name__ == "__main__":
    main()
