"""A local bridge that lets the jaxlib IFRT proxy client reach a TLS controller.

The jaxlib client (`JAX_PLATFORMS=proxy`) makes only plaintext or ALTS channels
(xla/python/ifrt_proxy/common/grpc_credentials.cc): no TLS. When the controller serves TLS
(pwctl/tls.py), the plugin (pwctl/proxy_plugin.py) starts one `Bridge` for the user's process: a
plaintext listener that the jaxlib client is pointed at (on Linux an abstract Unix socket,
`unix-abstract:NAME`; elsewhere 127.0.0.1 and an ephemeral port), each
accepted connection forwarded byte for byte over TLS (ALPN "h2", the cluster's CA, the client
certificate where one is configured) to the controller. Nothing of gRPC is parsed: the bytes on
the loopback are the bytes inside the TLS stream.

The forwarding runs in a small child process (`python -m pwctl.tlsbridge`), not a thread of the
user's process: jaxlib calls such as `jax.device_put` hold the GIL while they wait on the proxy
connection, so a forwarder needing the GIL would stall them (measured: a device_put waited 20 s
for its connection's first frame, then failed). The parent binds the listening socket (so its port
is known at once) and hands it over, and waits for the child's first line: "ready", or why it
cannot start (one line, raised as ConnectionFailed). The child ends when the parent does: the pipe
on its stdin closes, however the parent ends, or (a child the parent forked holding that pipe) its
parent process is no longer the one it served. One thread and a selector move the bytes
(`Forwarder`): up to `CHUNK` buffered each way per connection, read only while there is room
(backpressure). End of stream: either side's end, once its bytes are written, ends the other
side's sending direction (a TCP half-close) while the other direction goes on; the connection is
over when both are. Toward the controller that is a FIN without TLS close_notify (Python's ssl
cannot send one and keep reading), which an OpenSSL peer takes as the end of the whole connection:
it reads end of stream and then refuses to write. gRPC closes both directions together anyway.

Whom it serves: the bridge presents the user's client certificate (mutual TLS), so whoever can
connect to it acts as this user's client toward the controller. On Linux it accepts only
connections made by its parent process (the Unix socket's SO_PEERCRED: the jaxlib client runs in
it); another process, of this user or another, is refused before anything reaches the controller.
Elsewhere (no SO_PEERCRED) any local process reaching the loopback port gets through, as to a
plaintext controller on this machine; the cluster token is still required of it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import select
import selectors
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from .errors import ConnectionFailed
from .tls import TlsConfig, client_cert_refused, not_tls, refuses_after_handshake, wrong_ca, wrong_name

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # bytes per read: a 64 MiB transfer in 64 reads, not thousands
HANDSHAKE_TIMEOUT_S = 10.0
ALPN = ["h2"]  # gRPC's HTTP/2: the controller's TLS handshake requires it
PEER_CHECK = hasattr(socket, "SO_PEERCRED")  # Linux: the listener is a Unix socket, its callers' pids known
READY = "ready"  # the child's first line once it forwards (anything else: why it cannot)
ACCEPT_RETRY_S = 0.1  # after a failed accept (out of file descriptors...): the loop does not spin
PARENT_POLL_S = 1.0


def _listen() -> tuple[socket.socket, str]:
    """The listening socket and its gRPC address (see the module's docstring)."""
    if PEER_CHECK:
        name = f"pathways-tlsbridge/{os.getpid()}/{secrets.token_hex(8)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(b"\0" + name.encode())
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        return sock, f"unix-abstract:{name}"
    sock = socket.create_server(("127.0.0.1", 0), backlog=64)
    return sock, f"127.0.0.1:{sock.getsockname()[1]}"


def connect_local(address: str, timeout: float | None = None) -> socket.socket:
    """A connection to a bridge's `address` (what the jaxlib client does; for tests and checks)."""
    if address.startswith("unix-abstract:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(b"\0" + address.removeprefix("unix-abstract:").encode())
        except OSError:
            sock.close()
            raise
        return sock
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process that made the Unix-socket connection `sock` (None: not known)."""
    if not PEER_CHECK or sock.family != socket.AF_UNIX:
        return None
    pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    return int(pid)


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

    def __init__(self, host: str, port: int, tls: TlsConfig, serves: int | None = None) -> None:
        self.host, self.port = host, port
        self.server_name = tls.server_name or host
        self.ctx = client_context(tls)
        self.sel = selectors.DefaultSelector()
        self.serves = serves  # the one pid whose connections are forwarded (None: any)

    def _allowed(self, local: socket.socket) -> bool:
        if self.serves is None:
            return True
        try:
            pid = peer_pid(local)
        except OSError:
            return False
        if pid is None or pid == self.serves:
            return True
        sys.stderr.write(f"pathways TLS bridge: refused a connection from pid {pid}: it serves pid {self.serves} "
                         "alone\n")
        return False

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
            if s.family != socket.AF_UNIX:
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
                    self._accept(listener)
                    continue
                self._advance(key.data)

    def _accept(self, listener: socket.socket) -> None:
        try:
            local, _ = listener.accept()
        except BlockingIOError:
            return
        except OSError as e:  # out of file descriptors, a connection reset before it was taken...
            sys.stderr.write(f"pathways TLS bridge: accept failed: {e}\n")
            time.sleep(ACCEPT_RETRY_S)
            return
        if not self._allowed(local):
            local.close()
            return
        pair = self._connect(local)
        if pair is not None:  # a first step: the handshake may have read data already
            self._advance(pair)

    def _advance(self, pair: _Pair) -> None:
        try:
            alive = pair.step()
            if alive:
                self._watch(pair)
        except (OSError, ssl.SSLError):  # reset, broken pipe, a TLS error: the connection is over
            alive = False
        if not alive:
            self._end(pair)


class Bridge:
    """A forwarding child to `host`:`port` over TLS; `address` is where the parent (this process)
    connects: `unix-abstract:NAME` or `127.0.0.1:PORT` (see the module's docstring). Raises
    ConnectionFailed (one line) when the child cannot start."""

    def __init__(self, host: str, port: int, tls: TlsConfig, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.host, self.port = host.strip("[]"), port
        self.tls = tls
        self.server_name = tls.server_name or self.host
        listener, self.address = _listen()
        args = [sys.executable, "-m", "pwctl.tlsbridge", "--fd", str(listener.fileno()), "--host", self.host,
                "--port", str(port), "--serves", str(os.getpid()),
                *(["--ca", str(tls.ca)] if tls.ca else []),
                *(["--server-name", tls.server_name] if tls.server_name else []),
                *(["--cert", str(tls.cert), "--key", str(tls.key)] if tls.has_cert else [])]
        root = str(Path(__file__).resolve().parents[1])  # this pwctl, whatever the child's sys.path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
        keep, child_end = os.pipe()[::-1]  # the child reads its end until this process's end closes
        try:
            self.proc = subprocess.Popen(args, stdin=child_end, pass_fds=(listener.fileno(),), env=env,
                                         stdout=subprocess.PIPE)
        except OSError as e:
            os.close(keep)
            raise ConnectionFailed(f"cannot start the TLS bridge to {self.host}:{port}: {e}") from None
        finally:
            os.close(child_end)
            listener.close()
        self._keep = keep  # never written; closed when this process ends
        self._closed = False
        self._wait_ready(timeout)
        threading.Thread(target=self._watch, name="pw-tlsbridge-watch", daemon=True).start()

    def _wait_ready(self, timeout: float) -> None:
        """Waits for the child's first line; kills it and raises unless it says it forwards."""
        out = self.proc.stdout
        assert out is not None
        with out:
            answered = select.select([out], [], [], timeout)[0]
            line = out.readline().decode(errors="replace").strip() if answered else ""
        if line == READY:
            return
        self.close()
        why = (line.removeprefix("error: ") or f"it exited with status {self.proc.returncode}") if answered \
            else f"no answer in {timeout:g} s"
        raise ConnectionFailed(f"the TLS bridge to {self.host}:{self.port} did not start: {why}")

    def _watch(self) -> None:
        """Says so, one line, when the child ends while this process goes on (killed, crashed):
        the jaxlib client's calls then fail with only "Connection to IFRT proxy server was
        terminated", as at a controller's restart. It is not started again: the jaxlib client
        cannot resume a session, so the program's JAX calls fail from then on either way."""
        status = self.proc.wait()  # waitpid without the GIL
        if not self._closed:
            how = f"exit status {status}"
            if status < 0:
                with contextlib.suppress(ValueError):
                    how = f"killed by {signal.Signals(-status).name}"
            log.error("the TLS bridge to %s:%d (pid %d, pwctl/tlsbridge.py) ended (%s): this process's JAX "
                      "session with the cluster is over, its calls fail from now on", self.host, self.port,
                      self.proc.pid, how)

    def close(self) -> None:
        """Ends the child now (it would end with this process anyway)."""
        self._closed = True
        with contextlib.suppress(OSError):
            os.close(self._keep)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def check(self, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        """One TLS handshake with the controller now (and the HTTP/2 preface, which a controller
        that wants a client certificate answers by closing), so that a wrong CA, name, a plaintext
        controller or a missing client certificate is one clear error rather than the jaxlib
        client's retries until its timeout.
        A controller not listening yet passes (the client waits for it, within its timeout)."""
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except OSError:
            return
        where = f"the server at {self.host}:{self.port}"
        try:
            with client_context(self.tls).wrap_socket(sock, server_hostname=self.server_name) as conn:
                refused = refuses_after_handshake(conn, timeout)
        except ssl.SSLCertVerificationError as e:
            if "mismatch" in str(e.verify_message):
                raise ConnectionFailed(wrong_name(where, self.server_name)) from None
            raise ConnectionFailed(wrong_ca(where, self.tls, str(e.verify_message))) from None
        except ssl.SSLError as e:
            if "WRONG_VERSION_NUMBER" in str(e) or "record layer failure" in str(e):
                raise ConnectionFailed(not_tls(where)) from None
            raise ConnectionFailed(f"TLS handshake with {where} failed: {e}") from None
        except OSError:
            return
        finally:
            sock.close()
        if refused:  # mutual TLS: no client certificate, or one the server does not take
            raise ConnectionFailed(client_cert_refused(f"{self.host}:{self.port}", "server", self.tls))


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
                found.close()
                raise
            _bridges[(host, port)] = found
        return found


def _exit_with(parent: int) -> None:
    """Ends this process once the parent's pipe (stdin) closes or `parent` is no longer its parent
    (it ended, and a child it forked holds the pipe on)."""
    with contextlib.suppress(OSError):
        while os.getppid() == parent:
            if select.select([0], [], [], PARENT_POLL_S)[0] and not os.read(0, 4096):
                break
    os._exit(0)


def main() -> None:
    """The child: says "ready" (or why not, one line) on stdout, then forwards until its parent ends."""
    p = argparse.ArgumentParser(prog="python -m pwctl.tlsbridge")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--serves", type=int, required=True, help="the parent's pid: its connections alone")
    p.add_argument("--ca")
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--server-name", default="")
    ns = p.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle; its end ends this
    threading.Thread(target=_exit_with, args=(ns.serves,), daemon=True).start()
    try:
        listener = socket.socket(fileno=ns.fd)
        tls = TlsConfig(ca=ns.ca, cert=ns.cert, key=ns.key, server_name=ns.server_name)
        forwarder = Forwarder(ns.host, ns.port, tls, serves=ns.serves if PEER_CHECK else None)
    except Exception as e:  # one line to the parent, whatever it is
        sys.stdout.write(f"error: {e}\n")
        sys.stdout.flush()
        sys.exit(2)
    sys.stdout.write(READY + "\n")
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing more for the parent, which closed its end
    forwarder.run(listener)


if __name__ == "__main__":
    main()
