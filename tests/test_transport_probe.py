"""The cross-host transport probe (bench/transport_probe.py) runs end to end on two namespace hosts
and leaves none of its namespaces behind; without root it refuses with one line. Never timings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(180)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO))


@pytest.mark.skipif(os.geteuid() != 0, reason="the probe makes network namespaces: needs root")
def test_probe_measures_every_method_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    proc = subprocess.Popen([sys.executable, "-m", "bench.transport_probe", "--sizes", "1", "--chunks", "1",
                             "--reps", "1", "--json", str(out)], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=170)
    if proc.returncode == 2 and "cannot make network namespaces" in stderr:
        pytest.skip(stderr.strip())
    assert proc.returncode == 0, stderr[-3000:]
    data = json.loads(out.read_text())
    results = data["results"]
    assert sorted(r["method"] for r in results) == ["grpc-1", "jax", "tcp", "worker-1", "worker-tcp"], data["skipped"]
    for r in results:
        assert r["size_mib"] == 1 and len(r["seconds"]) == 1 and r["seconds"][0] > 0, r
        assert r["gbps_median"] > 0 and r["cpu_s_per_gb"] > 0, r
    assert "x raw TCP" in stdout
    # its namespaces are named pwt<driver pid>k<K>...: none may be left
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=15).stdout
    assert f"pwt{proc.pid}k" not in netns


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to drop to another user (setpriv)")
def test_probe_without_root_says_so(tmp_path: Path) -> None:
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                        "bench.transport_probe", "--json", str(tmp_path / "x.json")],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == "transport_probe: needs root (it makes network, mount and UTS namespaces)"
