"""An unmodified JAX program through the IFRT proxy uploads to a slice spanning workers while
the island's `jax.distributed` group forms again (a worker joined the island): storing bytes
needs only which worker holds which device, not the group, so uploads (sharded, onto one
device, replicated, and a staged one of 16 MiB) and their downloads go on at once; the
computations on them wait for the group, with no retry in the program. (A sharded upload goes
whole to the slice's first worker then: its parts, one per worker, need the group's devices.)"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for
from proxy_env import Program, proxy_env

from schemas.pathways.v1 import controller_pb2 as cpb

PROGRAM = """
import sys
import numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
devs = jax.devices()
line = Mesh(np.array(devs), ("d",))
print("ready", len(devs), flush=True)
sys.stdin.readline()
x = np.arange(16.0, dtype=np.float32).reshape(8, 2)
big = np.arange(4 << 20, dtype=np.float32)  # 16 MiB: streamed on to a worker as it arrives
ups = {
    "sharded": jax.device_put(x, NamedSharding(line, P("d"))),
    "one": jax.device_put(x, devs[3]),
    "replicated": jax.device_put(x, NamedSharding(line, P())),
    "staged": jax.device_put(big, devs[0]),
}
for name, a in ups.items():
    print(name, float(np.asarray(a, dtype=np.float64).sum()), flush=True)
sys.stdin.readline()
twice = jax.jit(lambda v: v * 2)
for name, a in ups.items():
    print("twice", name, float(np.asarray(twice(a), dtype=np.float64).sum()), flush=True)
"""

BIG_SUM = float(sum(range(4 << 20)))


def group_of(cluster: LocalCluster) -> str:
    with cluster.client() as c:
        return next(i.group for i in c.islands() if i.name == "a")


@pytest.mark.timeout(300)
@pytest.mark.cluster(islands=1, devices=2, heartbeat_timeout=60.0)
def test_uploads_go_on_while_the_islands_group_forms_again(cluster: LocalCluster, tmp_path: Path) -> None:
    cluster.add_worker("a", 2, name="w-a2")
    cluster.add_worker("a", 1, name="w-a3")  # in the island's group, holding none of the slice
    with cluster.client() as c:
        c.create_slice(cpb.SliceSpec(name="wide", devices=4))  # answers once the group formed
        assert {d.host for d in c.slices()[0].devices} == {"w-a", "w-a2"}
    wait_for(lambda: re.fullmatch(r"gen \d+: 3 hosts", group_of(cluster)), 60, "the group of three")
    with Program(PROGRAM, proxy_env(cluster, tmp_path, PATHWAYS_SLICE="wide")) as prog:
        assert prog.line() == "ready 4"
        # a worker joins the island while w-a3 is frozen: the next generation waits for w-a3,
        # which is still a live host (its heartbeats are late only after 60 s)
        cluster.stop_worker("w-a3")
        cluster.add_worker("a", 1, name="w-a4")
        wait_for(lambda: "forming" in group_of(cluster), 30, "the group forming again")
        prog.go()
        got = [prog.line() for _ in range(4)]
        assert got == ["sharded 120.0", "one 120.0", "replicated 120.0", f"staged {BIG_SUM}"], got
        assert not re.fullmatch(r"gen \d+: \d+ hosts", group_of(cluster))  # done while it formed
        prog.go()  # its first compile waits for the group (no retry in the program) ...
        time.sleep(2)
        assert not re.fullmatch(r"gen \d+: \d+ hosts", group_of(cluster))
        cluster.cont_worker("w-a3")  # ... which forms now
        got = [prog.line() for _ in range(4)]
        assert got == ["twice sharded 240.0", "twice one 240.0", "twice replicated 240.0",
                       f"twice staged {2 * BIG_SUM}"], got
        prog.finish()
