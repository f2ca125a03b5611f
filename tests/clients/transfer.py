"""Big arrays across islands: a -> b -> c, 3M float32 (12 MB, three 4 MiB chunks), exact result."""

import json

import numpy as np

import pwctl as pw

vds = pw.make_virtual_device_set()
s = {i: vds.add_slice(devices=1, island=i) for i in "abc"}
twice = pw.pmap(lambda v: v * 2.0, devices=s["a"].devices)
plus = pw.pmap(lambda v: v + 3.0, devices=s["b"].devices)
minus = pw.pmap(lambda v: v - 1.0, devices=s["c"].devices)


@pw.program
def pipe(x):
    return minus(plus(twice(x)))  # a -> b (sender a), b -> c (sender b)


x = np.arange(3_000_000, dtype=np.float32).reshape(1, -1) % 4096
got = np.asarray(pipe(x))
want = x * 2.0 + 3.0 - 1.0
print(json.dumps({"exact": bool(np.array_equal(got, want)), "nbytes": int(got.nbytes),
                  "dtype": str(got.dtype), "shape": list(got.shape)}))
