"""The client stands without the server: `pwctl` and a `pw` program never import `server`.

Each command runs in a subprocess whose `sitecustomize` puts a finder first on `sys.meta_path`
that refuses `server` and every `server.*` module, so any such import, however indirect, fails
the command. (`pwctl up` starting `python -m server.controller` is a subprocess, not an import.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, LocalCluster

BLOCKER = textwrap.dedent("""
    import sys

    class _NoServer:
        def find_spec(self, name, path=None, target=None):
            if name == "server" or name.startswith("server."):
                raise ImportError(f"the client imported {name!r}: pwctl must not depend on server/")
            return None

    sys.meta_path.insert(0, _NoServer())
""")


@pytest.fixture(scope="module")
def blocked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the blocking sitecustomize.py."""
    folder = tmp_path_factory.mktemp("no-server")
    (folder / "sitecustomize.py").write_text(BLOCKER)
    return folder


def run(blocked: Path, env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(env, PYTHONPATH=os.pathsep.join([str(blocked), str(REPO)]))
    return subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_the_blocker_blocks(blocked: Path, module_cluster: LocalCluster) -> None:
    r = run(blocked, module_cluster.env(), "-c", "import server.paths")
    assert r.returncode != 0 and "pwctl must not depend on server/" in r.stderr


def test_pwctl_help_and_a_listing_run_without_server(blocked: Path, module_cluster: LocalCluster) -> None:
    r = run(blocked, module_cluster.env(), "-m", "pwctl.cli.main", "--help")
    assert r.returncode == 0, r.stderr
    assert "Usage" in r.stdout and "island" in r.stdout
    r = run(blocked, module_cluster.env(), "-m", "pwctl.cli.main", "island", "list", "-o", "name")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["a", "b"]


def test_a_pw_program_runs_without_server(blocked: Path, module_cluster: LocalCluster) -> None:
    program = textwrap.dedent("""
        import sys
        import numpy as np
        import pwctl as pw

        s = pw.make_virtual_device_set().add_slice(devices=2)
        double = pw.pmap(lambda x: x * 2.0, devices=s.devices)
        print(np.asarray(double(np.array([1.0, 2.0]))).tolist())
        print(sorted(m for m in sys.modules if m == "server" or m.startswith("server.")))
    """)
    r = run(blocked, module_cluster.env(), "-c", program)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-2:] == ["[2.0, 4.0]", "[]"]
