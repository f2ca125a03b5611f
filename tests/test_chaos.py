"""The short chaos and fuzz run (`python -m bench.chaos --quick`): 400 hostile requests to every
controller and worker method, 100 to the IFRT proxy service (every request kind, the host buffer
RPCs, refused sessions, a client that never reads) beside the workloads, then 5 kills (one of them
the controller) and a worker frozen past the heartbeat timeout (SIGSTOP, then SIGCONT: declared lost
while alive, it must rejoin) while a program across two islands, a collective, an unmodified JAX
program through the proxy and a job run; every check of the report must hold, the controller's and
the workers' (bench/chaos/__init__.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, base_env

pytestmark = pytest.mark.timeout(240)


def test_quick_chaos_run_keeps_the_controller_sound(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    r = subprocess.run([sys.executable, "-m", "bench.chaos", "--quick", "--requests", "400", "--seed", "7",
                        "--out", str(out), "--keep", str(tmp_path / "run")],
                       env=base_env(tmp_path / "home"), cwd=REPO, capture_output=True, text=True, timeout=230)
    assert out.exists(), r.stderr[-3000:]
    report = json.loads(out.read_text())
    failed = [name for name, ok in {**report["checks"], **report["worker_checks"]}.items() if not ok]
    assert not failed, f"{failed}\n{json.dumps(report, indent=1)[:4000]}"
    assert r.returncode == 0
    kills = report["kills"]
    assert kills["kills"] == 5 and kills["controller_kills"] == 1
    assert kills["calls_ok"] > 0 and kills["time_to_error_s"]["n"] >= 1
    (frozen,) = kills["freezes"]["per_freeze"]
    assert frozen["long"] and frozen["lost_s"] is not None and frozen["rejoined"], frozen
    # the mixed load: a collective and an unmodified JAX program through the proxy beside the
    # program across islands, each checked; and a job that lived through every kill
    assert set(kills["workloads"]) == {"across", "psum", "proxy"}
    assert all(w["calls_ok"] > 0 for w in kills["workloads"].values()), kills["workloads"]
    assert kills["job"]["state"] == "JOB_STATE_SUCCEEDED" and kills["job"]["calls_ok"] > 0, kills["job"]
    assert report["fuzz"]["requests"] == 400
    assert set(report["fuzz"]["methods"]) >= {"Controller/WorkerConnect", "Controller/Session", "Worker/Fetch"}
    # the proxy fuzz reached the handlers: most request kinds, the host buffer RPCs, every refusal
    proxy = report["proxy_fuzz"]
    kinds = {k for k in proxy["kinds"] if k.startswith("IfrtSession/") and k.endswith("_request")}
    assert proxy["requests"] == 100 and len(kinds) >= 20, sorted(proxy["kinds"])
    assert {"HostBufferStore", "HostBufferLookup", "HostBufferDelete", "setup/compile_request",
            "IfrtSession/refused:devices", "IfrtSession/refused:wrong_token"} <= set(proxy["kinds"])
    assert proxy["kinds"]["setup/loaded_executable_execute_request"].get("OK"), proxy["kinds"]
