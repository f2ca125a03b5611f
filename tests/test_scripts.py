"""The README's two commands install only when something is missing or changed (issue 30, item 7),
so they work offline once installed: scripts/ensure_venv.sh, which demo.sh and test.sh source,
against a real virtual environment made without pip, where any install attempt fails at once
(as one would offline) and says so."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of the project's pyproject.toml and scripts/ensure_venv.sh, with a .venv (no pip)
    that imports pwctl from this checkout."""
    root = tmp_path / "proj"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copy(REPO / "scripts" / "ensure_venv.sh", root / "scripts" / "ensure_venv.sh")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / ".venv")], check=True, timeout=60)
    version = sysconfig.get_python_version()
    site = root / ".venv" / "lib" / f"python{version}" / "site-packages"
    (site / "checkout.pth").write_text(str(REPO) + "\n")
    return root


def ensure(root: Path, extras: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root)}  # no PYTHONPATH: pwctl comes from the .venv
    return subprocess.run(["bash", "-c", f'set -euo pipefail; EXTRAS="{extras}"; . scripts/ensure_venv.sh; echo ok'],
                          cwd=root, env=env, capture_output=True, text=True, timeout=60)


def stamp(root: Path, name: str, content: str) -> None:
    (root / ".venv" / name).write_text(content + "\n")


@pytest.mark.timeout(120)
def test_installs_only_when_missing_or_changed(project: Path) -> None:
    want = hashlib.sha256((project / "pyproject.toml").read_bytes()).hexdigest()
    log = project / ".venv" / "install.log"

    # nothing recorded: it installs (here it cannot: no pip, as no network would fail it)
    r = ensure(project, "")
    assert r.returncode == 1 and "No module named pip" in r.stderr, r.stdout + r.stderr
    log.unlink()

    # test.sh's install (dev and bench) covers what demo.sh and a dev install ask for: nothing is run
    stamp(project, ".installed-dev-bench", f"{want} dev,bench")
    for extras in ("", "[dev]", "[dev,bench]"):
        r = ensure(project, extras)
        assert (r.returncode, r.stdout) == (0, "ok\n"), (extras, r.stderr)
        assert not log.exists()
    # stamps of the earlier format (the hash; the extras in the file name) still count
    (project / ".venv" / ".installed-dev-bench").unlink()
    stamp(project, ".installed-dev", want)
    assert ensure(project, "[dev]").returncode == 0 and not log.exists()
    assert ensure(project, "").returncode == 0 and not log.exists()
    # an extra no install had: it installs
    r = ensure(project, "[dev,bench]")
    assert r.returncode == 1 and "No module named pip" in r.stderr
    log.unlink()

    # pyproject.toml changed since: it installs
    with open(project / "pyproject.toml", "a") as f:
        f.write("# changed\n")
    r = ensure(project, "[dev]")
    assert r.returncode == 1 and "No module named pip" in r.stderr


def test_demo_and_test_scripts_source_it() -> None:
    for name in ("demo.sh", "test.sh"):
        text = (REPO / "scripts" / name).read_text()
        assert ". scripts/ensure_venv.sh" in text and "pip install" not in text, name
