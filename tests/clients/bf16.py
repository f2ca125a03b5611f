"""bfloat16 computed on island a, moved worker to worker to island b, fetched: exact against NumPy."""

import json

import ml_dtypes
import numpy as np

import pwctl as pw

vds = pw.make_virtual_device_set()
sa = vds.add_slice(devices=1, island="a")
sb = vds.add_slice(devices=1, island="b")
half = pw.pmap(lambda v: v * 0.5, devices=sa.devices)
plus = pw.pmap(lambda v: v + 1.0, devices=sb.devices)


@pw.program
def pipe(x):
    return plus(half(x))  # a -> b: a peer transfer of a bfloat16 array


x = (np.arange(64, dtype=np.float32).reshape(1, -1) % 16).astype(ml_dtypes.bfloat16)
got = np.asarray(pipe(x))
near = np.asarray(half(x))  # fetched straight from worker a
want = (x.astype(np.float32) * 0.5 + 1.0).astype(ml_dtypes.bfloat16)
print(json.dumps({"dtype": str(got.dtype), "exact": bool(np.array_equal(got, want)),
                  "fetched": str(near.dtype), "fetched_exact": bool(np.array_equal(near, x * 0.5))}))
