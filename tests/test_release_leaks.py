"""A client's release that its controller held, or had not sent yet, when it died (SIGKILL).

The release of a buffer waits in the controller behind the session's earlier runs
(server/controller/client_session.py). A controller killed meanwhile lost it: the session
resumed at the next controller, its client believed the buffer freed, and the buffer stayed on
its worker until the session ended (for good, for a long-lived session). The client now keeps
each release until the controller says it reached its worker, and sends those it was not told of
again when it resumes (server/controller/release_acks.py, pwctl/api/sender.py).

Real processes: a controller killed and started again on the same port and database, two
workers, a `pw` program in its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for

from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

pytestmark = [pytest.mark.timeout(180), pytest.mark.cluster(islands=2, devices=1)]

HELD = """\
import gc, json, sys, time
import jax, jax.numpy as jnp
import numpy as np
import pwctl as pw

vds = pw.make_virtual_device_set()
a, b = vds.add_slice(devices=1, island="a"), vds.add_slice(devices=1, island="b")


def slow(v, n):  # n rounds of matrix products (n an input: one compilation for every n)
    m = jnp.full((768, 768), 1.0, jnp.float32) * v[0]
    m = jax.lax.fori_loop(0, n[0], lambda i, m: jnp.tanh(m @ m * (1.0 / 768)), m)
    return v + m[0, :4] * 0.0


on_a = pw.pmap(lambda v: v + 1.0, devices=a.devices)
on_b = pw.pmap(slow, devices=b.devices)
x = np.ones((1, 4), np.float32)
np.asarray(on_b(x, np.ones((1, 1), np.int32)))  # compiled and warm
r = on_a(x).block_until_ready()  # this session's buffer on w-a
long = on_b(x, np.full((1, 1), 100000, np.int32))  # minutes on w-b: still running at the kill
time.sleep(1.0)
del r  # its release waits in the controller behind `long`, submitted before it
gc.collect()
time.sleep(1.0)
print(json.dumps({"released": True}), flush=True)
sys.stdin.readline()
"""


def buffers(cluster: LocalCluster, name: str) -> int:
    with cluster.channel(cluster.hosts()[name].address) as ch:
        return wgrpc.WorkerStub(ch).Stats(wpb.WorkerStatsRequest(), timeout=10).buffers


def test_a_release_held_by_a_controller_that_died_reaches_the_worker_after_the_session_resumes(
        cluster: LocalCluster, tmp_path: Path) -> None:
    script = tmp_path / "held.py"
    script.write_text(HELD)
    proc = subprocess.Popen([sys.executable, str(script)], env=cluster.env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line and json.loads(line)["released"], proc.stderr.read() if proc.stderr else ""
        assert buffers(cluster, "w-a") == 1  # released by the client, held by the controller
        cluster.restart_controller(kill=True)
        cluster.wait_ready(timeout=60)
        # before: 1 for as long as the session lived (it resumed: nothing else frees it)
        wait_for(lambda: buffers(cluster, "w-a") == 0, 60, "w-a to free the buffer the client released",
                 interval=0.5)
        assert proc.poll() is None  # the session resumed, and still holds nothing there
    finally:
        proc.kill()
        proc.wait()
