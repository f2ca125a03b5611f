"""Workers frozen (SIGSTOP) past the heartbeat timeout, their hosts declared lost while their
processes live on.

A fetch from a frozen worker fails with a clear error soon after its host is declared lost, not
once the worker continues (its connections stay open: only the controller's verdict tells).

A session that ends while a worker is frozen still frees its buffers there: the worker hears of
it when it registers again (it comes back in the same process, its buffers with it).

A worker frozen in the middle of a computation whose output goes to a worker of another
island: the controller declares its host lost and drops the run on the
receiver; when the frozen worker continues (SIGCONT) it finishes the computation and sends the
output on before it hears of anything, then registers again. That late copy must not stay on the
receiver: no reader will come for it and no client owns it, so nothing would ever free it (the
chaos run's freezes showed one such array left per freeze, after every session ended).

Real processes: a controller (4 s heartbeat timeout), two workers, a `pw` program in its own
process."""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for
from stepped import line as _line
from test_release_leaks import buffers

from schemas.pathways.v1 import common_pb2 as pb

pytestmark = [pytest.mark.timeout(150), pytest.mark.cluster(islands=2, devices=1, heartbeat_timeout=4)]

PROGRAM = """\
import json, sys
import jax, jax.numpy as jnp
import numpy as np
import pwctl as pw

vds = pw.make_virtual_device_set()
a, b = vds.add_slice(devices=1, island="a"), vds.add_slice(devices=1, island="b")


def slow(v):  # a second or two of matrix products on a
    m = jnp.full((768, 768), 1.0, jnp.float32) * v[0]
    m = jax.lax.fori_loop(0, int(sys.argv[1]), lambda i, m: jnp.tanh(m @ m * (1.0 / 768)), m)
    return v + m[0, :4] * 0.0


make = pw.pmap(slow, devices=a.devices)
use = pw.pmap(lambda v: v * 2.0, devices=b.devices)


@pw.program
def pipe(x):
    return use(make(x))


x = np.ones((1, 4), np.float32)
print(json.dumps({"warm": np.asarray(pipe(x)).tolist()}), flush=True)
sys.stdin.readline()
f = pipe(x)
print(json.dumps({"sent": True}), flush=True)
sys.stdin.readline()  # a was frozen mid-computation, declared lost, continued and registered again
try:
    out = {"error": "", "value": np.asarray(f.result(timeout=60)).tolist()}
except Exception as e:
    out = {"error": f"{type(e).__name__}: {e}"}
del f
out["again"] = np.asarray(pipe(x)).tolist()
print(json.dumps(out), flush=True)
sys.stdin.readline()
"""


def test_a_late_output_of_a_thawed_worker_does_not_stay_on_its_receiver(cluster: LocalCluster,
                                                                        tmp_path: Path) -> None:
    script = tmp_path / "pipe.py"
    script.write_text(PROGRAM)
    proc = subprocess.Popen([sys.executable, str(script), "100"], env=cluster.env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    try:
        assert _line(proc)["warm"] == [[2.0] * 4]
        # the warm call's output, dropped by the program as it printed, is released on its way there
        wait_for(lambda: buffers(cluster, "w-b") == 0, 10, "w-b to hold no buffer after the warm call", interval=0.1)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert _line(proc)["sent"]
        time.sleep(0.3)  # a computes now (a second or more)
        cluster.stop_worker("w-a")
        try:
            wait_for(lambda: cluster.hosts()["w-a"].state == pb.HOST_STATE_LOST, 20, "w-a declared lost")
            time.sleep(1.0)  # the run dropped on w-b
        finally:
            cluster.cont_worker("w-a")
        cluster.wait_ready(["w-a"], timeout=30)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = _line(proc)
        assert "host w-a lost" in out["error"], out
        assert out["again"] == [[2.0] * 4], out  # the thawed worker serves again
        proc.stdin.write("end\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
        # the session ended: whatever it owned on w-b is gone, and nothing else may be left there
        wait_for(lambda: buffers(cluster, "w-b") == 0, 10, "w-b to hold no buffer", interval=0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_copy_sent_to_a_frozen_receiver_does_not_stay_there_once_it_registers_again(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """The receiver frozen instead: w-a sends its output to w-b while w-b is frozen; w-b's host
    is declared lost (the run dropped; w-b, with no stream, never hears the Drop), continues and
    registers again. The copy, which reaches it only then, must not stay held there for a reader
    that never comes (suspected, not seen: this passed before and after the leak fixes of
    tests/test_release_leaks.py, with w-a computing 0.5, 1.5 and 3 s)."""
    script = tmp_path / "pipe.py"
    script.write_text(PROGRAM)
    proc = subprocess.Popen([sys.executable, str(script), "30"], env=cluster.env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    try:
        assert _line(proc)["warm"] == [[2.0] * 4]
        cluster.stop_worker("w-b")
        try:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert _line(proc)["sent"]
            wait_for(lambda: cluster.hosts()["w-b"].state == pb.HOST_STATE_LOST, 20, "w-b declared lost")
            time.sleep(1.0)  # the run dropped on w-a
        finally:
            cluster.cont_worker("w-b")
        cluster.wait_ready(["w-b"], timeout=30)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = _line(proc)
        assert "w-b" in out["error"], out
        assert out["again"] == [[2.0] * 4], out
        proc.stdin.write("end\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
        for name in ("w-a", "w-b"):
            wait_for(lambda name=name: buffers(cluster, name) == 0, 10, f"{name} to hold no buffer", interval=0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


FETCH = """\
import json, sys, time
import numpy as np
import pwctl as pw

on_a = pw.pmap(lambda v: v + 1.0, devices=pw.make_virtual_device_set().add_slice(devices=1, island="a").devices)
r = on_a(np.ones((1, 4), np.float32)).block_until_ready()  # computed on w-a, not fetched yet
time.sleep(1.0)  # w-a reported it: the run is over for the controller too (its host's loss fails it no more)
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()  # w-a is frozen, its host declared lost
out = {}
for key in ("first", "later"):  # the second: a call made once the session knows of the loss
    start = time.monotonic()
    try:
        out[key] = {"value": np.asarray(r).tolist()}
    except Exception as e:
        out[key] = {"error": f"{type(e).__name__}: {e}"}
    out[key]["s"] = time.monotonic() - start
print(json.dumps(out), flush=True)
sys.stdin.readline()  # w-a continued and registered again
try:
    out = {"again": np.asarray(on_a(np.ones((1, 4), np.float32)).result(timeout=60)).tolist()}
except Exception as e:
    out = {"again": f"{type(e).__name__}: {e}"}
print(json.dumps(out), flush=True)
"""


def test_a_fetch_from_a_frozen_worker_fails_once_its_host_is_declared_lost(cluster: LocalCluster,
                                                                           tmp_path: Path) -> None:
    """A fetch made while w-a is frozen and its host lost fails naming the host; one made once the
    session was told of the loss fails at once (not at its call's deadline, ~6 s); and once w-a
    registers again, a call to it works."""
    script = tmp_path / "fetch.py"
    script.write_text(FETCH)
    proc = subprocess.Popen([sys.executable, str(script)], env=cluster.env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        assert json.loads(lines.get(timeout=60))["ready"]
        cluster.stop_worker("w-a")
        try:
            wait_for(lambda: cluster.hosts()["w-a"].state == pb.HOST_STATE_LOST, 20, "w-a declared lost")
            proc.stdin.write("go\n")
            proc.stdin.flush()
            try:
                out = json.loads(lines.get(timeout=25))  # before: it waited until w-a continued
            except queue.Empty:
                none = {"error": "no answer in 25 s while w-a was frozen", "s": 25}
                out = {"first": none, "later": none}
        finally:
            cluster.cont_worker("w-a")
        for key in ("first", "later"):
            error = out[key]["error"]
            assert "the worker at" in error and "does not answer: its host w-a was lost" in error, out
        assert out["first"]["s"] < 15, out  # at worst the fetch's deadline (its wait + 5 s), then the verdict
        # once the session heard of the loss, a new call fails at once (before: its deadline, ~6 s)
        assert out["later"]["s"] < 2.0, out
        # and once w-a is ready again, calls to it are made as usual
        cluster.wait_ready(["w-a"], timeout=30)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert json.loads(lines.get(timeout=60))["again"] == [[2.0] * 4]
    finally:
        proc.kill()
        proc.wait()


WAITING = """\
import json, sys, threading, time
import jax, jax.numpy as jnp
import numpy as np
import pwctl as pw

a = pw.make_virtual_device_set().add_slice(devices=1, island="a")


def slow(v, n):  # n rounds of matrix products on a (n an input: one compilation for every n)
    m = jnp.full((768, 768), 1.0, jnp.float32) * v[0]
    m = jax.lax.fori_loop(0, n[0], lambda i, m: jnp.tanh(m @ m * (1.0 / 768)), m)
    return v + m[0, :4] * 0.0


f = pw.pmap(slow, devices=a.devices)
x = np.ones((1, 4), np.float32)
np.asarray(f(x, np.ones((1, 1), np.int32)))  # compiled and warm
out = {}


def call(kind, fut):
    try:
        fut.result(timeout=120) if kind == "result" else fut.block_until_ready(timeout=120)
        out[kind] = {"error": ""}
    except Exception as e:
        out[kind] = {"error": f"{type(e).__name__}: {e}"}
    out[kind]["t"] = time.time()


many = np.full((1, 1), 100000, np.int32)  # minutes: still computing when w-a is frozen
threads = [threading.Thread(target=call, args=(k, f(x, many))) for k in ("result", "ready")]
for t in threads:
    t.start()
time.sleep(1.5)  # both calls wait at w-a now
print(json.dumps({"waiting": True}), flush=True)
for t in threads:
    t.join()
print(json.dumps(out), flush=True)
"""


# 2 s, not the module's 4: the old path failed 5 s or more after the freeze, so only a short
# timeout tells the two apart
@pytest.mark.cluster(islands=2, devices=1, heartbeat_timeout=2)
def test_a_call_waiting_at_a_worker_fails_when_its_host_is_declared_lost(cluster: LocalCluster,
                                                                         tmp_path: Path) -> None:
    """A fetch (`result`) and a wait (`block_until_ready`) already waiting at a worker when it
    freezes end once the controller declares its host lost (the controller tells the session),
    naming the host; before, each went on to its call's deadline (its wait + 5 s) and then asked
    the controller: 5 s or more after the freeze, whatever the heartbeat timeout."""
    script = tmp_path / "waiting.py"
    script.write_text(WAITING)
    proc = subprocess.Popen([sys.executable, str(script)], env=cluster.env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        assert json.loads(lines.get(timeout=90))["waiting"]
        frozen = time.time()
        cluster.stop_worker("w-a")
        try:
            out = json.loads(lines.get(timeout=30))
        finally:
            cluster.cont_worker("w-a")
        for kind in ("result", "ready"):
            assert "w-a" in out[kind]["error"], out
            # heartbeat timeout + its check + the event: well before the old 5 s or more
            assert out[kind]["t"] - frozen < cluster.heartbeat_timeout + 2.5, out
    finally:
        proc.kill()
        proc.wait()


HOLD = """\
import json, sys
import numpy as np
import pwctl as pw

on_a = pw.pmap(lambda v: v + 1.0, devices=pw.make_virtual_device_set().add_slice(devices=1, island="a").devices)
r = on_a(np.ones((1, 4), np.float32)).block_until_ready()  # kept: this session's buffer on w-a
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
"""


def test_a_session_that_ends_while_a_worker_is_frozen_frees_its_buffers_there(cluster: LocalCluster,
                                                                              tmp_path: Path) -> None:
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    proc = subprocess.Popen([sys.executable, str(script)], env=cluster.env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _line(proc)["ready"]
        assert buffers(cluster, "w-a") >= 1
        cluster.stop_worker("w-a")
        try:
            wait_for(lambda: cluster.hosts()["w-a"].state == pb.HOST_STATE_LOST, 20, "w-a declared lost")
            proc.kill()  # the session ends while w-a is lost: the release of its buffers cannot reach it
            proc.wait()
            wait_for(lambda: re.search(r"controller\.sessions: session \S+ closed", cluster.controller_logs()), 20,
                     "the controller to close the session")
        finally:
            cluster.cont_worker("w-a")
        cluster.wait_ready(["w-a"], timeout=30)
        wait_for(lambda: buffers(cluster, "w-a") == 0, 10, "w-a to free the ended session's buffers", interval=0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
