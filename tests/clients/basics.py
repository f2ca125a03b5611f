"""Standalone calls, pytrees, futures and chaining; prints one JSON object."""

import json

import numpy as np

import pwctl as pw

s = pw.make_virtual_device_set().add_slice(devices=2)
double = pw.pmap(lambda x: x * 2.0, devices=s.devices)
out = {}

f = double(np.array([1.0, 2.0]))
out["shape"], out["dtype"] = list(f.shape), str(f.dtype)  # known without fetching
g = double(f)  # a future as input: its bytes never come to the client
out["chained"] = np.asarray(g).tolist()
k = double(g)  # not fetched: block_until_ready must ask its worker, and fetch nothing
out["ready"] = k.block_until_ready(timeout=60) is k and k._value is None
out["ready_value"] = np.asarray(k).tolist()
h = double(g)
tree_in = {"h": h, "more": [double(h), 3]}
out["waited"] = pw.block_until_ready(tree_in) is tree_in and h._value is None  # waited, fetched nothing
out["after_wait"] = np.asarray(tree_in["more"][0]).tolist()


def tree_fn(d):
    return {"sum": d["a"] + d["b"], "pair": (d["a"] * 2, d["b"] - 1)}


tree = pw.pmap(tree_fn, devices=s.devices)
r = tree({"a": np.arange(2, dtype=np.float32), "b": np.ones(2, np.float32)})
out["tree"] = {
    "sum": r["sum"].result().tolist(),
    "pair": [r["pair"][0].result().tolist(), r["pair"][1].result().tolist()],
}

x = double(np.array([1.0, 1.0]))
for _ in range(10):  # a loop of calls never waits for replies; values stay on the workers
    x = double(x)
out["loop"] = np.asarray(x).tolist()


@pw.program
def prog(v, w):
    return double(v), double(double(w))


a, b = prog(np.array([1.0, 2.0]), np.array([3.0, 4.0]))
a2, b2 = prog(np.array([5.0, 6.0]), np.array([7.0, 8.0]))  # same signature: no new trace
out["prog"] = [a.result().tolist(), b.result().tolist(), a2.result().tolist(), b2.result().tolist()]
out["traces"] = len(prog._cache)
print(json.dumps(out))
