"""Throwaway certificate authorities and certificates for the TLS tests and benchmarks, made with
the `openssl` CLI (the same commands README.md's "TLS" section gives operators): a CA, and
certificates it signs for a list of subject alternative names (IP addresses and DNS names),
usable as server and as client certificates. tests/tlscerts.py re-exports it."""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Cert:
    cert: Path
    key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_ca(folder: Path, name: str = "ca") -> Cert:
    """A self-signed CA: `<name>.pem` and `<name>.key` in `folder`."""
    if shutil.which("openssl") is None:
        raise FileNotFoundError("the openssl command is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=pathways test {name}",
             cwd=folder)
    return Cert(folder / f"{name}.pem", folder / f"{name}.key")


def make_cert(ca: Cert, folder: Path, name: str, sans: list[str]) -> Cert:
    """A certificate for `sans` (IP addresses or DNS names) signed by `ca`, for servers and clients."""
    entries = []
    for san in sans:
        try:
            ipaddress.ip_address(san)
            entries.append(f"IP:{san}")
        except ValueError:
            entries.append(f"DNS:{san}")
    folder.mkdir(parents=True, exist_ok=True)
    ext = folder / f"{name}.ext"
    ext.write_text(f"subjectAltName={','.join(entries)}\n"
                   "extendedKeyUsage=serverAuth,clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=folder)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca.cert), "-CAkey", str(ca.key), "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", ext.name, cwd=folder)
    return Cert(folder / f"{name}.pem", folder / f"{name}.key")
