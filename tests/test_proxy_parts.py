"""Unmodified JAX programs through the IFRT proxy on a real local cluster: programs over part of
the slice's devices or over its devices in another order (ProgramNode.devices), and results
whose sharding only XLA's sharding propagation decides (the workers compile at Compile time and
report it). Each program's output is compared with the same program on 4 local CPU devices.

The three programs run once, in one process on each side (`outputs`), on one cluster for the
module; each test checks its own program's lines."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import LocalCluster, wait_for
from test_proxy_cluster import Outputs, local_and_proxied, same_as_local, worker_buffers

PRELUDE = """
import numpy as np, jax, jax.numpy as jnp
from functools import partial
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
from jax import shard_map
devs = jax.devices()
def show(name, a):
    print(name, np.asarray(a).round(4).tolist(), a.sharding,
          [(s.device.id, s.index, np.asarray(s.data).round(4).tolist()) for s in a.addressable_shards])
"""

PARTS = PRELUDE + """
back = Mesh(np.array(devs[2:]), ("b",))
y = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(back, P("b")))
show("y2", jax.jit(lambda v: v * 2)(y))
@jax.jit
@partial(shard_map, mesh=back, in_specs=P("b"), out_specs=P())
def total(blk):
    return jax.lax.psum(jnp.sum(blk, keepdims=True), "b")
show("psum", total(y))
front = Mesh(np.array(devs[:2]), ("a",))
f = jax.jit(lambda v: jnp.sin(v) @ v.T + 1, in_shardings=NamedSharding(front, P("a")),
            out_shardings=NamedSharding(front, P(None, "a")))
show("front", f(np.arange(12.0, dtype=np.float32).reshape(4, 3)))
r = jax.pmap(lambda v: jax.lax.psum(v, "i") * v, axis_name="i", devices=devs[2:])(np.arange(2.0, dtype=np.float32))
print("pmap", np.asarray(r).tolist(), [s.device.id for s in r.addressable_shards])
step = jax.jit(lambda v: v + 1, donate_argnums=0)
d = jax.device_put(np.ones((4, 2), np.float32), NamedSharding(back, P("b")))
for _ in range(3):
    d = step(d)
show("donated", d)
rev = Mesh(np.array(devs[::-1]), ("r",))
x = jax.device_put(np.arange(16.0, dtype=np.float32).reshape(4, 4), NamedSharding(rev, P("r")))
show("x", x)
show("xr", jax.jit(lambda v: v @ v.T, out_shardings=NamedSharding(rev, P("r")))(x))
odd = Mesh(np.array([devs[3], devs[1], devs[2], devs[0]]).reshape(2, 2), ("p", "q"))
z = jax.device_put(x, NamedSharding(odd, P("p", "q")))
show("z", z)
w = jax.jit(lambda v: v + 1, out_shardings=NamedSharding(odd, P("q")))(z)
show("w", w)
@jax.jit
@partial(shard_map, mesh=odd, in_specs=P("p", "q"), out_specs=P("p"))
def rows(blk):
    return jax.lax.psum(blk, "q")
show("rows", rows(z))
mid = Mesh(np.array([devs[2], devs[0]]), ("m",))
u = jax.device_put(w, NamedSharding(mid, P("m")))
show("u", jax.jit(lambda v: v * 3)(u))
line = Mesh(np.array(devs), ("d",))
show("in order", jax.device_put(x, NamedSharding(line, P("d"))))
show("odd order", jax.device_put(x, NamedSharding(Mesh(np.array(odd.devices).ravel(), ("o",)), P("o"))))
show("whole", jax.jit(lambda v: v.sum(0))(jax.device_put(u, NamedSharding(line, P("d")))))
"""

PROPAGATED = PRELUDE + """
line = Mesh(np.array(devs), ("d",))
x = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(line, P("d")))
y = jax.jit(lambda v: v * 2)(x)
show("y", y)
show("y next", jax.jit(lambda v: jnp.cos(v) + v)(y))
c = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(line, P(None, "d")))
gram, cols, flat = jax.jit(lambda v: (v.T @ v, v.sum(0), v.reshape(-1)))(c)
show("gram", gram)
show("cols", cols)
show("flat", flat)
show("gram next", jax.jit(lambda a, b: a @ a + b)(gram, cols))
grid = Mesh(np.array(devs).reshape(2, 2), ("p", "q"))
g = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(grid, P("p", "q")))
t = jax.jit(lambda v: jnp.tanh(v.T) * 2)(g)
show("t", t)
show("t next", jax.jit(lambda v: v.sum(1))(t))
back = Mesh(np.array(devs[2:]), ("b",))
s = jax.jit(lambda v: v.T + 1)(jax.device_put(np.arange(8.0, dtype=np.float32).reshape(2, 4),
                                              NamedSharding(back, P(None, "b"))))
show("s", s)
show("s next", jax.jit(lambda v: v * v)(s))
"""


pytestmark = pytest.mark.cluster(islands=1, devices=4)


@pytest.fixture(scope="module")
def outputs(module_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Outputs:
    """PARTS, PROPAGATED and ONE_DEVICE on 4 local CPU devices and through the proxy on 4."""
    return local_and_proxied(module_cluster, tmp_path_factory.mktemp("parts"),
                             {"PARTS": PARTS, "PROPAGATED": PROPAGATED, "ONE_DEVICE": ONE_DEVICE}, 4)


@pytest.mark.timeout(300)
def test_programs_over_part_of_the_slice_and_other_orders(module_cluster: LocalCluster, outputs: Outputs) -> None:
    local = same_as_local(*outputs, "PARTS")
    by_name = {ln.split(" [", 1)[0]: ln for ln in local}
    assert by_name["y2"].startswith("y2 [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0] ")
    assert by_name["y2"].endswith("[(2, (slice(0, 4, None),), [0.0, 2.0, 4.0, 6.0]), "
                                  "(3, (slice(4, 8, None),), [8.0, 10.0, 12.0, 14.0])]")
    assert by_name["psum"].startswith("psum [28.0] ")
    assert by_name["pmap"] == "pmap [0.0, 1.0] [2, 3]"
    assert by_name["donated"].startswith("donated [[4.0, 4.0], ")
    assert by_name["x"].endswith("[(3, (slice(0, 1, None), slice(None, None, None)), [[0.0, 1.0, 2.0, 3.0]]), "
                                 "(2, (slice(1, 2, None), slice(None, None, None)), [[4.0, 5.0, 6.0, 7.0]]), "
                                 "(1, (slice(2, 3, None), slice(None, None, None)), [[8.0, 9.0, 10.0, 11.0]]), "
                                 "(0, (slice(3, 4, None), slice(None, None, None)), [[12.0, 13.0, 14.0, 15.0]])]")
    assert by_name["rows"].startswith("rows [[2.0, 4.0], [10.0, 12.0], [18.0, 20.0], [26.0, 28.0]] ")
    assert by_name["whole"].startswith("whole [28.0, 32.0, 36.0, 40.0] ")
    wait_for(lambda: worker_buffers(module_cluster) == 0, 30, "the programs' buffers to be freed")


@pytest.mark.timeout(300)
def test_results_get_the_shardings_xla_propagation_picks(module_cluster: LocalCluster, outputs: Outputs) -> None:
    local = same_as_local(*outputs, "PROPAGATED")
    by_name = {ln.split(" [", 1)[0]: ln for ln in local}
    # propagation shards these results, not as replicated: the proxy reports the same
    assert "spec=P('d',)" in by_name["y"]
    assert "spec=P()" not in by_name["gram"] and "spec=P()" not in by_name["cols"]
    assert "spec=P(None, 'b')" not in by_name["s"] and "spec=P()" not in by_name["s"]
    wait_for(lambda: worker_buffers(module_cluster) == 0, 30, "the programs' buffers to be freed")


ONE_DEVICE = PRELUDE + """
def triple(v):
    return v * 3 + 1
f = jax.jit(triple)
for d in (2, 3, 2):
    x = jax.device_put(np.arange(4.0, dtype=np.float32) + d, devs[d])
    show(f"on {d}", f(x))
"""


@pytest.mark.timeout(300)
def test_a_one_device_program_runs_on_its_device_only(module_cluster: LocalCluster, outputs: Outputs) -> None:
    """A jit on one device of a 4-device slice runs there (ProgramNode.devices), not replicated
    over the slice: the scheduler holds that device only, and the worker launches it on one."""
    local = same_as_local(*outputs, "ONE_DEVICE")
    assert [ln.split(" [")[0] for ln in local] == ["on 2", "on 3", "on 2"]
    assert local[1].startswith("on 3 [10.0, 13.0, 16.0, 19.0] SingleDeviceSharding(device=CpuDevice(id=3)")
    with module_cluster.client() as c:
        def runs() -> list[dict[str, Any]]:
            events = json.loads(c.trace_window().chrome_trace_json)["traceEvents"]
            return [e for e in events if e["ph"] == "X" and "triple" in e["name"]]
        wait_for(lambda: len({e["args"]["run_id"] for e in runs()}) >= 3, 30, "the three runs in the trace")
        devices = sorted(e["tid"] for e in runs())
    # each run on the one device it was given: two on device 2, one on device 3
    assert devices == [2, 2, 3], devices
