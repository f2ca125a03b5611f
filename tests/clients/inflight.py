"""A loop that calls without waiting, with PWCTL_MAX_IN_FLIGHT=4: every call past the fourth
waits until the controller reports a run over. Prints the most runs ever in flight, the result
and how many runs the controller reported over at the end, as JSON."""

import json

import jax.numpy as jnp
import numpy as np

import pwctl as pw
from pwctl.api.runtime import Runtime

s = pw.make_virtual_device_set().add_slice(devices=1, island="a")


def slow_inc(x):
    for _ in range(20):  # a few milliseconds of work per call
        x = jnp.tanh(x @ jnp.eye(128, dtype=x.dtype)) + 1.0
    return x


f = pw.jit(slow_inc, mesh=s.mesh(("d",)))
rt = Runtime.get()
x = f(np.zeros((128, 128), np.float32))
most = 0
for _ in range(60):
    x = f(x)
    most = max(most, rt.in_flight())
value = float(np.asarray(x.result(timeout=60))[0, 0])
expected = 0.0
for _ in range(61 * 20):
    expected = float(np.tanh(np.float32(expected))) + 1.0
print(json.dumps({"cap": rt.max_in_flight, "most": most, "value": value, "expected": expected}))
