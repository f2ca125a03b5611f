"""Unmodified JAX programs that compute through the IFRT proxy on a real local cluster: the
workers compile the client's StableHLO and run it as one-node programs through the scheduler.
Each program's output is compared with the same program on local CPU.

JITTED, TRAIN and PIPELINED run once, in one process on each side (`outputs`), on one cluster for
the module; each test checks its own program's lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, LocalCluster, wait_for
from proxy_env import proxy_env
from test_proxy_cluster import Outputs, local_and_proxied, local_env, matches_local, same_as_local, worker_buffers

JITTED = """
import numpy as np, jax, jax.numpy as jnp
f = jax.jit(lambda x, y: jnp.tanh(x @ y) * 2 + 1)
x = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
y = np.ones((4, 2), np.float32)
for _ in range(3):
    out = f(x, y)
print("f", np.asarray(out).round(5).tolist(), out.dtype, out.shape)
print("arange", jnp.arange(5).tolist(), "ones", jnp.ones(3, jnp.bfloat16).tolist())
print("chain", float(jnp.sum(f(x, y) * jnp.float32(3))))
try:
    f(np.ones((2, 2), np.float32), y)
except Exception as e:
    print("bad shapes", type(e).__name__)
print("after", np.asarray(f(x, y)).round(5).tolist() == np.asarray(out).round(5).tolist())
"""

ELSEWHERE = """
import numpy as np, jax, jax.numpy as jnp
x = jax.device_put(np.ones(3, np.float32), jax.devices()[1])
y = x + 1
print(y.tolist(), [d.id for d in y.devices()])
print("after", (jnp.ones(2) * 2).tolist())
"""

TRAIN = """
import numpy as np, jax, jax.numpy as jnp
def loss(w, x, y):
    return jnp.mean((jnp.tanh(x @ w["a"]) @ w["b"] - y) ** 2)
@jax.jit
def step(w, x, y):
    l, g = jax.value_and_grad(loss)(w, x, y)
    return jax.tree.map(lambda p, d: p - 0.1 * d, w, g), l
step = jax.jit(step, donate_argnums=0)
rng = np.random.default_rng(0)
x = rng.standard_normal((16, 8)).astype(np.float32)
y = rng.standard_normal((16, 2)).astype(np.float32)
w = {"a": jnp.asarray(rng.standard_normal((8, 4)).astype(np.float32)),
     "b": jnp.asarray(rng.standard_normal((4, 2)).astype(np.float32))}
losses = []
for i in range(20):
    w, l = step(w, x, y)
    losses.append(float(l))
print("losses", [round(v, 5) for v in losses])
print("w", np.asarray(w["b"]).round(5).tolist())
print("decreased", losses[-1] < losses[0])
"""

# tiny calls without blocking between them (their runs leave several to a worker message: server/proxy/corking.py),
# arrays kept and dropped along the way, then blocking calls one by one
PIPELINED = """
import numpy as np, jax, jax.numpy as jnp
f = jax.jit(lambda x: x + 1)
x = jnp.zeros(3, jnp.float32)
kept = []
for i in range(400):
    x = f(x)
    if i % 97 == 0:
        kept.append(x)
print("pipelined", x.tolist(), [k.tolist() for k in kept])
del kept
for i in range(20):
    x = f(x)
    x.block_until_ready()
print("op by op", x.tolist())
"""


pytestmark = pytest.mark.cluster(islands=1, devices=2)


@pytest.fixture(scope="module")
def outputs(module_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Outputs:
    """JITTED, TRAIN and PIPELINED on one local CPU device and through the proxy on one."""
    return local_and_proxied(module_cluster, tmp_path_factory.mktemp("compute"),
                             {"JITTED": JITTED, "TRAIN": TRAIN, "PIPELINED": PIPELINED}, 1)


@pytest.mark.timeout(120)
def test_pipelined_tiny_calls_are_exact(module_cluster: LocalCluster, outputs: Outputs) -> None:
    local = same_as_local(*outputs, "PIPELINED")
    assert local[-1] == "op by op [420.0, 420.0, 420.0]"
    wait_for(lambda: worker_buffers(module_cluster) == 0, 30, "the proxy session's buffers to be freed")


@pytest.mark.timeout(120)
def test_jitted_programs_run_on_the_cluster(module_cluster: LocalCluster, outputs: Outputs, tmp_path: Path) -> None:
    local = same_as_local(*outputs, "JITTED")
    assert local[-2:] == ["bad shapes TypeError", "after True"]
    with module_cluster.client() as c:  # the session's programs, buffers and slice went with it
        wait_for(lambda: not c.slices(), 30, "the proxy session's slice to be released")
    wait_for(lambda: worker_buffers(module_cluster) == 0, 30, "the proxy session's buffers to be freed")
    # a program on another device than the slice's first
    assert matches_local(module_cluster, tmp_path, ELSEWHERE, 2) == ["[2.0, 2.0, 2.0] [1]", "after [2.0, 2.0]"]


@pytest.mark.timeout(120)
def test_a_training_loop_with_donation(module_cluster: LocalCluster, outputs: Outputs) -> None:
    local = same_as_local(*outputs, "TRAIN")
    assert local[-1] == "decreased True"


@pytest.mark.timeout(180)
def test_the_readmes_example_runs_unchanged_through_the_proxy(module_cluster: LocalCluster, tmp_path: Path) -> None:
    """examples/jax_train.py, the README's unmodified JAX program, as its docstring runs it: the
    same lines on the cluster's 2 devices as on 2 local CPU devices."""
    example, args = str(REPO / "examples" / "jax_train.py"), ["--steps", "21"]
    procs = [subprocess.Popen([sys.executable, example, *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for env in (local_env(tmp_path, 2), proxy_env(module_cluster, tmp_path, PATHWAYS_DEVICES="2"))]
    (local, local_err), (proxied, proxied_err) = (p.communicate(timeout=150) for p in procs)
    assert procs[0].returncode == 0, local_err[-2000:]
    assert procs[1].returncode == 0, proxied_err[-2000:]
    lines = local.splitlines()
    assert lines[0] == "2 device(s)" and [ln.split(":")[0] for ln in lines[1:]] == ["step 0", "step 10", "step 20"]
    assert float(lines[-1].split()[-1]) < float(lines[1].split()[-1]) / 10, lines  # it trains
    assert proxied.splitlines() == lines
