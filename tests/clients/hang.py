"""Hang detection: waits for DIR/go (the test stops worker b first), runs a program with a node on
island b and prints how it ended; then waits for DIR/go2 (worker b continued) and runs it again."""

import json
import sys
import time
from pathlib import Path

import numpy as np

import pwctl as pw

workdir = Path(sys.argv[1])
sb = pw.make_virtual_device_set().add_slice(devices=2, island="b")
inc = pw.pmap(lambda v: v + 1.0, devices=sb.devices)


@pw.program
def stalls(x):
    return inc(x)


def wait_file(name: str) -> None:
    deadline = time.monotonic() + 60
    while not (workdir / name).exists():
        if time.monotonic() > deadline:
            sys.exit(f"no {name} file after 60 s")
        time.sleep(0.01)


out = {"warm": np.asarray(stalls(np.zeros(2))).tolist()}  # traced, registered, compiled
(workdir / "ready").write_text("ok")
wait_file("go")
t0 = time.monotonic()
try:
    value = stalls(np.ones(2)).result(timeout=90)  # the test's hang timeout is 30 s
    out["hung"] = f"no error, value {value.tolist()}"
except Exception as e:
    out["hung"] = f"{type(e).__name__}: {e}"
out["seconds"] = time.monotonic() - t0
(workdir / "failed").write_text("ok")
wait_file("go2")
out["after"] = np.asarray(stalls(np.full(2, 5.0))).tolist()
print(json.dumps(out))
