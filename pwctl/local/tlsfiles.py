"""Where a cluster started here leaves its TLS settings for clients, as it leaves its token: the
CA bundle (`tls-ca.pem`), with mutual TLS the local clients' own certificate and key where one is
given (`--tls-client-cert`/`--tls-client-key`: `tls-client.pem`/`.key`; never the host's own key,
which serves the cluster: a client's key must not be one the servers prove themselves with), and
the name to check (`tls-server-name`). A cluster started without TLS, or with mutual TLS and no
client pair, removes what it does not leave, so local clients speak plaintext again or are told
they need a certificate (pwctl/settings.py reads them)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .. import paths
from ..errors import InvalidArgument
from ..tls import TlsConfig


def client_pair(tls: TlsConfig | None, cert: str | None, key: str | None) -> TlsConfig | None:
    """The certificate and key clients here present to a cluster with mutual TLS, checked (both
    given, the key the certificate's, neither the server's own); None where none is given. Raises
    InvalidArgument (one line) before anything starts."""
    if not cert and not key:
        return None
    if tls is None or not tls.require_client_cert:
        raise InvalidArgument("--tls-client-cert and --tls-client-key are for mutual TLS (--tls-require-client-cert)")
    if not cert or not key:
        raise InvalidArgument("--tls-client-cert and --tls-client-key go together (the local clients' certificate "
                              "and its private key)")
    try:
        pair = TlsConfig(ca=tls.ca, cert=os.path.abspath(cert), key=os.path.abspath(key))
    except InvalidArgument as e:
        raise InvalidArgument(str(e).replace("--tls-cert", "--tls-client-cert").replace(
            "--tls-key", "--tls-client-key")) from None
    assert tls.cert and tls.key and pair.cert and pair.key  # a server's config has both (check_server)
    if _same(pair.key, tls.key) or _same(pair.cert, tls.cert):
        raise InvalidArgument("--tls-client-cert/--tls-client-key: that is the server's own certificate and key; "
                              "give clients here a certificate of their own, with its own key, that the CA signs")
    return pair


def _same(a: str, b: str) -> bool:
    return os.path.samefile(a, b) or Path(a).read_bytes() == Path(b).read_bytes()


def publish(tls: TlsConfig | None, client: TlsConfig | None = None) -> None:
    """Leaves `tls`'s CA and name, and with mutual TLS the `client` pair (`client_pair`), in the
    data directory; removes what it does not leave."""
    mutual = tls is not None and tls.require_client_cert and client is not None
    files = {paths.tls_ca_path(): tls.ca if tls else None,
             paths.tls_client_cert_path(): client.cert if mutual and client else None,
             paths.tls_client_key_path(): client.key if mutual and client else None}
    for dest, source in files.items():
        if source is None:
            dest.unlink(missing_ok=True)
            continue
        if os.path.exists(dest) and os.path.samefile(source, dest):
            continue
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
        paths.private_file(tmp)
        shutil.copyfile(source, tmp)
        tmp.replace(dest)
    name = paths.tls_server_name_path()
    if tls is not None and tls.server_name:
        name.write_text(tls.server_name + "\n")
    else:
        name.unlink(missing_ok=True)
