"""Remap transparency: a 2-device slice that lands on island b (island a is loaded by another
slice), a psum pmap on it; after the test kills worker b (DIR/go), the same compiled function
must still work, now on island a."""

import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

import pwctl as pw

workdir = Path(sys.argv[1])
vds = pw.make_virtual_device_set()
filler = vds.add_slice(devices=2, island="a")  # load on a: the next slice prefers b
s = vds.add_slice(devices=2)
f = pw.pmap(lambda v: jax.lax.psum(v, "i") + v, devices=s.devices, axis_name="i")


@pw.program
def twice(x):
    return f(f(x))


x = np.array([1.0, 2.0])
out = {"slice": s.name, "island_before": s.info.devices[0].island,
       "before": np.asarray(f(x)).tolist(), "prog_before": np.asarray(twice(x)).tolist()}
(workdir / "ready").write_text(s.name)
deadline = time.monotonic() + 60
while not (workdir / "go").exists():
    if time.monotonic() > deadline:
        sys.exit("no go file after 60 s")
    time.sleep(0.01)
deadline = time.monotonic() + 20  # the SliceChanged notice may trail the state the test saw
while s.info.devices[0].island != "a" and time.monotonic() < deadline:
    time.sleep(0.01)
out["island_after"] = s.info.devices[0].island
out["generation"] = int(s.info.generation)
out["after"] = np.asarray(f(x)).tolist()
out["prog_after"] = np.asarray(twice(x)).tolist()
print(json.dumps(out))
