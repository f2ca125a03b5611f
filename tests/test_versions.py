"""The installed JAX, checked where it matters (issue 30): the controller and the workers check the
installed jax/jaxlib against the range this release supports before anything else, and refuse to
start outside it with one clear line (PATHWAYS_ALLOW_UNTESTED_JAX=1 starts anyway, with a
warning). pyproject.toml declares the same range. Real processes: an older jax "installed" in
front of the real one (a dist-info on PYTHONPATH, as a stray install would shadow it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import REPO, base_env, free_port, run_pwctl

from pwctl.errors import FailedPrecondition
from pwctl.version import ALLOW_UNTESTED_JAX, JAX_SUPPORTED, check_jax, installed, jax_problems


def test_the_supported_range_is_pyprojects() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    lo, hi = (".".join(map(str, v)) for v in JAX_SUPPORTED)
    for dist in ("jax", "jaxlib"):
        spec = next(d for d in deps if re.match(rf"{dist}\s*[><=]", d))
        assert spec.replace(" ", "") == f"{dist}>={lo},<{hi}", spec
    # the README names the tested versions
    readme = (REPO / "README.md").read_text()
    assert "0.10.2" in readme and "0.11.2" in readme and ALLOW_UNTESTED_JAX in readme


def test_problems_name_the_version_and_what_to_install() -> None:
    assert jax_problems({"jax": "0.10.2", "jaxlib": "0.10.2"}) == []
    assert jax_problems({"jax": "0.11.2", "jaxlib": "0.11.2"}) == []
    assert jax_problems() == []  # what this machine has installed
    old = jax_problems({"jax": "0.9.0", "jaxlib": "0.10.2"})
    assert len(old) == 1 and old[0].startswith("jax 0.9.0 is installed, but this Pathways release supports "
                                                "jax>=0.10.2,<0.12 (tested with 0.10.2")
    assert "pip install 'jax>=0.10.2,<0.12' 'jaxlib>=0.10.2,<0.12'" in old[0] and ALLOW_UNTESTED_JAX in old[0]
    new = jax_problems({"jax": "0.12.0", "jaxlib": "0.12.0"})
    assert [p.split(" is installed")[0] for p in new] == ["jax 0.12.0", "jaxlib 0.12.0"]
    assert jax_problems({"jax": "0.10.2", "jaxlib": None}) == ["jaxlib is not installed: pip install "
                                                                "'jaxlib>=0.10.2,<0.12'"]
    mixed = jax_problems({"jax": "0.11.2", "jaxlib": "0.10.2"})
    assert len(mixed) == 1 and "jax 0.11.2 and jaxlib 0.10.2 are from different releases" in mixed[0]
    assert jax_problems({"jax": "dev", "jaxlib": "0.10.2"})[0].startswith("jax dev is installed")


def test_check_refuses_unless_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pwctl.version.installed", lambda d: "0.9.0" if d == "jax" else "0.10.2")
    monkeypatch.delenv(ALLOW_UNTESTED_JAX, raising=False)
    with pytest.raises(FailedPrecondition, match=r"^the worker not started: jax 0\.9\.0 is installed"):
        check_jax("the worker")
    monkeypatch.setenv(ALLOW_UNTESTED_JAX, "1")
    (warning,) = check_jax("the worker")
    assert warning.startswith("jax 0.9.0 is installed")
    assert warning.endswith(f"(starting anyway: {ALLOW_UNTESTED_JAX} is set)")


def shadowed_env(home: Path, tmp_path: Path, **extra: str) -> dict[str, str]:
    """An environment where `jax` 0.9.0 is what the metadata says is installed."""
    shadow = tmp_path / "shadow"
    info = shadow / "jax-0.9.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: jax\nVersion: 0.9.0\n")
    env = base_env(home, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shadow), str(REPO), env.get("PYTHONPATH", "")]))
    env.pop(ALLOW_UNTESTED_JAX, None)
    return env


@pytest.mark.timeout(120)
def test_controller_worker_and_up_refuse_another_jax(pw_home: Path, tmp_path: Path) -> None:
    env = shadowed_env(pw_home, tmp_path)
    probe = subprocess.run([sys.executable, "-c", "from pwctl.version import installed; print(installed('jax'))"],
                           env=env, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert probe.stdout.strip() == "0.9.0", probe.stderr  # the shadow is what the metadata says
    assert installed("jax") != "0.9.0"  # and only there

    address = f"127.0.0.1:{free_port()}"
    for module, args in (("server.controller", ["--listen", address, "--db", f"sqlite:///{tmp_path / 'a.db'}",
                                                "--metrics-listen", "off"]),
                         ("server.worker", ["--server", address, "--island", "a", "--devices", "1"])):
        r = subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        what = "controller" if module == "server.controller" else "worker"
        assert r.returncode == 2, (module, r.stdout, r.stderr)
        assert r.stderr.strip().splitlines() == [
            f"error: the {what} not started: jax 0.9.0 is installed, but this Pathways release supports "
            "jax>=0.10.2,<0.12 (tested with 0.10.2 (CPU, Python 3.11) and 0.11.2 (an H100, Python 3.12)): the "
            "IFRT proxy protocol and multi-host groups depend on jaxlib's version; install a supported one (pip "
            f"install 'jax>=0.10.2,<0.12' 'jaxlib>=0.10.2,<0.12'), or set {ALLOW_UNTESTED_JAX}=1 to start anyway"]

    # `pwctl up`, as a user runs it: one clear error naming the installed jax, nothing left running
    try:
        r = run_pwctl("up", "--islands", "1", "--devices", "1", "--listen", address, env=env, timeout=90)
        assert r.returncode == 4, r.stdout + r.stderr  # rejected: checked before anything is spawned
        assert r.stderr.strip().splitlines()[-1].startswith(
            "error: the controller not started: jax 0.9.0 is installed"), r.stderr
        assert "Traceback" not in r.stderr and not (pw_home / "cluster.json").exists()
    finally:
        run_pwctl("down", "-y", env=env, timeout=60)

    # allowed: the controller starts, and its log says what it runs on
    allowed = {**env, ALLOW_UNTESTED_JAX: "1"}
    log = tmp_path / "allowed.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "server.controller", "--listen", address, "--db",
                                 f"sqlite:///{tmp_path / 'b.db'}", "--metrics-listen", "off"],
                                env=allowed, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    try:
        info = run_pwctl("server", "info", "--server", address, env=allowed, timeout=60)
        for _ in range(60):
            if info.returncode == 0:
                break
            info = run_pwctl("server", "info", "--server", address, env=allowed, timeout=60)
        assert info.returncode == 0, info.stderr + log.read_text()
        text = log.read_text()
        assert re.search(r"WARNING .*jax 0\.9\.0 is installed.*starting anyway", text), text
    finally:
        proc.terminate()
        proc.wait(timeout=20)
