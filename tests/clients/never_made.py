"""The client of tests/test_never_computed.py: waits for DIR/go (the test froze worker a), then
submits a run held on island a, a run reading it (waits for admission: island a's window of one
is full), and a run on island b reading that; gives the middle one up (as when one of its input
uploads is lost) and prints how the reader ended, and whether island b still runs; then waits
for DIR/go2 (worker a continued)."""

import json
import sys
import time
from pathlib import Path

import numpy as np

import pwctl as pw
from pwctl.api.runtime import Runtime
from pwctl.worker_client import Upload

workdir = Path(sys.argv[1])
vds = pw.make_virtual_device_set()
on_a = pw.pmap(lambda v: v + 1.0, devices=vds.add_slice(devices=1, island="a").devices)
on_b = pw.pmap(lambda v: v * 2.0, devices=vds.add_slice(devices=1, island="b").devices)


def wait_file(name):
    deadline = time.monotonic() + 60
    while not (workdir / name).exists():
        if time.monotonic() > deadline:
            sys.exit(f"no {name} file after 60 s")
        time.sleep(0.01)


x = np.zeros((1, 4), np.float32)
out = {"warm": np.asarray(on_b(on_a(x))).tolist()}  # registered and compiled on both workers
(workdir / "ready").write_text("ok")
wait_file("go")  # w-a is frozen now
held = on_a(x)  # admitted on island a: w-a never finishes it while frozen
made = on_a(held)  # waits for admission: island a's window (one node) is full
reader = on_b(made)  # island b is idle, but it waits behind `made` (its client's order)
rt = Runtime.get()
t0 = time.monotonic()
# the client gives `made` up (as when an input upload of it is lost): it fails before it started
rt._uploads_lost([Upload(rt.new_id(), [], made.run_id)], "test: given up")
try:
    out["reader"] = f"no error, value {reader.result(timeout=40).tolist()}"
except Exception as e:
    out["reader"] = f"{type(e).__name__}: {e}"
out["reader_s"] = time.monotonic() - t0
out["made_run"], out["reader_run"] = made.run_id, reader.run_id
t1 = time.monotonic()
out["next_on_b"] = np.asarray(on_b(np.ones((1, 4), np.float32)).result(timeout=20)).tolist()  # b's order is free
out["next_on_b_s"] = time.monotonic() - t1
(workdir / "failed").write_text("ok")
wait_file("go2")  # w-a continued
out["held"] = np.asarray(held.result(timeout=30)).tolist()
print(json.dumps(out), flush=True)
