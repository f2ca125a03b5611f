"""Where a cluster started here leaves its TLS settings for clients, as it leaves its token: the
CA bundle (`tls-ca.pem`), with mutual TLS a client certificate and key (copies of the cluster's
own: clients here run as the same user, who can read them anyway), and the name to check
(`tls-server-name`). A cluster started without TLS removes them, so local clients speak
plaintext again (pwctl/settings.py reads them)."""

from __future__ import annotations

import os
import shutil

from .. import paths
from ..tls import TlsConfig


def publish(tls: TlsConfig | None) -> None:
    files = {paths.tls_ca_path(): tls.ca if tls else None,
             paths.tls_client_cert_path(): tls.cert if tls and tls.require_client_cert else None,
             paths.tls_client_key_path(): tls.key if tls and tls.require_client_cert else None}
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
