"""An unmodified JAX program that exits while requests of its session are still in flight, behind
a link whose answers come late (0.15 s, as to a remote cluster), exits cleanly: status 0, its
output whole, and none of the jaxlib client's exit-time error lines. The arrays freed as the
interpreter ends are destructed in one batch, and a download's host buffer is deleted after its
bytes came; the jaxlib client's teardown cancelled what was unanswered and its callbacks logged
that while the process was being torn down, which crashed it now and then (SIGSEGV or SIGABRT,
the CI flake of test_proxy_lost_reads). The plugin now keeps the client alive through the exit
(pwctl/proxy_plugin.py `keep_clients_at_exit`), and the controller ends the session when the
connection closes, as for a client that went away."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for
from proxy_env import proxy_env
from relay import Relay

REPLY_DELAY_S = 0.15
RUNS = 3

PROGRAM = """
import numpy as np, jax
x = jax.device_put(np.arange(4.0, dtype=np.float32))
y = jax.jit(lambda v: v * 2)(x)
print(np.asarray(y).tolist(), flush=True)
"""

# what the jaxlib client logs when its teardown cancels requests in flight (rpc_helper.cc, array.cc)
EXIT_ERRORS = ("Batched response from ifrt proxy server", "Failed to delete host buffer",
               "IFRT proxy server disconnected")


@pytest.mark.timeout(180)
@pytest.mark.cluster(islands=1, devices=2)
def test_a_program_exiting_with_answers_in_flight_exits_cleanly(cluster: LocalCluster, tmp_path: Path) -> None:
    relay = Relay(cluster.address)
    relay.delay_replies(REPLY_DELAY_S)
    try:
        env = {**proxy_env(cluster, tmp_path, PATHWAYS_DEVICES="1"), "JAX_BACKEND_TARGET": f"grpc://{relay.address}"}
        procs = [subprocess.Popen([sys.executable, "-c", PROGRAM], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(RUNS)]
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert (proc.returncode, out) == (0, "[0.0, 2.0, 4.0, 6.0]\n"), err[-3000:]
            logged = [line for line in err.splitlines() if any(e in line for e in EXIT_ERRORS)]
            assert not logged, err[-3000:]
        # the controller ended every session once its connection closed
        wait_for(lambda: len(re.findall(r"proxy: session \w+ closed: ", cluster.controller_logs())) == RUNS,
                 30, f"{RUNS} sessions' ends in the controller's log")
    finally:
        relay.close()
