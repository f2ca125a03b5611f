"""`pwctl` starts light: reading the command line imports Typer and the command modules, not gRPC,
the protocol stubs, the pydantic views, Rich, `pwctl.local` (psutil) or platformdirs; each command imports
what it uses when it runs (pwctl/cli/common.py says why). `pwctl --help` then takes a fraction
of the time, and so does every one of the hundreds of pwctl calls the suite makes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.timeout(60)

HEAVY = ("grpc", "google.protobuf", "pydantic", "rich", "schemas", "psutil", "jax", "pwctl.local", "pwctl.client",
         "platformdirs")

LOADED = """
import json, sys
{setup}
print(json.dumps(sorted(m for m in sys.modules if m.startswith({heavy!r}))))
"""


RUN = """
from pwctl.cli.main import main
try:
    main({argv!r})
except SystemExit:
    pass
"""


def loaded(setup: str) -> list[str]:
    """The heavy modules (HEAVY and their submodules) loaded after running `setup` in a fresh Python."""
    heavy = tuple(h for m in HEAVY for h in (m, m + "."))
    code = LOADED.format(setup=setup, heavy=heavy)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    out: list[str] = json.loads(r.stdout.strip().splitlines()[-1])
    return [m for m in out if m in HEAVY or m.startswith(tuple(h + "." for h in HEAVY))]


def test_the_cli_loads_without_grpc_pydantic_rich_or_the_stubs() -> None:
    assert loaded("from pwctl.cli.app import app") == []


def test_help_builds_every_command_without_them() -> None:
    # --help builds every command from its signature, as any invocation does
    assert loaded(RUN.format(argv=["--help"])) == []


def test_a_command_loads_what_it_uses_when_it_runs() -> None:
    # the same check on a command that calls the controller (none listens at port 1: exit 1)
    found = loaded(RUN.format(argv=["slice", "list", "--server", "127.0.0.1:1"]))
    assert "grpc" in found and "pwctl.client" in found, found
