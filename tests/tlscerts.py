"""The TLS tests' certificates (bench/tlscerts.py); a machine without `openssl` skips them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.tlscerts import Cert, make_cert
from bench.tlscerts import make_ca as _make_ca

__all__ = ["Cert", "make_ca", "make_cert"]


def make_ca(folder: Path, name: str = "ca") -> Cert:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    return _make_ca(folder, name)
