"""A worker's part of an upload sharded over several members of its island group
(server/worker/parts.py `uploaded_part`, worker.proto `PartOf`): the bytes of its distinct shards
become a jax.Array of the global shape whose shards are those bytes, under a NamedSharding with the
client's shards on the client's devices; bytes that are not its shards' size, a sharding that is
not one, devices outside the group, another group generation are refused with a ValueError saying
so. Real JAX on 4 CPU devices of one process, all of them this worker's (process 0 of a group
whose state is set as a join leaves it); the multi-process case is tests/test_proxy_spread_uploads.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

CHECK = r"""
import json
import numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from schemas.pathways.v1 import worker_pb2 as wpb
from server.worker.group import IslandGroup
from server.worker.parts import uploaded_part

devs = jax.devices()
group = IslandGroup()
group.generation = group.announced = 7
group.num_processes = 2  # process 0's devices are all 4 local ones
group._by_process = {0: list(devs)}
out = {}
value = np.arange(64, dtype=np.float32).reshape(8, 8)

def part_of(ns, shape=(8, 8), generation=7, devices=None):
    return wpb.PartOf(global_shape=list(shape), op_sharding=ns._to_xla_hlo_sharding(len(shape)).to_proto()
                      .SerializeToString(), devices=devices if devices is not None else
                      [d.id for d in ns._internal_device_list], group_generation=generation).SerializeToString()

def flat(ns):  # the distinct shards in the order of their first device, as the proxy sends them
    seen = {}
    for d in ns._internal_device_list:
        idx = ns.devices_indices_map(value.shape)[d]
        seen.setdefault(tuple((s.start, s.stop) for s in idx), value[idx])
    return np.concatenate([s.reshape(-1) for s in seen.values()])

grid = Mesh(np.array(devs).reshape(2, 2), ("a", "b"))
rev = Mesh(np.array(devs[::-1]), ("r",))
for name, ns in [("rows", NamedSharding(Mesh(np.array(devs), ("d",)), P("d"))), ("grid", NamedSharding(grid, P("a"))),
                 ("transposed", NamedSharding(grid, P("b", "a"))), ("reversed", NamedSharding(rev, P(None, "r")))]:
    x = uploaded_part(flat(ns), part_of(ns), group, list(devs))
    out[name] = [bool(np.array_equal(np.asarray(x), value)), x.sharding.is_equivalent_to(ns, 2),
                 x.sharding.devices_indices_map(value.shape) == ns.devices_indices_map(value.shape)]

rows = NamedSharding(Mesh(np.array(devs), ("d",)), P("d"))
bad = {"short": (flat(rows)[:-1], part_of(rows)), "generation": (flat(rows), part_of(rows, generation=6)),
       "device": (flat(rows), part_of(rows, devices=[0, 1, 2, 5])),
       "twice": (flat(rows), part_of(rows, devices=[0, 1, 1, 2])), "undecodable": (flat(rows), b"\xff\xff"),
       "rank": (flat(rows), wpb.PartOf(global_shape=[64], op_sharding=wpb.PartOf.FromString(part_of(rows))
                                        .op_sharding, devices=[0, 1, 2, 3], group_generation=7).SerializeToString())}
for name, (data, raw) in bad.items():
    try:
        uploaded_part(data, raw, group, list(devs))
        out[name] = "accepted"
    except ValueError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_uploaded_parts_hold_the_clients_shards_and_bad_ones_are_refused() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4", PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    # the same shards on the same devices; equivalent to the client's sharding (a run reads it as
    # it is) where its mesh's axes are in tile order: a transposed one is resharded by the run
    for name in ("rows", "grid", "reversed"):
        assert out[name] == [True, True, True], (name, out[name])
    assert out["transposed"][0] and out["transposed"][2], out["transposed"]
    assert out["short"] == "63 elements for the shards on this worker's devices of a [8, 8] array (64 elements)"
    assert "generation 6" in out["generation"] and "generation 7" in out["generation"], out["generation"]
    assert out["device"] == "devices [0, 1, 2, 5] are not all devices of island group generation 7"
    assert "some twice" in out["twice"], out["twice"]
    assert out["undecodable"] == "an undecodable part_of"
    assert "not a tiling of a 1-d array" in out["rank"], out["rank"]


def test_only_plain_tilings_are_uploaded_in_parts() -> None:
    """The controller sends parts only for a sharding a worker can hold a part of (shardings.py
    `tiled`): a tiling, replicated on its last tile dimension at most; anything else (a manual
    subgroup, a replicated array) goes whole as before."""
    import math

    from jax._src.lib import xla_client as xc

    from server.proxy.shardings import Sharding

    def op(dims: list[int], last: tuple[Any, ...] = ()) -> bytes:
        o = xc.OpSharding()
        o.type = xc.OpSharding.Type.OTHER
        o.tile_assignment_dimensions = dims
        o.tile_assignment_devices = list(range(math.prod(dims)))
        o.last_tile_dims = list(last)
        return bytes(o.SerializeToString())

    devices = (0, 1, 2, 3)
    assert Sharding(devices, op([4, 1])).tiled
    assert Sharding(devices, op([2, 1, 2], (xc.OpSharding.Type.REPLICATED,))).tiled
    assert not Sharding(devices, op([2, 1, 2], (xc.OpSharding.Type.MANUAL,))).tiled
    assert not Sharding(devices).tiled
