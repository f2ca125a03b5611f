"""SPMD over a 4-device slice mesh vs plain JAX, and a 2-stage pipeline over two islands."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pwctl as pw

out = {}
vds = pw.make_virtual_device_set()
s4 = vds.add_slice(devices=4, island="a")
mesh = s4.mesh(("data",))


def norm(x):
    return x / jnp.sum(x) + jnp.mean(x)


f = pw.jit(norm, mesh=mesh, in_shardings=P("data"), out_shardings=P("data"))
x = np.arange(16, dtype=np.float32) + 1
out["spmd_max_err"] = float(np.max(np.abs(np.asarray(f(x)) - np.asarray(norm(x)))))

total = pw.pmap(lambda v: jax.lax.psum(v, "i") + v, devices=s4.devices, axis_name="i")
out["psum"] = np.asarray(total(np.arange(4, dtype=np.float32))).tolist()

# a 2-stage MLP pipeline: stage 1 on island a, stage 2 on island b
rng = np.random.default_rng(0)
w1, w2 = rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 4), np.float32)
sa = vds.add_slice(devices=1, island="a")
sb = vds.add_slice(devices=1, island="b")


def stage1(x, w):
    return jnp.tanh(x @ w)


def stage2(h, w):
    return jax.nn.softmax(h @ w)


s1 = pw.jit(stage1, mesh=sa.mesh(("d",)))
s2 = pw.jit(stage2, mesh=sb.mesh(("d",)))


@pw.program
def mlp(x, w1, w2):
    return s2(s1(x, w1), w2)


xb = rng.standard_normal((4, 8), np.float32)
got = np.asarray(mlp(xb, w1, w2))
want = np.asarray(stage2(stage1(xb, w1), w2))
out["pipeline_max_err"] = float(np.max(np.abs(got - want)))

# one worker, two device sets: a segment of three parts (4 devices with a collective, 1 device,
# the 4 devices again with a collective that must wait for the part before it)
mixer = pw.pmap(lambda v: jax.lax.psum(v, "i") * 0.5 + v, devices=s4.devices, axis_name="i")
scan = pw.jit(lambda v: jnp.cumsum(v) * 2.0, mesh=sa.mesh(("d",)))


@pw.program
def across(v):
    b = scan(mixer(v))
    return mixer(b), b


v = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
c, b = across(v)
b_np = np.cumsum(v.sum() * 0.5 + v) * 2.0
out["across"] = [np.asarray(c).tolist(), np.asarray(b).tolist()]
out["across_want"] = [(b_np.sum() * 0.5 + b_np).tolist(), b_np.tolist()]
print(json.dumps(out))
