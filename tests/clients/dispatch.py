"""A multi-node program whose nodes alternate between islands a and b (every edge crosses islands),
with collectives on both; prints its outputs (exact values and a hash of their bytes) as JSON.
Run once with PWCTL_DISPATCH=parallel and once with sequential: the outputs must be identical
(that the mode takes effect is shown by dispatch_order.py)."""

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

import pwctl as pw

vds = pw.make_virtual_device_set()
sa = vds.add_slice(devices=4, island="a")
sb = vds.add_slice(devices=4, island="b")


def mix(v):
    return jnp.sin(v) * 3.0 + jax.lax.psum(v, "i") / 7.0


def sharpen(v):
    return jnp.tanh(v * 1.5 - jax.lax.pmean(v, "i"))


fa = pw.pmap(mix, devices=sa.devices, axis_name="i")
fb = pw.pmap(sharpen, devices=sb.devices, axis_name="i")
ga = pw.pmap(lambda u, v: u * v + 1.0, devices=sa.devices)


@pw.program
def chain(x):
    h1 = fa(x)  # a
    h2 = fb(h1)  # b
    h3 = fa(h2)  # a
    h4 = fb(h3)  # b
    return h4, ga(h4, h1)  # a, reading b's output and its own earlier one


rng = np.random.default_rng(7)
results = []
for _ in range(5):
    x = rng.standard_normal((4, 33))
    outs = [np.asarray(o) for o in chain(x)]
    results.append(outs)
flat = [o for outs in results for o in outs]
digest = hashlib.sha256(b"".join(o.tobytes() for o in flat)).hexdigest()
print(json.dumps({"sha256": digest, "values": [o.tolist() for o in flat], "dtypes": [str(o.dtype) for o in flat]}))
