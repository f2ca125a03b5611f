"""When successors reach their worker, under the session's dispatch mode (PWCTL_DISPATCH).

The program: n0 on island b; x on island a (no deps); n1 on island a, other devices, reading n0.
Its inputs are already on the workers, so running it uploads nothing. Protocol with the test (files
in DIR): warm up (every function compiled, every value kept), write DIR/ready, wait for DIR/go (the
test has frozen worker b, so n0 cannot finish), submit the program, write DIR/submitted, wait for
the results (the test continues worker b), print them as JSON.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np

import pwctl as pw

workdir = Path(sys.argv[1])
vds = pw.make_virtual_device_set()
sb = vds.add_slice(devices=2, island="b")
sx = vds.add_slice(devices=2, island="a")
sa = vds.add_slice(devices=2, island="a")  # the other two devices of island a: its own segment

put_b = pw.pmap(lambda v: v + 0.5, devices=sb.devices)
put_a = pw.pmap(lambda v: v + 0.25, devices=sx.devices)
f0 = pw.pmap(lambda v: v * 2.0, devices=sb.devices)
fx = pw.pmap(lambda v: v + 10.0, devices=sx.devices)
f1 = pw.pmap(lambda v: v - 1.0, devices=sa.devices)


@pw.program
def prog(vb, va):
    h = f0(vb)  # n0 (island b)
    y = fx(va)  # x (island a, no deps)
    return f1(h), y  # n1 (island a, after n0)


def wait_file(name: str) -> None:
    deadline = time.monotonic() + 60
    while not (workdir / name).exists():
        if time.monotonic() > deadline:
            sys.exit(f"no {name} file after 60 s")
        time.sleep(0.01)


vb = put_b(np.ones((2, 3)))  # stays on worker b
va = put_a(np.ones((2, 3)))  # stays on worker a
kept = [vb, va, *prog(vb, va)]  # warm-up: traced, registered, compiled; every value kept
warm = [np.asarray(v).tolist() for v in kept[2:]]
(workdir / "ready").write_text("ok")
wait_file("go")
n1, x = prog(vb, va)
(workdir / "submitted").write_text("ok")
print(json.dumps({"warm": warm, "n1": n1.result(timeout=60).tolist(), "x": x.result(timeout=60).tolist()}))
