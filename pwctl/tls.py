"""TLS for every gRPC link: the one place credentials are built (README.md, "TLS").

Off unless configured: with no `TlsConfig` every channel and port is plaintext, as before, and
nothing here runs. Configured, the same PEM files serve both sides:

- a server (controller, worker) serves only TLS on its port with its certificate and key, and
  with `require_client_cert` also requires and checks a client certificate signed by the CA
  (mutual TLS; off by default: the bearer token authenticates callers, TLS keeps it and the arrays
  private and proves the server's identity);
- a client checks the server's certificate against the CA and, where it has a certificate and
  key, presents them (servers and workers present their own toward the controller and each other).

Hostnames: the server's certificate must name the address the client dialled (an IP SAN for
`10.0.0.5:7070`, a DNS SAN for `ctl.example:7070`), or `server_name` overrides the name checked
(`grpc.ssl_target_name_override`) for clusters whose certificates name one cluster-wide name.

Servers read PATHWAYS_TLS_{CERT,KEY,CA,SERVER_NAME,REQUIRE_CLIENT_CERT} (their flags win);
clients (`pwctl`, the `pw` library, job drivers) PWCTL_TLS_{CA,CERT,KEY,SERVER_NAME}, found in
`pwctl.settings`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgument

if TYPE_CHECKING:
    import ssl

    import grpc

ENV_CERT = "PATHWAYS_TLS_CERT"
ENV_KEY = "PATHWAYS_TLS_KEY"
ENV_CA = "PATHWAYS_TLS_CA"
ENV_SERVER_NAME = "PATHWAYS_TLS_SERVER_NAME"
ENV_REQUIRE_CLIENT_CERT = "PATHWAYS_TLS_REQUIRE_CLIENT_CERT"
PROBE_TIMEOUT_S = 1.0
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def _read(path: str, what: str) -> bytes:
    try:
        data = open(path, "rb").read()  # noqa: SIM115 (small files, read once)
    except OSError as e:
        raise InvalidArgument(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if b"-----BEGIN" not in data:
        raise InvalidArgument(f"{what}: {path} is not a PEM file (no '-----BEGIN' line)")
    return data


def _check_loadable(cert: str | None, key: str | None, ca: bytes | None) -> None:
    """Raises InvalidArgument (one line) unless the certificate and key make a pair and the CA
    bundle holds a certificate: gRPC would otherwise fail only when it serves or connects, a
    server with 'cannot listen'."""
    import ssl

    if cert and key:
        try:  # an encrypted key: refused (an empty password), not a prompt on the terminal
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
        except ssl.SSLError as e:
            if e.reason == "KEY_VALUES_MISMATCH":
                raise InvalidArgument(f"--tls-key: {key} is not the private key of --tls-cert {cert}") from None
            raise InvalidArgument(f"--tls-cert/--tls-key: {cert} and {key} are not a certificate and its unencrypted "
                                  f"private key ({e.reason or e.library or e})") from None
    if ca:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=ca.decode(errors="replace"))
        except (ssl.SSLError, ValueError) as e:
            raise InvalidArgument(f"--tls-ca: no usable certificate in the CA bundle ({e})") from None


@dataclass(frozen=True)
class TlsConfig:
    """The PEM files of one side of a link. `ca`: the bundle that signs the peers' certificates;
    `cert`/`key`: this side's own (a server's, or a client's for mutual TLS)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str = ""  # the name checked in servers' certificates instead of the dialled host
    require_client_cert: bool = False  # a server: mutual TLS
    _pem: dict[str, bytes] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise InvalidArgument("--tls-cert and --tls-key go together (the certificate and its private key)")
        for name, what in (("ca", "--tls-ca"), ("cert", "--tls-cert"), ("key", "--tls-key")):
            path = getattr(self, name)
            if path:
                self._pem[name] = _read(path, what)
        _check_loadable(self.cert, self.key, self._pem.get("ca"))

    @property
    def has_cert(self) -> bool:
        return "cert" in self._pem

    def check_server(self) -> None:
        """Raises unless this config can serve: a certificate and key, and the CA (to check the peers
        a server connects to, and client certificates)."""
        if not self.has_cert:
            raise InvalidArgument("TLS needs --tls-cert and --tls-key (this host's certificate and its key)")
        if "ca" not in self._pem:
            raise InvalidArgument("--tls-cert needs --tls-ca: the CA bundle that signs the cluster's certificates "
                                  "(checks the controller and workers this process connects to)")

    @functools.cached_property
    def channel_credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(self._pem.get("ca"), self._pem.get("key"), self._pem.get("cert"))

    def server_credentials(self) -> grpc.ServerCredentials:
        import grpc

        self.check_server()
        return grpc.ssl_server_credentials([(self._pem["key"], self._pem["cert"])],
                                           root_certificates=self._pem["ca"] if self.require_client_cert else None,
                                           require_client_auth=self.require_client_cert)

    @functools.cached_property
    def ssl_server_context(self) -> ssl.SSLContext:
        """A Python `ssl` context serving this certificate (the workers' TCP transfer link)."""
        import ssl

        self.check_server()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.cert), str(self.key))
        if self.require_client_cert:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cadata=self._pem["ca"].decode())
        return ctx

    @functools.cached_property
    def ssl_client_context(self) -> ssl.SSLContext:
        """A Python `ssl` context checking servers against the CA, presenting this side's certificate."""
        return self.new_client_context()

    def new_client_context(self) -> ssl.SSLContext:
        """A fresh `ssl_client_context` (one to set ALPN on: pwctl/tlsbridge.py)."""
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(cadata=self._pem["ca"].decode()) if "ca" in self._pem else ctx.load_default_certs()
        if self.has_cert:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx

    def wrap_client(self, sock: socket.socket, host: str) -> ssl.SSLSocket:
        """`sock` (connected to `host`) after a TLS handshake checking `server_name` or `host`."""
        return self.ssl_client_context.wrap_socket(sock, server_hostname=self.server_name or host.strip("[]"))

    def options(self) -> list[tuple[str, Any]]:
        """Channel options it adds (the server name override)."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def args(self) -> list[str]:
        """The same settings as `python -m server.controller|worker` flags (for processes it starts)."""
        out: list[str] = []
        for flag, value in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca),
                            ("--tls-server-name", self.server_name)):
            if value:
                out += [flag, os.path.abspath(value) if flag != "--tls-server-name" else value]
        if self.require_client_cert:
            out.append("--tls-require-client-cert")
        return out


def server_config(cert: str | None = None, key: str | None = None, ca: str | None = None,
                  server_name: str | None = None, require_client_cert: bool = False) -> TlsConfig | None:
    """A server's TLS from its flags, the PATHWAYS_TLS_* variables filling what they leave out; None
    (plaintext) when neither names a certificate. Raises InvalidArgument (one line) on a bad set."""
    env = os.environ
    cert, key, ca = cert or env.get(ENV_CERT) or None, key or env.get(ENV_KEY) or None, ca or env.get(ENV_CA) or None
    require = require_client_cert or env.get(ENV_REQUIRE_CLIENT_CERT, "").strip().lower() in ("1", "true", "yes")
    if not cert and not key:
        if require:
            raise InvalidArgument("--tls-require-client-cert needs --tls-cert, --tls-key and --tls-ca")
        return None
    if require and not ca:
        raise InvalidArgument("--tls-require-client-cert needs --tls-ca (the CA that signs client certificates)")
    cert, key, ca = (os.path.abspath(p) if p else None for p in (cert, key, ca))  # kept in cluster.json, passed on
    config = TlsConfig(ca=ca, cert=cert, key=key, server_name=server_name or env.get(ENV_SERVER_NAME, ""),
                       require_client_cert=require)
    config.check_server()
    return config


def channel(address: str, options: list[tuple[str, Any]], tls: TlsConfig | None) -> grpc.Channel:
    """A blocking channel to `address`: plaintext without `tls`."""
    import grpc

    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials, options=[*options, *tls.options()])


def aio_channel(address: str, options: list[tuple[str, Any]], tls: TlsConfig | None) -> grpc.aio.Channel:
    """An asyncio channel to `address`: plaintext without `tls`."""
    from grpc import aio

    if tls is None:
        return aio.insecure_channel(address, options=options)
    return aio.secure_channel(address, tls.channel_credentials, options=[*options, *tls.options()])


def add_port(server: Any, listen: str, tls: TlsConfig | None) -> int:
    """Binds `server` (grpc or grpc.aio) to `listen`: TLS only when `tls`; the port, 0 when it cannot."""
    try:
        if tls is None:
            return int(server.add_insecure_port(listen))
        return int(server.add_secure_port(listen, tls.server_credentials()))
    except RuntimeError:  # grpcio raises instead of returning 0 when the port is taken
        return 0


# ---------------------------------------------------------------- failures, said in one line
def wrong_ca(where: str, tls: TlsConfig | None, why: str = "") -> str:
    """The advice when `where` ("the server at H:P") presented a certificate the CA does not sign."""
    ca = tls.ca if tls is not None and tls.ca else "the system's roots"
    return (f"TLS: {where} presented a certificate the CA bundle ({ca}) does not sign{f' ({why})' if why else ''}: "
            "give the cluster's CA (--tls-ca, PWCTL_TLS_CA)")


def wrong_name(where: str, name: str) -> str:
    """The advice when the certificate of `where` does not name `name`, the name checked."""
    return (f"TLS: the certificate of {where} does not name {name}: issue it with that IP or DNS name as a "
            "subject alternative name, or check the name it names instead (a client: PWCTL_TLS_SERVER_NAME; "
            "a server: --tls-server-name, PATHWAYS_TLS_SERVER_NAME)")


def not_tls(where: str) -> str:
    return f"TLS: {where} does not speak TLS (started without --tls-cert?): connect without a CA bundle"


def explain(details: str, address: str, peer: str, tls: TlsConfig | None) -> str | None:
    """What a failed connection's gRPC message says about TLS, as advice; None when nothing."""
    where = f"the {peer} at {address}"
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return wrong_ca(where, tls)
    if "Hostname Verification" in details or "Peer name" in details:
        return wrong_name(where, (tls.server_name if tls is not None else "") or address.rpartition(":")[0])
    if "WRONG_VERSION_NUMBER" in details or "PACKET_LENGTH_TOO_LONG" in details:
        return not_tls(where)
    if "Tls handshake failed" in details or "Handshake failed" in details or "SSL_ERROR" in details:
        return f"TLS handshake with {where} failed: {details.rpartition('SSL_ERROR_SSL: ')[2] or details}"
    return None


def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """What a TLS handshake with `address` shows, for an error message only (no certificate is
    checked; nothing but the HTTP/2 preface is sent): "tls" (it speaks TLS), "client-cert" (it
    wants a client certificate), or None (no TLS, or no answer)."""
    import ssl

    try:
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except (OSError, ValueError):
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    with contextlib.closing(sock):
        try:
            conn = ctx.wrap_socket(sock)
        except (OSError, ssl.SSLError):
            return None
        with contextlib.closing(conn):
            return "client-cert" if refuses_after_handshake(conn, timeout) else "tls"


def refuses_after_handshake(conn: ssl.SSLSocket, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True when the server at the other end of `conn` (TLS, handshake done) closes it on the
    HTTP/2 preface instead of answering with its settings: what a gRPC server that wants a client
    certificate (or refuses the one it got) does, TLS 1.3 checking it after the handshake."""
    import ssl

    try:
        conn.settimeout(timeout)
        conn.sendall(H2_PREFACE)
        return not conn.recv(1)
    except ssl.SSLError:
        return True
    except OSError:  # no answer in time, a reset: nothing known
        return False


def client_cert_refused(address: str, peer: str, tls: TlsConfig) -> str:
    """What to say when the {peer} at `address` refused this TLS client for its certificate."""
    if not tls.has_cert:
        return (f"the {peer} at {address} requires a client certificate (mutual TLS): set PWCTL_TLS_CERT and "
                "PWCTL_TLS_KEY to one the cluster's CA signs")
    return f"the {peer} at {address} refused this client's certificate (not signed by its CA?)"


def diagnose(details: str, address: str, peer: str, tls: TlsConfig | None) -> str | None:
    """`explain`, and where the message says only that the server closed the connection, a probe
    of what the server wants: TLS (this side spoke plaintext) or a client certificate."""
    told = explain(details, address, peer, tls)
    if told is not None or ("Socket closed" not in details and "Connection reset" not in details):
        return told
    seen = probe(address)
    if seen == "tls" and tls is None:
        return (f"the {peer} at {address} requires TLS: give the cluster's CA bundle (--tls-ca, PWCTL_TLS_CA, "
                "or tls_ca in the config file)")
    if seen != "client-cert":
        return None
    if tls is None:
        return (f"the {peer} at {address} requires TLS with a client certificate: give the cluster's CA "
                "(PWCTL_TLS_CA) and a certificate it signs (PWCTL_TLS_CERT, PWCTL_TLS_KEY)")
    return client_cert_refused(address, peer, tls)
