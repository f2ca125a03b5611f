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

# long chains of one function: a fused segment runs them as a loop (server/worker/fusion.py)
layer = pw.jit(lambda h, w: jnp.tanh(h @ w), mesh=sa.mesh(("d",)))
step = pw.pmap(lambda v: jax.lax.psum(v, "i") * 0.25 + 1.0, devices=s4.devices, axis_name="i")
wc = (rng.standard_normal((8, 8)) / 3).astype(np.float32)
hc = rng.standard_normal((2, 8)).astype(np.float32)


@pw.program
def chains(h, w, v):
    mids = []
    for k in range(16):
        h = layer(h, w)
        if k in (5, 11):
            mids.append(h)  # read outside the chain: the loops end there
    for _ in range(8):
        v = step(v)
    return h, mids, v


h_got, mids_got, v_got = chains(hc, wc, v)
h_want, mids_want, v_want = hc, [], v.astype(np.float64)
for k in range(16):
    h_want = np.asarray(jnp.tanh(h_want @ wc))
    if k in (5, 11):
        mids_want.append(h_want)
for _ in range(8):
    v_want = np.full(4, v_want.sum() * 0.25) + 1.0
out["chain_max_err"] = max(float(np.max(np.abs(np.asarray(a) - b)))
                           for a, b in zip([h_got, *mids_got], [h_want, *mids_want], strict=True))
out["chain_psum"] = [np.asarray(v_got).tolist(), v_want.tolist()]
print(json.dumps(out))
