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
closes), however the parent ends. One asyncio loop reads up to `CHUNK` at a time and writes with
backpressure (`drain`) both ways. Half-close: the controller's end of a stream ends the local
connection's sending side (`write_eof`) while the other direction drains; the local side's end
closes the TLS connection once its bytes are written (asyncio's TLS transports cannot half-close;
gRPC closes both directions together anyway). Only processes on this machine reach the loopback
port: the trust the plaintext proxy connection to a local controller had.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
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


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copies `src` to `dst` until `src` ends, then ends `dst`'s sending side (or closes it)."""
    try:
        while data := await src.read(CHUNK):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
        else:
            dst.close()
    except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
        dst.close()


class Forwarder:
    """The child's side: accepts on `listener`, forwards each connection to host:port over TLS."""

    def __init__(self, host: str, port: int, tls: TlsConfig) -> None:
        self.host, self.port = host, port
        self.server_name = tls.server_name or host
        self.ctx = client_context(tls)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self.host, self.port, ssl=self.ctx, server_hostname=self.server_name, limit=CHUNK,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
        except (TimeoutError, OSError, ssl.SSLError) as e:
            sys.stderr.write(f"pathways TLS bridge: cannot reach {self.host}:{self.port}: {e}\n")
            writer.close()
            return
        try:
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    async def run(self, listener: socket.socket) -> None:
        server = await asyncio.start_server(self.serve, sock=listener, limit=CHUNK)
        async with server:
            await asyncio.Event().wait()  # until the process ends


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
    listener = socket.socket(fileno=ns.fd)
    asyncio.run(Forwarder(ns.host, ns.port, tls).run(listener))


if __name__ == "__main__":
    main()
