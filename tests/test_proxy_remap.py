"""An IFRT proxy session whose slice is re-placed while it runs (a host lost, the slice remapped
onto other workers): whether a program's results are whole on one worker or spread over several
is decided by the slice's placement at each run, not when the program was compiled, so its
results read back right after the remap; arrays whose parts were spread over workers before the
remap (results, and uploads sharded over both workers) fail with an error naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for
from proxy_env import Program, proxy_env

from schemas.pathways.v1 import controller_pb2 as cpb

PRELUDE = """
import sys
import numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
line = Mesh(np.array(jax.devices()), ("d",))
f = jax.jit(lambda v: v * 2)
x = np.arange(8.0, dtype=np.float32)
def run():  # after a remap the island's group of workers forms again: the run waits for it
    return f(jax.device_put(x, NamedSharding(line, P("d"))))
"""

REMAP = PRELUDE + """
print("one worker", np.asarray(run()).tolist(), flush=True)
sys.stdin.readline()
y = run()
print("two workers", np.asarray(y).tolist(), flush=True)
sys.stdin.readline()
try:
    print("stale", np.asarray(f(y)).tolist(), flush=True)
except Exception as e:
    print("stale error", str(e).replace(chr(10), " "), flush=True)
print("again", np.asarray(run()).tolist(), flush=True)
"""


def slice_of(cluster: LocalCluster, name: str) -> cpb.Slice:
    with cluster.client() as c:
        return next(s for s in c.slices() if s.name == name)


@pytest.mark.timeout(300)
@pytest.mark.cluster(islands=1, devices=2, heartbeat_timeout=15.0)
def test_a_proxy_sessions_slice_remapped_onto_two_workers_and_again(cluster: LocalCluster, tmp_path: Path) -> None:
    with cluster.client() as c:
        c.create_slice(cpb.SliceSpec(name="pair", devices=2))  # on w-a, the only worker yet
    cluster.add_worker("a", 1, name="w-a2", wait=False)  # both started at once
    cluster.add_worker("a", 1, name="w-a3", wait=False)
    cluster.wait_ready(["w-a2", "w-a3"])
    with Program(REMAP, proxy_env(cluster, tmp_path, PATHWAYS_SLICE="pair")) as prog:
        assert prog.line() == "one worker [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]"
        cluster.kill_worker("w-a")  # the slice moves onto w-a2 and w-a3, one device each
        wait_for(lambda: {d.host for d in slice_of(cluster, "pair").devices} == {"w-a2", "w-a3"}, 30,
                 "the slice remapped onto the two one-device workers")
        prog.go()
        # compiled while the slice was on one worker, its results are now spread over two
        assert prog.line() == "two workers [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]"
        cluster.add_worker("a", 2, name="w-a4")
        cluster.kill_worker("w-a3")  # remapped again: y's parts were on w-a2 and the lost w-a3
        wait_for(lambda: "w-a3" not in {d.host for d in slice_of(cluster, "pair").devices}, 30,
                 "the slice remapped again")
        prog.go()
        stale = prog.line()
        assert stale.startswith("stale error") and "re-placed (remap: generation 1 -> 2)" in stale, stale
        assert prog.line() == "again [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]"
        prog.finish()


READ_AFTER_REMAP = PRELUDE + """
def read(y):
    try:
        return np.asarray(y).tolist()
    except Exception as e:
        return "error " + str(e).replace(chr(10), " ")
y1, y2 = run(), run()  # not read here: the client keeps what it read
u = jax.device_put(x * 3, NamedSharding(line, P("d")))  # uploaded in parts, one on each worker
y1.block_until_ready(), y2.block_until_ready(), u.block_until_ready()
print("spread", y1.sharding.spec, flush=True)
sys.stdin.readline()
print("read at once", read(y1), flush=True)
print("run", np.asarray(run()).tolist(), flush=True)
print("read after a run", read(y2), flush=True)
print("upload read", read(u), flush=True)
print("upload run", read(f(u)), flush=True)
"""


@pytest.mark.timeout(300)
@pytest.mark.cluster(islands=1, devices=1, heartbeat_timeout=15.0)
def test_an_array_spread_over_workers_before_a_remap_onto_one_reads_as_an_error_naming_it(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """A result whose parts were on two workers, read back after the slice was re-placed onto one
    worker, fails with the error naming the remap, whether or not the program ran anything since
    (the session's count of the slice's workers is refreshed by runs only: it must not decide
    where a download reads from)."""
    cluster.add_worker("a", 1, name="w-a2")
    with cluster.client() as c:
        c.create_slice(cpb.SliceSpec(name="pair", devices=2))
    assert {d.host for d in slice_of(cluster, "pair").devices} == {"w-a", "w-a2"}
    with Program(READ_AFTER_REMAP, proxy_env(cluster, tmp_path, PATHWAYS_SLICE="pair")) as prog:
        assert prog.line() == "spread P('d',)"
        cluster.add_worker("a", 2, name="w-a3")
        cluster.kill_worker("w-a")
        cluster.kill_worker("w-a2")
        wait_for(lambda: {d.host for d in slice_of(cluster, "pair").devices} == {"w-a3"}, 60,
                 "the slice re-placed onto w-a3 alone")
        prog.go()
        first = prog.line()
        assert first.startswith("read at once error") and "re-placed (remap" in first, first
        assert prog.line() == "run [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]"
        again = prog.line()
        assert again.startswith("read after a run error") and "re-placed (remap" in again, again
        for what in ("upload read", "upload run"):  # an upload in parts reads as the results do
            line = prog.line()
            assert line.startswith(f"{what} error") and "re-placed (remap" in line, line
        prog.finish()
