"""A proxy session's first call to a worker that froze (SIGSTOP: its connections stay open,
nothing comes back) fails with an error naming the lost host within the heartbeat timeout, not
after 20 s or when the worker thaws (server/proxy/host_watch.py, bulk.py `take`): the chaos run's
proxy program, started again just before a long freeze of its slice's worker, sat silent past
its 15 s bound (seed 54). Two moments: the call sent while the frozen host is not yet declared
lost (asking the worker for its transfer port waited out the `Stats` timeout, 10 s, then a new
gRPC channel its 20 s connect timeout), and the call sent after it was (the session had never
called that worker, so nothing told it the host at that address is lost)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import LocalCluster
from proxy_env import Program, proxy_env

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb

HEARTBEAT_TIMEOUT_S = 2.0  # the chaos run's

FIRST = """
import os, sys, time, numpy as np, jax, jax.numpy as jnp
devs = jax.devices()  # the session is open: no call to its worker yet
y = jax.jit(lambda: jnp.arange(4.0, dtype=jnp.float32) * 2)()  # run by the controller: still none
time.sleep(1)  # computed
print("ready", flush=True)
sys.stdin.readline()
t = time.monotonic()
try:
    if os.environ["FIRST_CALL"] == "upload":
        print("ok", np.asarray(jax.device_put(np.full((4,), 2.0, np.float32), devs[0])).tolist(), flush=True)
    else:
        print("ok", np.asarray(y).tolist(), flush=True)
except Exception as e:
    print("error", f"{time.monotonic() - t:.2f}", type(e).__name__, str(e).replace(chr(10), " ")[:300], flush=True)
"""


def _lost(cluster: LocalCluster, name: str, within: float) -> None:
    deadline = time.monotonic() + within
    while cluster.hosts()[name].state != pb.HOST_STATE_LOST:
        assert time.monotonic() < deadline, f"{name} not declared lost within {within:g} s"
        time.sleep(0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("call", "when"), [("upload", "before the loss"), ("download", "before the loss"),
                                            ("download", "after the loss")])
@pytest.mark.cluster(islands=2, devices=2, heartbeat_timeout=HEARTBEAT_TIMEOUT_S)
def test_a_first_call_to_a_frozen_worker_fails_once_its_host_is_lost(
        cluster: LocalCluster, tmp_path: Path, call: str, when: str) -> None:
    with cluster.client() as c:
        c.create_slice(cpb.SliceSpec(name="onb", devices=1, island="b"))
    env = proxy_env(cluster, tmp_path, PATHWAYS_SLICE="onb", FIRST_CALL=call)
    address = cluster.hosts()["w-b"].address
    try:
        with Program(FIRST, env) as prog:
            assert prog.line() == "ready"
            cluster.stop_worker("w-b")
            if when == "after the loss":
                _lost(cluster, "w-b", 4 * HEARTBEAT_TIMEOUT_S)
            start = time.monotonic()
            prog.go()
            (line,) = prog.lines_within(1, 30)
            took = time.monotonic() - start
            assert line.startswith("error ") and line.endswith(
                f"UNAVAILABLE: {call}ing {'to' if call == 'upload' else 'from'} worker {address} failed: "
                f"its host w-b was lost"), line
            # before the loss: the heartbeat timeout and the controller's tick; after: at once
            assert took < (3 * HEARTBEAT_TIMEOUT_S if when == "before the loss" else 2.0), (took, line)
    finally:
        cluster.cont_worker("w-b")
