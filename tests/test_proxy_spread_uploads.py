"""An unmodified JAX program's upload sharded over devices of both workers of a slice spanning two
workers (2 devices each) goes in parts: each worker receives and holds only the shards on its own
devices (its part of the global array, as a run over both workers leaves its results), runs over
exactly those devices read it in place, downloads return its bytes, and freeing it frees both
parts. Checked in the workers' buffer counts and bytes (exact) and their transfer logs, with the
program's output equal to the same program on 4 local CPU devices; then arrays read under another
sharding, on other devices, and in another device order give the same numbers as locally."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for
from proxy_env import Program, client_env, plain_lines, proxy_env, start_plain
from test_proxy_cluster import worker_buffers
from test_proxy_submesh import LOCAL4, PRELUDE, two_workers
from test_proxy_uploads import transfers, worker_stats

R = 1024  # rows of 8 float32 of the batch: 32 KiB, under the proxy's staging threshold (4 MiB)

SPREAD = PRELUDE + f"""
import sys
R = {R}
grid = Mesh(np.array(devs).reshape(2, 2), ("a", "b"))
batch = jax.device_put(np.arange(R * 8, dtype=np.float32).reshape(R, 8) / 9, NamedSharding(line, P("d")))
halves = jax.device_put(np.arange(32, dtype=jnp.bfloat16).reshape(8, 4),  # 2 copies of a half
                        NamedSharding(grid, P("a")))
batch.block_until_ready()
halves.block_until_ready()
print("uploaded", flush=True)
sys.stdin.readline()
def spread_step(v):
    return jnp.sin(v) * 2 + 1
out = jax.jit(spread_step, out_shardings=NamedSharding(line, P("d")))(batch)
twice = jax.jit(lambda v: v * 2, out_shardings=NamedSharding(grid, P("a")))(halves)
print("batch", np.asarray(batch)[::97].round(4).tolist(), float(np.asarray(batch, np.float64).sum()))
print("out", np.asarray(out)[::97].round(4).tolist(), float(np.asarray(out, np.float64).sum()))
show("halves", halves)
show("twice", twice)
print("read", flush=True)
sys.stdin.readline()
del batch, out, halves, twice
print("freed", flush=True)
sys.stdin.readline()
x = jax.device_put(np.arange(64, dtype=np.float32).reshape(16, 4) - 20, NamedSharding(line, P("d")))
def col_sum(v):
    return v.sum(0)
show("other sharding", jax.jit(col_sum)(jax.device_put(x, NamedSharding(line, P(None, "d")))))
show("one device", jax.jit(col_sum)(jax.device_put(x, devs[2])))
show("one worker", jax.jit(col_sum, out_shardings=NamedSharding(back, P()))(
    jax.device_put(x, NamedSharding(back, P("s")))))
rev = Mesh(np.array(devs[::-1]), ("r",))
show("reversed", jax.jit(lambda v: v * 3, out_shardings=NamedSharding(rev, P("r")))(
    jax.device_put(x, NamedSharding(rev, P("r")))))
span = Mesh(np.array([devs[1], devs[2]]), ("m",))
s = jax.device_put(np.arange(8.0, dtype=np.float32).reshape(4, 2), NamedSharding(span, P("m")))
show("span", jax.jit(lambda v: jnp.cos(v) + v, out_shardings=NamedSharding(span, P("m")))(s))
show("span on line", jax.jit(lambda v: v + 1)(jax.device_put(s, NamedSharding(line, P("d")))))
show("span read whole", jax.jit(col_sum)(s))
cols = jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8), NamedSharding(line, P(None, "d")))
show("columns", cols)
show("columns summed", jax.jit(lambda v: v.sum(1))(cols))
"""


@pytest.mark.timeout(300)
@pytest.mark.cluster(islands=1, devices=2, heartbeat_timeout=15.0)
def test_sharded_uploads_over_both_workers_go_in_parts(cluster: LocalCluster, tmp_path: Path) -> None:
    local = start_plain(SPREAD, client_env(tmp_path, **LOCAL4), "go\ngo\ngo\n")  # plain JAX, meanwhile
    where = two_workers(cluster)
    front = where[0][0]
    assert where[1][0] == front != where[2][0] == where[3][0]  # virtual 0, 1 on one worker; 2, 3 on the other
    env = proxy_env(cluster, tmp_path, PATHWAYS_SLICE="wide")
    with Program(SPREAD, env) as prog:
        assert prog.line() == "uploaded"
        # each worker holds half of `batch` (its rows) and half of `halves` (the half its two
        # devices share, once): exactly, nothing whole anywhere
        half = R * 8 * 4 // 2 + 8 * 4 * 2 // 2  # float32 rows, bfloat16 halves
        stats = worker_stats(cluster)
        assert {name: (s.buffers, s.buffer_bytes) for name, s in stats.items()} == {
            name: (2, half) for name in stats}, stats
        prog.go()
        lines = []
        while not lines or lines[-1] != "read":
            lines.append(prog.line())
        # the runs over both workers read the parts in place, and so did the downloads (gathered
        # by a run on their devices): no worker sent a buffer to another
        assert transfers(cluster) == [], transfers(cluster)
        # the results `out` and `twice`, left spread over both workers, count only the part each
        # holds, as the uploads do (held_nbytes in server/worker/shards.py), not the whole array
        stats = worker_stats(cluster)
        assert {name: (s.buffers, s.buffer_bytes) for name, s in stats.items()} == {
            name: (4, 2 * half) for name in stats}, stats
        prog.go()
        assert prog.line() == "freed"
        wait_for(lambda: worker_buffers(cluster) == 0, 30, "both parts of every array to be freed")
        out = prog.finish("go\n", timeout=120)
    local_lines = plain_lines(local)
    assert ["uploaded", *lines, "freed", *out.splitlines()] == local_lines
    wait_for(lambda: worker_buffers(cluster) == 0, 30, "the program's buffers to be freed")


STAGED = PRELUDE + """
import sys
big = np.arange(4 << 20, dtype=np.float32).reshape(4096, 1024) / 7  # 16 MiB: its 4 MiB shards are staged
x = jax.device_put(big, NamedSharding(line, P("d")))
grid = Mesh(np.array(devs).reshape(2, 2), ("a", "b"))
g = jax.device_put(big[::-1] * 3, NamedSharding(grid, P("a")))  # each worker's two devices share a half
x.block_until_ready()
g.block_until_ready()
print("uploaded", flush=True)
sys.stdin.readline()
y = jax.jit(lambda v: jnp.sin(v) + v, out_shardings=NamedSharding(line, P("d")))(x)
h = jax.jit(lambda v: v[:, :8] - 1, out_shardings=NamedSharding(grid, P("a")))(g)
for name, a in (("x", x), ("y", y), ("g", g), ("h", h)):
    print(name, float(np.asarray(a, np.float64).sum()), np.asarray(a)[::1023, ::511].round(3).tolist())
"""


@pytest.mark.timeout(300)
@pytest.mark.cluster(islands=1, devices=2, heartbeat_timeout=15.0)
def test_staged_shards_over_both_workers_become_parts_where_they_are(cluster: LocalCluster, tmp_path: Path) -> None:
    """Shards of 4 MiB or more are streamed on to the slice's first worker before the client says
    which devices they are for; an array of them sharded over both workers then becomes its parts
    there without coming back through the controller: the other worker's shards move to it,
    worker to worker, each worker makes its part, and the shards' own buffers go (one shard for both of a
    worker's devices too). Checked in the workers' buffer counts and bytes (exact: half of each
    array on each worker), with the program's output equal to the
    same program on 4 local CPU devices."""
    local = start_plain(STAGED, client_env(tmp_path, **LOCAL4), "go\n")  # plain JAX, meanwhile
    where = two_workers(cluster)
    assert where[0][0] == where[1][0] != where[2][0] == where[3][0]
    env = proxy_env(cluster, tmp_path, PATHWAYS_SLICE="wide")
    with Program(STAGED, env) as prog:
        assert prog.line() == "uploaded"

        def halves() -> bool:
            return all((s.buffers, s.buffer_bytes) == (2, 16 << 20) for s in worker_stats(cluster).values())

        wait_for(halves, 30, f"half of the array on each worker, and nothing else: {worker_stats(cluster)}")
        # the other worker's shards came from the first worker, not through the controller (which
        # sends its parts itself where it reads the shards back)
        second = cluster.hosts()[where[2][0]].address
        assert any(f"first transfer to {second}" in ln for ln in transfers(cluster)), transfers(cluster)
        out = prog.finish("go\n", timeout=120)
    local_lines = plain_lines(local)
    assert ["uploaded", *out.splitlines()] == local_lines
    wait_for(lambda: worker_buffers(cluster) == 0, 30, "the program's buffers to be freed")
