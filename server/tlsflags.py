"""The TLS flags of `python -m server.controller` and `python -m server.worker` (pwctl/tls.py)."""

from __future__ import annotations

import argparse

from pwctl.errors import InvalidArgument
from pwctl.paths import split_address
from pwctl.tls import ENV_CA, ENV_CERT, ENV_KEY, ENV_REQUIRE_CLIENT_CERT, ENV_SERVER_NAME, TlsConfig, server_config


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS (README.md, 'TLS'; off unless a certificate is given)")
    g.add_argument("--tls-cert", default=None, metavar="PEM",
                   help=f"this host's certificate: serve TLS only, and present it to peers (default ${ENV_CERT})")
    g.add_argument("--tls-key", default=None, metavar="PEM", help=f"its private key (default ${ENV_KEY})")
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help=f"the CA bundle that signs the cluster's certificates (default ${ENV_CA})")
    g.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="the name to check in peers' certificates instead of the host dialled, for certificates "
                        f"issued to one cluster-wide name (default ${ENV_SERVER_NAME})")
    g.add_argument("--tls-require-client-cert", action="store_true",
                   help="mutual TLS: callers must present a certificate the CA signs "
                        f"(default ${ENV_REQUIRE_CLIENT_CERT}=1; off: the cluster token authenticates callers)")
    g.add_argument("--health-listen", default="", metavar="HOST:PORT",
                   help="also answer the gRPC health service alone, plaintext, here: Kubernetes' grpc probes "
                        "cannot speak TLS (default: none)")


def tls_from_flags(p: argparse.ArgumentParser, ns: argparse.Namespace) -> TlsConfig | None:
    """The process's TLS (None: plaintext) from the flags `add_tls_flags` added, `--health-listen`
    checked too; a bad set ends the process as argparse does (one line, exit 2)."""
    try:
        if ns.health_listen:
            split_address(ns.health_listen)
        return server_config(ns.tls_cert, ns.tls_key, ns.tls_ca, ns.tls_server_name, ns.tls_require_client_cert)
    except (InvalidArgument, ValueError) as e:
        p.error(str(e))
