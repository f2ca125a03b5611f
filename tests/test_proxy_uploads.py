"""Where an unmodified JAX program's uploads land on a slice spanning two workers (2 devices
each): an array for devices of one worker (one device, or a sub-mesh of that worker's devices)
is stored on that worker, not on the slice's first one; a replicated array over devices of both
is a copy on each; programs read them where they are, with no transfer between workers (nor for
a result spread over both workers, read by a run on the same devices). A staged upload (4 MiB or
more, streamed on to the first worker before its devices are known) then moves there, worker to
worker. A sharded array over devices of both workers goes in parts (each worker gets its own
devices' shards: tests/test_proxy_spread_uploads.py) and is read in place too. Checked in the
workers' buffer counts and bytes and their transfer logs, with the program's output equal to the
same program on 4 local CPU devices."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for
from proxy_env import Program, client_env, plain_lines, proxy_env, start_plain
from test_proxy_cluster import worker_buffers
from test_proxy_submesh import LOCAL4, PRELUDE, expect, run_on_slice, two_workers

from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

N = 4096  # float32 elements of each upload: under the proxy's staging threshold (4 MiB)

UPLOADS = PRELUDE + f"""
import sys
N = {N}
one = jax.device_put(np.arange(N, dtype=np.float32), devs[3])  # MakeArrayFromHostBuffer
pair = jax.device_put(np.arange(2 * N, dtype=np.float32).reshape(2, N),  # MakeArraysFromHostBufferShards
                      NamedSharding(back, P("s")))
rep = jax.device_put(np.arange(N, dtype=np.float32) / 7, NamedSharding(line, P()))  # replicated over both
one.block_until_ready()
pair.block_until_ready()
rep.block_until_ready()
print("uploaded", flush=True)
sys.stdin.readline()
def up_scaled(v):
    return (v * 3)[:4]
def up_rows(v):
    return v.sum(1)
def rep_split(v):
    return v.reshape(4, -1).sum(1)
def rep_head(v):
    return v[:3] * 2
show("one", jax.jit(up_scaled)(one))
show("pair", jax.jit(up_rows, out_shardings=NamedSharding(back, P("s")))(pair))
show("rep", jax.jit(rep_split, out_shardings=NamedSharding(line, P("d")))(rep))
show("rep back", jax.jit(rep_head)(jax.device_put(rep, devs[2])))
show("rep front", jax.jit(rep_head)(jax.device_put(rep, devs[0])))
print("read", flush=True)
sys.stdin.readline()
whole = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(line, P("d")))  # in parts on both
show("whole", jax.jit(lambda v: v + 1)(whole))
"""


def worker_stats(cluster: LocalCluster) -> dict[str, wpb.WorkerStats]:
    out = {}
    for name, host in cluster.hosts().items():
        with cluster.channel(host.address) as ch:
            out[name] = wgrpc.WorkerStub(ch).Stats(wpb.WorkerStatsRequest(), timeout=10)
    return out


def transfers(cluster: LocalCluster) -> list[str]:
    """The workers' log lines of their first transfer to each peer (server/worker/transfer.py)."""
    return [ln for log in sorted(cluster.home.glob("worker-*.log"))
            for ln in log.read_text(errors="replace").splitlines() if "first transfer to" in ln]


@pytest.mark.timeout(300)
@pytest.mark.cluster(islands=1, devices=2, heartbeat_timeout=15.0)
def test_uploads_for_one_workers_devices_go_to_that_worker(cluster: LocalCluster, tmp_path: Path) -> None:
    local = start_plain(UPLOADS, client_env(tmp_path, **LOCAL4), "go\ngo\n")  # plain JAX, meanwhile
    where = two_workers(cluster)
    owner = where[3][0]
    assert where[2][0] == owner != where[0][0] == where[1][0]  # virtual 0, 1 on one worker; 2, 3 on the other
    env = proxy_env(cluster, tmp_path, PATHWAYS_SLICE="wide")
    run_on_slice("import jax, numpy as np\nprint(float(jax.jit(lambda v: v.sum())(np.ones(4, np.float32))))", env)
    wait_for(lambda: worker_buffers(cluster) == 0, 30, "the warm-up's buffers to be freed")
    with Program(UPLOADS, env) as prog:
        assert prog.line() == "uploaded"
        stats = worker_stats(cluster)
        # `one` and `pair` on the worker of devices 2 and 3 only; a copy of `rep` on each worker
        assert (stats[owner].buffers, stats[owner].buffer_bytes) == (3, 4 * N * 4), stats
        other = next(name for name in stats if name != owner)
        assert (stats[other].buffers, stats[other].buffer_bytes) == (1, N * 4), stats
        prog.go()
        lines = []
        while not lines or lines[-1] != "read":
            lines.append(prog.line())
        # every program so far read its inputs where they were, the downloads of `rep_split`'s
        # result spread over both workers too (gathered by a run on its devices): no worker sent
        # a buffer to another
        assert transfers(cluster) == [], transfers(cluster)
        out = prog.finish("go\n", timeout=120)
    local_lines = plain_lines(local)
    assert ["uploaded", *lines, *out.splitlines()] == local_lines
    assert transfers(cluster) == [], transfers(cluster)  # `whole`, in parts on both workers, read in place
    assert local_lines[1].startswith(
        "one [0.0, 3.0, 6.0, 9.0] SingleDeviceSharding(device=CpuDevice(id=3)")
    expect(cluster, where, {"up_scaled": [[3]], "up_rows": [[2, 3]], "rep_split": [[0, 1, 2, 3]],
                            "rep_head": [[2], [0]]})
    wait_for(lambda: worker_buffers(cluster) == 0, 30, "the program's buffers to be freed")



M = 2 << 20  # float32 elements (8 MiB) of each staged upload: over the proxy's staging threshold

STAGED = PRELUDE + f"""
import sys
M = {M}
one = jax.device_put(np.arange(M, dtype=np.float32), devs[3])  # staged before its device is known
back_rep = jax.device_put(np.arange(M, dtype=np.float32) / 3, NamedSharding(back, P()))
front = jax.device_put(np.arange(M, dtype=np.float32) / 5, devs[1])  # the first worker's: it stays
rep = jax.device_put(np.arange(M, dtype=np.float32) / 7, NamedSharding(line, P()))  # a copy on each
for a in (one, back_rep, front, rep):
    a.block_until_ready()
print("uploaded", flush=True)
sys.stdin.readline()
def big_head(v):
    return (v * 3)[:4]
show("one", jax.jit(big_head)(one))
show("back rep", jax.jit(big_head)(back_rep))
show("front", jax.jit(big_head)(front))
show("rep back", jax.jit(big_head)(jax.device_put(rep, devs[2])))
show("rep front", jax.jit(big_head)(jax.device_put(rep, devs[0])))
print("sums", float(np.asarray(one, np.float64).sum()), float(np.asarray(back_rep, np.float64).sum()))
"""


@pytest.mark.timeout(300)
@pytest.mark.cluster(islands=1, devices=2, heartbeat_timeout=15.0)
def test_staged_uploads_for_one_workers_devices_move_to_that_worker(cluster: LocalCluster, tmp_path: Path) -> None:
    """A host buffer of 4 MiB or more is streamed on to the slice's first worker before the
    client says which devices it is for; one for another worker's devices then moves there, worker
    to worker, and is read there. Checked in the workers' buffer counts and bytes, with the
    program's output equal to the same program on 4 local CPU devices."""
    local = start_plain(STAGED, client_env(tmp_path, **LOCAL4), "go\n")  # plain JAX, meanwhile
    where = two_workers(cluster)
    owner = where[3][0]
    first = min(h for h, _ in where.values())  # where staged uploads land (the group's first member)
    assert where[2][0] == owner != first == where[1][0]
    env = proxy_env(cluster, tmp_path, PATHWAYS_SLICE="wide")
    with Program(STAGED, env) as prog:
        assert prog.line() == "uploaded"

        def placed() -> bool:
            stats = worker_stats(cluster)
            return ((stats[owner].buffers, stats[owner].buffer_bytes) == (3, 3 * M * 4)
                    and (stats[first].buffers, stats[first].buffer_bytes) == (2, 2 * M * 4))

        # `one` and `back_rep` on the worker of devices 2 and 3 only (moved there), `front` stays,
        # `rep` is a copy on each
        wait_for(placed, 30, f"the staged uploads on their devices' workers: {worker_stats(cluster)}")
        assert any(f"first transfer to {cluster.hosts()[owner].address}" in ln for ln in transfers(cluster))
        out = prog.finish("go\n", timeout=120)
    local_lines = plain_lines(local)
    assert ["uploaded", *out.splitlines()] == local_lines
    expect(cluster, where, {"big_head": [[3], [2, 3], [1], [2], [0]]})
    wait_for(lambda: worker_buffers(cluster) == 0, 30, "the program's buffers to be freed")
