"""donate_argnums end to end: a donated input is consumed on its worker (using it again is a clear
error), the results are right, and an input not donated stays usable; prints one JSON object."""

import json

import numpy as np
from jax.sharding import PartitionSpec as P

import pwctl as pw

s = pw.make_virtual_device_set().add_slice(devices=2)
out = {}


def attempt(fn):
    try:
        return {"value": np.asarray(fn()).tolist()}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def plus_one(v):
    return v + 1.0


def accumulate(acc, g):
    return acc + g


def scaled(w, x):
    return w * x


make = pw.pmap(plus_one, devices=s.devices)
step = pw.pmap(accumulate, devices=s.devices, donate_argnums=0)  # acc is donated

acc = make(np.zeros((2, 3)))  # lives on the worker
g = make(np.ones((2, 3)))
new = step(acc, g)
out["pmap_result"] = np.asarray(new).tolist()  # 1 + 2
out["pmap_not_donated"] = attempt(lambda: g)  # g was not donated: still there
out["pmap_reuse"] = attempt(lambda: step(acc, g))  # acc was consumed
out["pmap_fetch_donated"] = attempt(lambda: acc)
out["pmap_other_reader"] = attempt(lambda: make(acc))  # a function that does not donate

mesh = s.mesh(("d",))
scale = pw.jit(scaled, mesh, in_shardings=(P("d"), P("d")), out_shardings=P("d"), donate_argnums=0)
w = pw.jit(lambda x: x + 2.0, mesh, in_shardings=P("d"), out_shardings=P("d"))(np.arange(4.0))
x = np.full(4, 3.0)
out["jit_result"] = np.asarray(scale(w, x)).tolist()  # (i + 2) * 3
out["jit_reuse"] = attempt(lambda: scale(w, x))
out["after"] = attempt(lambda: step(make(np.zeros((2, 3))), g))  # the session goes on
print(json.dumps(out))
