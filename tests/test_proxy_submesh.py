"""Unmodified JAX programs through the IFRT proxy on a slice spanning two workers (2 devices
each), over part of its devices or over them in another order: a one-device program, pipeline
stages each on one worker's devices, a psum there, and programs over devices of both workers
(a sub-mesh across them, the whole slice reversed). Each run uses only the devices it was
compiled for, on the workers holding them (checked in the trace), and the program's output
equals the same program on 4 local CPU devices.

The tests share one cluster (`module_cluster`, with its slice "wide" over both workers made
once); ONE_WORKER and ACROSS run once, in one process on each side (`outputs`), and each test
checks its own program's lines and runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for
from proxy_env import proxy_env
from test_proxy_cluster import Outputs, local_and_proxied, same_as_local, worker_buffers

from schemas.pathways.v1 import controller_pb2 as cpb

LOCAL4 = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}  # for other modules

PRELUDE = """
import os
import numpy as np, jax, jax.numpy as jnp
from functools import partial
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
from jax import shard_map
devs = jax.devices()
def show(name, a):
    print(name, np.asarray(a).round(4).tolist(), a.sharding,
          [(s.device.id, s.index, np.asarray(s.data).round(4).tolist()) for s in a.addressable_shards])
line = Mesh(np.array(devs), ("d",))
front, back = Mesh(np.array(devs[:2]), ("s",)), Mesh(np.array(devs[2:]), ("s",))
"""

ONE_WORKER = PRELUDE + """
def plus_one(v):
    return v + 1
for d in (3, 0):
    show(f"one {d}", jax.jit(plus_one)(jax.device_put(np.arange(4.0, dtype=np.float32) * d, devs[d])))
a = jax.device_put(np.arange(16.0, dtype=np.float32).reshape(8, 2), NamedSharding(line, P("d")))
b = jax.jit(lambda v: v * 2)(a)  # over the whole slice: its parts are on both workers
def col_sum(v):
    return v.sum(0)
show("col sum", jax.jit(col_sum)(jax.device_put(b, devs[2])))
def stage_one(v):
    return jnp.tanh(v) * 3
def stage_two(v):
    return v @ v.T + 1
h = jax.jit(stage_one, in_shardings=NamedSharding(front, P("s")),
            out_shardings=NamedSharding(front, P("s")))(np.arange(8.0, dtype=np.float32).reshape(4, 2))
show("stage one", h)
o = jax.jit(stage_two, out_shardings=NamedSharding(back, P("s")))(jax.device_put(h, NamedSharding(back, P("s"))))
show("stage two", o)
@jax.jit
@partial(shard_map, mesh=back, in_specs=P("s"), out_specs=P())
def back_total(blk):
    return jax.lax.psum(jnp.sum(blk, keepdims=True), "s")
show("psum", back_total(o))
show("reads part", jax.jit(stage_two)(jax.device_put(b, NamedSharding(back, P("s")))))
show("whole again", jax.jit(lambda v: v - 1)(jax.device_put(o, NamedSharding(line, P("d")))))
first = jax.jit(stage_one, out_shardings=NamedSharding(front, P("s")))
second = jax.jit(stage_two, out_shardings=NamedSharding(back, P("s")))
outs = [second(jax.device_put(first(np.full((4, 2), k, np.float32)), NamedSharding(back, P("s")))) for k in range(6)]
print("pipeline", [np.asarray(v).round(4).tolist() for v in outs])
"""

ACROSS = PRELUDE + """
span = Mesh(np.array([devs[1], devs[2]]), ("m",))
def across(v):
    return jnp.cos(v) + v
x = jax.device_put(np.arange(8.0, dtype=np.float32).reshape(4, 2), NamedSharding(span, P("m")))
y = jax.jit(across, out_shardings=NamedSharding(span, P("m")))(x)
show("across", y)
@jax.jit
@partial(shard_map, mesh=span, in_specs=P("m"), out_specs=P())
def span_total(blk):
    return jax.lax.psum(jnp.sum(blk, keepdims=True), "m")
show("span psum", span_total(y))
rev = Mesh(np.array(devs[::-1]), ("r",))
def reversed_times(v):
    return v * 3
z = jax.jit(reversed_times, out_shardings=NamedSharding(rev, P("r")))(
    jax.device_put(np.arange(16.0, dtype=np.float32).reshape(8, 2), NamedSharding(rev, P("r"))))
show("reversed", z)
show("then one", jax.jit(lambda v: v.sum())(jax.device_put(y, devs[0])))
show("to line", jax.jit(lambda v: v + 1, out_shardings=NamedSharding(line, P("d")))(
    jax.device_put(y, NamedSharding(line, P("d")))))
show("then whole", jax.jit(lambda v: v + 1)(jax.device_put(z, NamedSharding(line, P("d")))))
@partial(jax.jit, donate_argnums=0)
@partial(shard_map, mesh=span, in_specs=P("m"), out_specs=P("m"))
def span_step(blk):
    return blk * 0.5 + jax.lax.psum(blk, "m") * 0.25
w = jax.device_put(np.arange(8.0, dtype=np.float32).reshape(4, 2), NamedSharding(span, P("m")))
for _ in range(8):
    w = span_step(w)
    if os.environ["JAX_PLATFORMS"] == "cpu":  # plain JAX must not pipeline collectives on CPU
        w.block_until_ready()
show("span loop", w)
"""


def run_on_slice(code: str, env: dict[str, str]) -> list[str]:
    """The program's lines (its first run waits for the island's group of workers to form: no
    retry is needed, tests/test_proxy_forming.py)."""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, "\n".join(ln for ln in out.stderr.splitlines() if "insecure" not in ln)[-3000:]
    return out.stdout.splitlines()


REMOTE = 1 << 30  # server/worker/group.py: a gang segment's trace lists its peers' devices from here on


def two_workers(cluster: LocalCluster) -> dict[int, tuple[str, int]]:
    """Makes slice "wide" over both workers; virtual device -> (its worker, its local index)."""
    cluster.add_worker("a", 2, name="w-a2")
    with cluster.client() as c:
        c.create_slice(cpb.SliceSpec(name="wide", devices=4))
        where = {d.index: (d.host, d.local_index) for d in c.slices()[0].devices}
    assert len({h for h, _ in where.values()}) == 2
    return where


def runs_of(cluster: LocalCluster, label: str) -> list[set[tuple[str, int]]]:
    """Per run of the programs named `label`, in order: the (worker, local device) pairs it ran on."""
    with cluster.client() as c:
        events = json.loads(c.trace_window().chrome_trace_json)["traceEvents"]
    hosts = {e["pid"]: e["args"]["name"].rsplit("/", 1)[-1] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    runs: dict[int, set[tuple[str, int]]] = {}
    start: dict[int, float] = {}
    for e in events:
        if e["ph"] == "X" and f"jit_{label}" in e["name"] and e["tid"] < REMOTE:
            run = e["args"]["run_id"]
            runs.setdefault(run, set()).add((hosts[e["pid"]], e["tid"]))
            start[run] = min(start.get(run, e["ts"]), e["ts"])
    return [runs[r] for r in sorted(runs, key=lambda r: start[r])]


def expect(cluster: LocalCluster, where: dict[int, tuple[str, int]], runs: dict[str, list[list[int]]]) -> None:
    """Each program of `runs` ran on exactly the given virtual devices, run by run."""
    want = {label: [{where[v] for v in devices} for devices in each] for label, each in runs.items()}
    wait_for(lambda: all(len(runs_of(cluster, label)) >= len(each) for label, each in want.items()), 30,
             "the runs in the trace")
    assert {label: runs_of(cluster, label) for label in want} == want


pytestmark = pytest.mark.cluster(islands=1, devices=2, heartbeat_timeout=15.0)


@pytest.fixture(scope="module")
def wide(module_cluster: LocalCluster) -> dict[int, tuple[str, int]]:
    """`two_workers` on the module's cluster: its slice "wide", virtual device -> (worker, local index)."""
    return two_workers(module_cluster)


@pytest.fixture(scope="module")
def outputs(module_cluster: LocalCluster, wide: dict[int, tuple[str, int]],
            tmp_path_factory: pytest.TempPathFactory) -> Outputs:
    """ONE_WORKER and ACROSS on 4 local CPU devices and through the proxy on slice "wide" (its
    first run waits for the island's group of workers to form: no retry, tests/test_proxy_forming.py)."""
    return local_and_proxied(module_cluster, tmp_path_factory.mktemp("submesh"),
                             {"ONE_WORKER": ONE_WORKER, "ACROSS": ACROSS}, 4, slice_name="wide")


@pytest.mark.timeout(300)
def test_programs_on_one_worker_of_a_slice_spanning_two(module_cluster: LocalCluster, wide: dict[int, tuple[str, int]],
                                                        outputs: Outputs) -> None:
    """One-device programs and sub-meshes of one worker's devices run there alone (a plain
    computation on that worker, holding only those devices), reading arrays of other workers
    and of programs over the whole slice."""
    local = same_as_local(*outputs, "ONE_WORKER")
    by_name = {ln.split(" [", 1)[0]: ln for ln in local}
    assert by_name["one 3"].startswith("one 3 [1.0, 4.0, 7.0, 10.0] SingleDeviceSharding(device=CpuDevice(id=3)")
    assert by_name["col sum"].startswith("col sum [112.0, 128.0] SingleDeviceSharding(device=CpuDevice(id=2)")
    expect(module_cluster, wide, {"plus_one": [[3], [0]], "col_sum": [[2]], "stage_one": [[0, 1]] * 7,
                                  "stage_two": [[2, 3]] * 8, "back_total": [[2, 3]]})
    wait_for(lambda: worker_buffers(module_cluster) == 0, 30, "the program's buffers to be freed")


@pytest.mark.timeout(300)
def test_programs_across_part_of_a_slice_spanning_two_workers(module_cluster: LocalCluster,
                                                              wide: dict[int, tuple[str, int]],
                                                              outputs: Outputs) -> None:
    """A sub-mesh over devices of both workers runs as an SPMD computation of those two only,
    on those devices; the whole slice in reverse order too; their results read anywhere."""
    local = same_as_local(*outputs, "ACROSS")
    names = ["across", "span psum", "reversed", "then one", "to line", "then whole", "span loop"]
    assert len(local) == len(names) and all(ln.startswith(f"{n} ") for ln, n in zip(local, names, strict=True))
    expect(module_cluster, wide, {"across": [[1, 2]], "span_total": [[1, 2]], "reversed_times": [[0, 1, 2, 3]],
                                  "span_step": [[1, 2]] * 8})
    wait_for(lambda: worker_buffers(module_cluster) == 0, 30, "the program's buffers to be freed")


HOLD = PRELUDE + """
import gc, sys
span = Mesh(np.array([devs[1], devs[2]]), ("m",))
x = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(line, P("d")))
f = jax.jit(lambda v: v * 2)
g = jax.jit(lambda v: v + 1, out_shardings=NamedSharding(span, P("m")))
for _ in range(10):
    y = f(x)
    z = g(jax.device_put(y, NamedSharding(span, P("m"))))
    print("z", np.asarray(z).tolist())
del y, z
gc.collect()
print("holding", flush=True)
sys.stdin.readline()
"""


def buffers_per_worker(cluster: LocalCluster) -> list[int]:
    from schemas.pathways.v1 import worker_pb2 as wpb
    from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

    counts = []
    for host in cluster.hosts().values():
        with cluster.channel(host.address) as ch:
            counts.append(wgrpc.WorkerStub(ch).Stats(wpb.WorkerStatsRequest(), timeout=10).buffers)
    return sorted(counts)


@pytest.mark.timeout(300)
def test_results_spread_over_workers_go_from_each_when_dropped(module_cluster: LocalCluster,
                                                               wide: dict[int, tuple[str, int]],
                                                               tmp_path: Path) -> None:
    """Results of programs over both workers (the whole slice, a sub-mesh, gathered copies) are
    freed on every worker holding a part of them once the program drops them, while it runs:
    only its one live array (an upload sharded over both workers: a part on each) is left."""
    cluster = module_cluster
    env = proxy_env(cluster, tmp_path, PATHWAYS_SLICE="wide")
    run_on_slice("import jax, numpy as np\nprint(float(jax.jit(lambda v: v.sum())(np.ones(4, np.float32))))", env)
    proc = subprocess.Popen([sys.executable, "-c", HOLD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        lines = [proc.stdout.readline().strip() for _ in range(11)]
        assert lines == ["z [1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0]"] * 10 + ["holding"], lines
        wait_for(lambda: buffers_per_worker(cluster) == [1, 1], 30, "the dropped results to be freed on both workers")
        proc.stdin.write("done\n")
        proc.stdin.flush()
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    wait_for(lambda: worker_buffers(cluster) == 0, 30, "the program's buffers to be freed")
