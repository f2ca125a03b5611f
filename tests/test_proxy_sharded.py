"""Unmodified multi-device JAX programs through the IFRT proxy on a real local cluster: sharded
arrays (NamedSharding over `jax.devices()`, shard_map with psum, pmap, device_put with a
sharding, shards read back one by one), arrays moving between meshes, arrays of hundreds of MiB,
and a proxy client sharing an island with a `pw` client. Each program's output is compared with
the same program on 4 local CPU devices (or NumPy).

SHARDED, MESHES, REMAP and BIG run once, in one process on each side (`outputs`: REMAP and BIG
through the proxy only), on one cluster for the module shared by the tests that leave it as
they found it; each test checks its own program's lines."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import LocalCluster, wait_for
from proxy_env import client_env, proxy_env
from test_proxy_cluster import Outputs, local_and_proxied, same_as_local, worker_buffers

from schemas.pathways.v1 import controller_pb2 as cpb

LOCAL4 = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}

SHARDED = """
import numpy as np, jax, jax.numpy as jnp
from functools import partial
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
from jax import shard_map
devs = jax.devices()
print("devices", len(devs))
mesh = Mesh(np.array(devs).reshape(2, 2), ("x", "y"))
a = jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8), NamedSharding(mesh, P("x", "y")))
print("a", a.sharding.spec, [s.device.id for s in a.addressable_shards], [s.index for s in a.addressable_shards])
print("a shards", [np.asarray(s.data).tolist() for s in a.addressable_shards])
b = jax.jit(lambda x: jnp.sin(x) @ x.T + 1)(a)
print("b", b.shape, np.asarray(b).round(4).tolist())
c = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P(None, "y")))(a)
print("c", c.sharding, np.asarray(c).sum(), [s.data.shape for s in c.addressable_shards])
line = Mesh(np.array(devs), ("d",))
x = jax.device_put(np.arange(16, dtype=np.float32).reshape(4, 4), NamedSharding(line, P("d")))
@jax.jit
@partial(shard_map, mesh=line, in_specs=P("d"), out_specs=P())
def total(blk):
    return jax.lax.psum(jnp.sum(blk, axis=0), "d")
t = total(x)
print("psum", np.asarray(t).tolist(), t.sharding.spec)
print("pmap", np.asarray(jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")(np.arange(4.0))).tolist())
rep = NamedSharding(line, P())
def loss(w, xb, yb):
    return jnp.mean((jnp.tanh(xb @ w["a"]) @ w["b"] - yb) ** 2)
@partial(jax.jit, donate_argnums=0)
def step(w, xb, yb):
    l, g = jax.value_and_grad(loss)(w, xb, yb)
    return jax.tree.map(lambda p, d: p - 0.1 * d, w, g), l
rng = np.random.default_rng(0)
xb = jax.device_put(rng.standard_normal((16, 8)).astype(np.float32), NamedSharding(line, P("d")))
yb = jax.device_put(rng.standard_normal((16, 2)).astype(np.float32), NamedSharding(line, P("d")))
w = jax.device_put({"a": rng.standard_normal((8, 4)).astype(np.float32),
                    "b": rng.standard_normal((4, 2)).astype(np.float32)}, rep)
losses = []
for i in range(10):
    w, l = step(w, xb, yb)
    losses.append(round(float(l), 5))
print("losses", losses, losses[-1] < losses[0])
print("w", np.asarray(w["b"]).round(5).tolist(), w["b"].sharding.spec)
y = jax.device_put(np.ones(3, np.float32), devs[2])
print("y", (y * 3).tolist(), (y * 3).devices())
z = jax.device_put(x, devs[1])
print("z", np.asarray(z).sum(), z.devices())
h = jax.device_put(np.arange(6, dtype=jnp.bfloat16), NamedSharding(line, P()))
print("bf16", (h + 1).tolist(), (h + 1).dtype)
"""

MESHES = """
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
devs = jax.devices()
m1 = Mesh(np.array(devs[:2]), ("a",))
m2 = Mesh(np.array(devs[2:]), ("b",))
x = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(m1, P("a")))
print("x", np.asarray(x).tolist(), [s.device.id for s in x.addressable_shards])
y = jax.device_put(x, NamedSharding(m2, P("b")))
print("y", np.asarray(y).tolist(), [s.device.id for s in y.addressable_shards])
grid = Mesh(np.array(devs).reshape(2, 2), ("p", "q"))
line = Mesh(np.array(devs), ("d",))
z = jax.device_put(y, NamedSharding(grid, P("p")))
print("z", np.asarray(z).tolist(), z.sharding.spec)
u = jax.jit(lambda v: v * 2, out_shardings=NamedSharding(line, P("d")))(z)
v = jax.jit(lambda v: v + 1, out_shardings=NamedSharding(grid, P(("p", "q"))))(u)
print("uv", np.asarray(u).tolist(), u.sharding.spec, np.asarray(v).tolist(), v.sharding.spec)
print("shards", [np.asarray(s.data).tolist() for s in v.addressable_shards])
"""

BIG = """
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
a = np.arange(75 << 20, dtype=np.float32)  # 300 MiB
x = jax.device_put(a)
back = np.asarray(x * 2)
print("single", back.nbytes, bool((back == a * 2).all()))
mesh = Mesh(np.array(jax.devices()), ("d",))
y = jax.device_put(a.reshape(4096, -1), NamedSharding(mesh, P("d")))
print("sharded", bool((np.asarray(y).ravel() == a).all()), float(jnp.sum(y[:, :2])))
"""


# The tests with their own clusters first: the module's cluster (made for the first test that
# asks for it) is not yet there to load the machine while their workers' heartbeats are timed.

WAITS = """
import sys, time
import numpy as np, jax, jax.numpy as jnp
f = jax.jit(lambda v: v @ v)
x = f(jnp.ones((256, 256)))
x.block_until_ready()
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
try:
    if sys.argv[1] == "download":
        np.asarray(f(f(x)))
    else:  # a blocking client: the run is prompt, its end awaited in the controller (no Wait)
        f(x).block_until_ready()
    print("no error")
except Exception as e:
    print("error", type(e).__name__, round(time.monotonic() - t0) < 60, flush=True)
"""


@pytest.mark.timeout(240)
@pytest.mark.cluster(islands=1, devices=2, heartbeat_timeout=4.0)
@pytest.mark.parametrize("wait", ["download", "block"])
def test_a_run_that_fails_on_the_cluster_fails_promptly(cluster: LocalCluster, tmp_path: Path, wait: str) -> None:
    """The worker freezes (SIGSTOP) while the program waits for a run (downloading its result,
    or blocking on it): the controller declares the host lost and fails the run, and the program
    gets the error then, not after the proxy's own wait bound (an hour)."""
    proc = subprocess.Popen([sys.executable, "-c", WAITS, wait], env=proxy_env(cluster, tmp_path, PATHWAYS_DEVICES="1"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        name = next(iter(cluster.workers))
        cluster.stop_worker(name)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=150)
        assert out.strip() == "error JaxRuntimeError True", err[-3000:]
        assert time.monotonic() - t0 < 60
    finally:
        cluster.cont_worker(next(iter(cluster.workers)))
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


SPANNING = """
import numpy as np, jax, jax.numpy as jnp
from functools import partial
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
from jax import shard_map
line = Mesh(np.array(jax.devices()), ("d",))
x = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(line, P("d")))
@jax.jit
@partial(shard_map, mesh=line, in_specs=P("d"), out_specs=P("d"))
def mix(b):
    return b + jax.lax.psum(jnp.sum(b, axis=0, keepdims=True), "d")
y = mix(x)
print("y", np.asarray(y).tolist(), y.sharding.spec)
print("shards", [(s.device.id, np.asarray(s.data).tolist()) for s in y.addressable_shards])
z = jax.jit(lambda v: v.T * 2)(x)  # a result whose sharding XLA's propagation picks
print("z", z.sharding.spec, [(s.device.id, s.index, np.asarray(s.data).tolist()) for s in z.addressable_shards])
print("z next", np.asarray(jax.jit(lambda v: v.sum(1))(z)).tolist())
print("big", float(jnp.sum(jax.device_put(np.ones((4096, 4096), np.float32), NamedSharding(line, P("d"))) * 2)))
import hashlib
a = (np.arange(2048 * 2048, dtype=np.float32) % 65521).reshape(2048, 2048)  # 16 MiB: streamed back
r = jax.jit(lambda v: v * 2 + 1, out_shardings=NamedSharding(line, P("d")))(a)
print("read back", r.sharding.spec, [hashlib.sha256(np.asarray(v).tobytes()).hexdigest()[:16] for v in
                    (r, r.addressable_shards[0].data, r.addressable_shards[3].data)])
"""


SPANNING_PART = """
import numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
devs = jax.devices()
part = Mesh(np.array(devs[2:]), ("b",))
y = jax.device_put(np.arange(4.0, dtype=np.float32), NamedSharding(part, P("b")))
print("moved", np.asarray(y).tolist(), [s.device.id for s in y.addressable_shards])
print("part", np.asarray(jax.jit(lambda v: v * 2)(y)).tolist())
line = Mesh(np.array(devs), ("d",))
whole = jax.device_put(np.asarray(y), NamedSharding(line, P("d")))
print("after", np.asarray(jax.jit(lambda v: v + 1)(whole)).tolist())
"""


@pytest.mark.timeout(300)
@pytest.mark.cluster(islands=1, devices=2, heartbeat_timeout=15.0)
def test_a_slice_spanning_two_workers(cluster: LocalCluster, tmp_path: Path) -> None:
    """Four devices on two workers: sharded results span workers, and are read back whole."""
    cluster.add_worker("a", 2, name="w-a2")
    with cluster.client() as c:
        c.create_slice(cpb.SliceSpec(name="wide", devices=4))
        assert len({d.host for d in c.slices()[0].devices}) == 2
    # SPANNING, then SPANNING_PART in the same process; its first run waits for the island's group
    # of workers to form: no retry (test_proxy_forming.py)
    outputs = local_and_proxied(cluster, tmp_path, {"SPANNING": SPANNING}, 4,
                                proxy_only={"SPANNING_PART": SPANNING_PART}, slice_name="wide")
    same_as_local(*outputs, "SPANNING")
    # a program over part of a slice spanning workers runs there (tests/test_proxy_submesh.py)
    lines = proxied_lines(outputs, "SPANNING_PART")
    assert lines == ["moved [0.0, 1.0, 2.0, 3.0] [2, 3]", "part [0.0, 2.0, 4.0, 6.0]", "after [1.0, 2.0, 3.0, 4.0]"]


# big copies starve heartbeats under load: a long heartbeat timeout
pytestmark = pytest.mark.cluster(islands=1, devices=4, heartbeat_timeout=15.0)


@pytest.fixture(scope="module")
def outputs(module_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Outputs:
    """SHARDED and MESHES on 4 local CPU devices and through the proxy on 4, there followed by
    REMAP and BIG (last: the largest)."""
    return local_and_proxied(module_cluster, tmp_path_factory.mktemp("sharded"),
                             {"SHARDED": SHARDED, "MESHES": MESHES}, 4, proxy_only={"REMAP": REMAP, "BIG": BIG})


def proxied_lines(outputs: Outputs, name: str) -> list[str]:
    """Program `name`'s lines through the proxy (a program that raised ends with its FAILED line)."""
    assert name in outputs[1], f"program {name!r} did not run: {sorted(outputs[1])}"
    return outputs[1][name]


@pytest.mark.timeout(300)
def test_sharded_programs_on_four_devices(module_cluster: LocalCluster, outputs: Outputs) -> None:
    local = same_as_local(*outputs, "SHARDED")
    assert local[0] == "devices 4"
    assert "psum [24.0, 28.0, 32.0, 36.0] P()" in local and "pmap [6.0, 6.0, 6.0, 6.0]" in local
    # arrays between meshes: two sub-meshes, a 2x2 grid and a line over the same four devices
    local = same_as_local(*outputs, "MESHES")
    assert local[1] == "y [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0] [2, 3]"
    with module_cluster.client() as c:
        wait_for(lambda: not c.slices(), 30, "the proxy sessions' slices to be released")
    wait_for(lambda: worker_buffers(module_cluster) == 0, 30, "the proxy sessions' buffers to be freed")


@pytest.mark.timeout(300)
def test_arrays_of_hundreds_of_mib(module_cluster: LocalCluster, outputs: Outputs) -> None:
    lines = proxied_lines(outputs, "BIG")
    a = np.arange(75 << 20, dtype=np.float32).reshape(4096, -1)
    assert lines == ["single 314572800 True", f"sharded True {float(a[:, :2].sum())}"]
    wait_for(lambda: worker_buffers(module_cluster) == 0, 30, "the program's buffers to be freed")


REMAP = """
import numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
from jaxlib import _pathways  # RemapArrays, as pathwaysutils sends it (CPU PJRT cannot run it)
devs = jax.devices()
mesh = Mesh(np.array(devs), ("d",))
x = jax.device_put(np.arange(16, dtype=np.float32).reshape(8, 2), NamedSharding(mesh, P("d")))
m1, m2 = Mesh(np.array(devs[:2]), ("d",)), Mesh(np.array(devs[2:]), ("d",))
halves = _pathways._split_by_mesh_axis([x], [0], [4], 0, [2, 4], [[NamedSharding(m1, P("d")),
                                                                  NamedSharding(m2, P("d"))]], False)[0]
for a in halves:
    print("half", a.shape, sorted(d.id for d in a.sharding.device_set), np.asarray(a).ravel().tolist())
back = _pathways._concatenate_by_mesh_axis([halves], [0], [4], 0, [2, 4], [NamedSharding(mesh, P("d"))], True)[0]
print("back", np.asarray(back).ravel().tolist(), back.sharding.spec)
print("sum", float(jax.jit(lambda v: (v * v).sum())(back)))
"""


@pytest.mark.timeout(300)
def test_remap_arrays_split_and_join_meshes(module_cluster: LocalCluster, outputs: Outputs) -> None:
    lines = proxied_lines(outputs, "REMAP")
    a = np.arange(16, dtype=np.float32)
    assert lines == [f"half (4, 2) [0, 1] {a[:8].tolist()}", f"half (4, 2) [2, 3] {a[8:].tolist()}",
                     f"back {a.tolist()} P('d',)", f"sum {float((a * a).sum())}"]
    wait_for(lambda: worker_buffers(module_cluster) == 0, 30, "the program's buffers to be freed")


PROXY_LOOP = """
import numpy as np, jax, jax.numpy as jnp
from functools import partial
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
from jax import shard_map
mesh = Mesh(np.array(jax.devices()), ("d",))
@jax.jit
@partial(shard_map, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
def mix(b):
    return b * 0.5 + jax.lax.psum(b, "d") * 0.125
x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("d")))
for _ in range(40):
    x = mix(x)
print("proxy", np.asarray(x).round(4).tolist())
"""

PW_LOOP = """
import numpy as np
import pwctl as pw
s = pw.make_virtual_device_set().add_slice(devices=4)
double = pw.pmap(lambda v: v * 2.0 + 1.0, devices=s.devices)
x = np.arange(4.0)
for _ in range(40):
    x = double(x)
print("pw", np.asarray(x).tolist())
"""


@pytest.mark.timeout(300)
def test_a_proxy_and_a_pw_client_share_an_island(module_cluster: LocalCluster, tmp_path: Path) -> None:
    cluster = module_cluster
    with cluster.client() as c:
        c.create_slice(cpb.SliceSpec(name="shared", devices=4))
    try:
        # Plain JAX must block each call: pipelined collectives deadlock on CPU (docs/facts.md), which
        # is exactly what the proxy's worker gates against; the proxied program below pipelines freely.
        blocking = PROXY_LOOP.replace("x = mix(x)", "x = mix(x).block_until_ready()")
        assert blocking != PROXY_LOOP
        procs = [  # the plain JAX run at the same time as the two clients, apart from the cluster
            subprocess.Popen([sys.executable, "-c", PROXY_LOOP],
                             env=proxy_env(cluster, tmp_path, PATHWAYS_SLICE="shared"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            subprocess.Popen([sys.executable, "-c", PW_LOOP], env=cluster.env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=tmp_path),
            subprocess.Popen([sys.executable, "-c", blocking], env=client_env(tmp_path, **LOCAL4),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        ]
        try:
            outs = []
            for p in procs:
                out, err = p.communicate(timeout=240)
                assert p.returncode == 0, err[-3000:]
                outs.append(out.splitlines())
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
        assert outs[0] == outs[2]  # the proxied loop's lines are plain JAX's
        x = np.arange(4.0)
        for _ in range(40):
            x = x * 2.0 + 1.0
        assert outs[1] == [f"pw {x.tolist()}"]
    finally:
        with cluster.client() as c:  # the module's cluster as it was
            c.delete_slice("shared", force=True)


TRAIN_SCRIPT = """
import sys
import numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
mesh = Mesh(np.array(jax.devices()), ("d",))
x = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh, P("d")))
y = jax.jit(lambda v: v * 2)(x)
print("run", __name__, sys.argv[1:], jax.devices()[0].platform, len(jax.devices()), y.tolist())
"""


@pytest.mark.timeout(300)
def test_submit_proxy_runs_an_unmodified_script_as_a_job(module_cluster: LocalCluster, tmp_path: Path) -> None:
    cluster = module_cluster
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    with cluster.client() as c:
        c.create_slice(cpb.SliceSpec(name="train", devices=4))
    try:
        with ThreadPoolExecutor(2) as pool:
            # asked at the same time as the proxy jobs below, whose slices it does not touch:
            # without --proxy the same script runs on the job's own CPU (one device), and --slice
            # without --proxy is refused
            plain = pool.submit(cluster.pwctl, "submit", str(script), "--", "x", timeout=180)
            refused = pool.submit(cluster.pwctl, "submit", str(script), "--slice", "train", timeout=60)
            r = cluster.pwctl("submit", str(script), "--proxy", "--", "--steps", "3", PATHWAYS_SLICE="train",
                              timeout=180)
            assert r.returncode == 0, r.stderr[-3000:]
            assert ("run __main__ ['--steps', '3'] cpu 4 [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]"
                    in r.stdout.splitlines())
            # a fresh slice of the size asked (freed when the job ends), whatever the submitter's env says
            r = cluster.pwctl("submit", str(script), "--proxy", "--devices", "2", PATHWAYS_SLICE="train", timeout=180)
            assert r.returncode == 0, r.stderr[-3000:]
            assert "run __main__ [] cpu 2 [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]" in r.stdout.splitlines()
            r = refused.result()
            assert r.returncode == 2 and "--proxy" in r.stderr and "Traceback" not in r.stderr, r.stderr
            r = plain.result()
            assert r.returncode == 0, r.stderr[-3000:]
            assert "run __main__ ['x'] cpu 1 [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]" in r.stdout.splitlines()
        with cluster.client() as c:
            assert [s.name for s in c.slices()] == ["train"]
    finally:
        with cluster.client() as c:  # the module's cluster as it was
            c.delete_slice("train", force=True)
