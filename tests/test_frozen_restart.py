"""Workers that outlive a controller restart: what the new controller must let go of there.

A collective waiting for its input from a frozen worker when the controller restarts: the worker
of the collective registers with the new controller and must serve it. The collective's launch
waits in the worker's launch thread (collectives launch in gang order); its input never comes (the
sender is frozen, and the new controller knows nothing of the run, so no Drop ends the wait). The
launch gives up once the worker registered again, rather than holding the launch thread, and with
it every later run on that worker, for good (the chaos run's freezes found island a wedged after a
worker frozen across a controller restart: each run on it failed only at the hang timeout).

A worker started again before its old process's stream was seen to end (killed while the
controller was frozen, both handled at once after): the old process must count as lost, or its
clients go on calling it at its old address (its slices never changed for them).

An unmodified JAX program's buffers (its IFRT proxy session does not survive the restart): the new
controller released its slice but left its buffers on the workers for good (the chaos run: a proxy
program's upload and output left on a worker after every session ended).

Real processes: a controller (60 s heartbeat timeout: the frozen worker is not declared lost, which
would drop the run), two workers, `pw` and JAX programs in their own processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for
from proxy_env import proxy_env
from stepped import line as _line
from test_proxy_cluster import worker_buffers

pytestmark = [pytest.mark.timeout(150), pytest.mark.cluster(islands=2, devices=2, heartbeat_timeout=60)]

COMMON = """\
import json, sys, time
import jax
import numpy as np
import pwctl as pw

vds = pw.make_virtual_device_set()
a = vds.add_slice(devices=2, island="a")
h = pw.pmap(lambda v: jax.lax.psum(v, "i"), devices=a.devices, axis_name="i")  # a collective on a
"""

ACROSS = COMMON + """\
b = vds.add_slice(devices=2, island="b")
g = pw.pmap(lambda v: v + 1.0, devices=b.devices)


@pw.program
def across(x):
    return h(g(x))  # g's output goes from b to a, where the collective waits for it


x = np.ones((2, 4), np.float32)
print(json.dumps({"warm": np.asarray(across(x)).tolist()}), flush=True)
sys.stdin.readline()  # b is frozen now
f = across(x)
print(json.dumps({"sent": True}), flush=True)
sys.stdin.readline()
"""

LATER = COMMON + """\
start = time.monotonic()
value = np.asarray(h(np.arange(8, dtype=np.float32).reshape(2, 4)).result(timeout=float(sys.argv[1]))).tolist()
print(json.dumps({"value": value, "s": time.monotonic() - start}), flush=True)
"""


def test_a_collective_waiting_on_a_frozen_peer_lets_its_worker_go_after_a_controller_restart(
        cluster: LocalCluster, tmp_path: Path) -> None:
    (tmp_path / "across.py").write_text(ACROSS)
    (tmp_path / "later.py").write_text(LATER)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "across.py")], env=cluster.env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    try:
        assert _line(proc)["warm"] == [[4.0] * 4] * 2
        cluster.stop_worker("w-b")
        try:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert _line(proc)["sent"]
            time.sleep(1.5)  # the collective's launch on w-a waits for g's output from w-b
            cluster.restart_controller(kill=True)
            cluster.wait_ready(["w-a"], timeout=30)  # w-a registered again (w-b is still frozen)
            later = subprocess.run([sys.executable, str(tmp_path / "later.py"), "30"], env=cluster.env(),
                                   capture_output=True, text=True, timeout=90)
            assert later.returncode == 0, later.stderr[-3000:]
            out = json.loads(later.stdout.strip().splitlines()[-1])
            assert out["value"] == [[4.0, 6.0, 8.0, 10.0]] * 2, out
        finally:
            cluster.cont_worker("w-b")
    finally:
        proc.kill()
        proc.wait()


HOLD = """
import sys
import numpy as np, jax
x = jax.device_put(np.ones((4, 4), np.float32)) + 1.0
x.block_until_ready()
print("holding", flush=True)
sys.stdin.readline()
"""


def test_a_proxy_programs_buffers_go_when_the_controller_restarts_without_its_session(
        cluster: LocalCluster, tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", HOLD], env=proxy_env(cluster, tmp_path, PATHWAYS_DEVICES="1"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        assert worker_buffers(cluster) >= 1
        cluster.restart_controller(kill=True)  # the proxy session ends with it: it cannot resume
    finally:
        proc.kill()
        proc.wait(timeout=30)
    cluster.wait_ready(["w-a", "w-b"], timeout=30)
    wait_for(lambda: worker_buffers(cluster) == 0, 20, "the proxy program's buffers to be freed", interval=0.5)


CALLS = COMMON + """\
x = np.ones((2, 4), np.float32)
print(json.dumps({"warm": np.asarray(h(x)).tolist()}), flush=True)
sys.stdin.readline()  # the controller was frozen while w-a was killed and started again
start = time.monotonic()
try:  # at once, and once: whether or not the session told of the move yet (pwctl/api/whereabouts.py)
    out = {"value": np.asarray(h(x).result(timeout=30)).tolist(), "error": ""}
except Exception as e:
    out = {"value": None, "error": f"{type(e).__name__}: {e}"[:500]}
out["s"] = time.monotonic() - start
print(json.dumps(out), flush=True)
"""


def test_a_worker_started_again_before_its_old_stream_ended_is_called_at_its_new_address(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """The chaos run's case (w-a killed and started again while the controller was frozen, the new
    registration handled first) made certain: the old process is frozen (its stream stays open)
    while the new one registers, then killed."""
    (tmp_path / "calls.py").write_text(CALLS)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "calls.py")], env=cluster.env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    try:
        assert _line(proc)["warm"] == [[2.0] * 4] * 2
        old = cluster.workers.pop("w-a")
        os.kill(old.proc.pid, signal.SIGSTOP)
        try:
            cluster.add_worker("a", 2, name="w-a")  # registers while the old process's stream is open
        finally:
            old.proc.kill()
            old.proc.wait(timeout=10)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = _line(proc)
        # before: "cannot reach the worker at OLD (host lost?)" for good; then, a call made before the
        # session read the move failed once, the program's retry loop went past it
        assert out["error"] == "" and out["value"] == [[2.0] * 4] * 2, out
    finally:
        proc.kill()
        proc.wait()
