"""A staged upload sharded over both workers of a slice whose second worker stops answering
(frozen: its connections stay open, nothing comes back) while the shards move to it: the
unmodified JAX program gets an error for that array naming the lost worker as soon as the
controller declares its host lost (4 s of missed heartbeats here), not a call waiting with no
end; the surviving worker holds nothing of it; the session answers its next request (the slice
degraded); another session on the cluster runs meanwhile."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for
from proxy_env import Program, proxy_env
from test_proxy_submesh import PRELUDE, two_workers

from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

HEARTBEAT_TIMEOUT_S = 4.0  # the controller declares a frozen worker's host lost after this long

FROZEN = PRELUDE + """
import sys
big = np.arange(4 << 20, dtype=np.float32).reshape(4096, 1024) / 7  # 16 MiB: its 4 MiB shards are staged
warm = jax.device_put(np.arange(8.0, dtype=np.float32), devs[2])  # the proxy's channel to worker 2 is open
warm.block_until_ready()
del warm
print("ready", flush=True)
sys.stdin.readline()
try:
    x = jax.device_put(big, NamedSharding(line, P("d")))
    x.block_until_ready()
    print("stored", flush=True)
except Exception as e:
    print("error", type(e).__name__, str(e).replace(chr(10), " ")[:400], flush=True)
try:
    y = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(line, P("d")))
    print("after", np.asarray(y).tolist(), flush=True)
except Exception as e:
    print("after error", type(e).__name__, str(e).replace(chr(10), " ")[:400], flush=True)
"""

# another session (PATHWAYS_DEVICES=1): started early, it imports while the test waits for the
# host's loss, and begins its session (JAX's backend) only when told to, after it
ELSEWHERE = """
import sys
import numpy as np, jax
sys.stdin.readline()
print(np.asarray(jax.jit(lambda v: v * 2)(np.arange(4.0, dtype=np.float32))).tolist())
"""


def other_session(cluster: LocalCluster, tmp_path: Path) -> Program:
    """ELSEWHERE, started: `finish("go\\n")` runs its session and returns its output."""
    return Program(ELSEWHERE, proxy_env(cluster, tmp_path, PATHWAYS_DEVICES="1"))


def stats(cluster: LocalCluster, name: str) -> tuple[int, int, int]:
    """(buffers, bytes, arrays being gathered) of worker `name`."""
    with cluster.channel(cluster.hosts()[name].address) as ch:
        st = wgrpc.WorkerStub(ch).Stats(wpb.WorkerStatsRequest(), timeout=10)
    return st.buffers, st.buffer_bytes, st.gathering


@pytest.mark.timeout(120)
@pytest.mark.cluster(islands=1, devices=2, heartbeat_timeout=HEARTBEAT_TIMEOUT_S)
def test_a_staged_upload_moving_to_a_worker_that_stops_answering_fails_when_its_host_is_lost(
        cluster: LocalCluster, tmp_path: Path) -> None:
    where = two_workers(cluster)
    home, dest = where[0][0], where[2][0]
    assert where[1][0] == home != dest == where[3][0]
    env = proxy_env(cluster, tmp_path, PATHWAYS_SLICE="wide")
    try:
        with Program(FROZEN, env) as prog, other_session(cluster, tmp_path) as other:
            assert prog.line() == "ready"
            wait_for(lambda: stats(cluster, home) == (0, 0, 0), 10, "nothing on the first worker yet")
            cluster.stop_worker(dest)
            start = time.monotonic()
            prog.go()
            (line,) = prog.lines_within(1, 4 * HEARTBEAT_TIMEOUT_S)  # not long after its host was lost
            took = time.monotonic() - start
            dest_address = cluster.hosts()[dest].address
            assert line.startswith("error JaxRuntimeError UNAVAILABLE: ") and line.endswith(
                f"uploading to worker {dest_address} failed: its host {dest} was lost"), line
            assert HEARTBEAT_TIMEOUT_S - 1 < took < 3 * HEARTBEAT_TIMEOUT_S, took
            # the session answers: the slice is degraded now, and says so
            line = prog.line()
            assert line.startswith("after error JaxRuntimeError") and f"host {dest} lost" in line, line
            # the first worker kept nothing: not its part, not the shards staged on it or moved from it
            wait_for(lambda: stats(cluster, home) == (0, 0, 0), 10,
                     f"the failed array's buffers to go from {home}: {stats(cluster, home)}")
            # the cluster goes on: another session, on the surviving worker's devices, runs
            assert other.finish("go\n", timeout=60) == "[0.0, 2.0, 4.0, 6.0]\n"
            prog.finish(timeout=30)
        assert stats(cluster, home) == (0, 0, 0)
    finally:
        cluster.kill_worker(dest)
