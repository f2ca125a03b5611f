"""Load generators for the scheduling tests; each prints one JSON line at the end.

    load.py psum DIR NAME RUNS        psum program on a 4-device slice of island a, RUNS runs, exact check
    load.py busy DIR NAME SECONDS     ~1.5 ms matmul loop on a 1-device slice of island a, as fast as it can
                                      for SECONDS, up to OUTSTANDING runs in flight; logs (time, completed)
                                      and says its session's client id (the controller's traces name it)
    load.py burst DIR NAME RUNS       RUNS busy calls submitted at once, then logs when each chunk completed

Every mode warms up (trace, register, compile, one run), writes DIR/ready-NAME and waits for DIR/go
(a start barrier, so that the clients of one test really run at the same time).
"""

import json
import sys
import time
from collections import deque
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pwctl as pw
from pwctl.api.runtime import Runtime

mode, workdir, name, amount = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
CHUNK = 8  # block on every CHUNK-th future (a client's runs on one device complete in order)
OUTSTANDING = 64


def barrier() -> float:
    (workdir / f"ready-{name}").write_text("ok")
    go = workdir / "go"
    deadline = time.monotonic() + 60
    while not go.exists():
        if time.monotonic() > deadline:
            sys.exit("no go file after 60 s")
        time.sleep(0.01)
    return time.time()


def work(x):
    return jax.lax.fori_loop(0, 40, lambda i, y: jnp.tanh(y @ x), x)  # pmap: x is one device's (96, 96)


vds = pw.make_virtual_device_set()
out: dict = {"name": name}
if mode == "psum":
    s = vds.add_slice(devices=4, island="a")
    total = pw.pmap(lambda v: jax.lax.psum(v, "i") * 2.0 + v, devices=s.devices, axis_name="i")

    @pw.program
    def step(x):
        return total(total(x))  # two collective nodes per run

    def want(i: int) -> np.ndarray:
        x = np.arange(4, dtype=np.float32) + i
        y = x.sum() * 2 + x
        return y.sum() * 2 + y

    assert np.array_equal(np.asarray(step(np.arange(4, dtype=np.float32))), want(0))
    barrier()
    runs = int(amount)
    futs = [step(np.arange(4, dtype=np.float32) + i) for i in range(runs)]
    wrong = [i for i, f in enumerate(futs) if not np.array_equal(np.asarray(f), want(i))]
    out.update(runs=runs, wrong=wrong)
else:
    s = vds.add_slice(devices=1, island="a")
    f = pw.pmap(work, devices=s.devices)
    rng = np.random.default_rng(0)
    x = pw.pmap(lambda v: v + 0.0, devices=s.devices)(
        (rng.standard_normal((1, 96, 96)) * 0.1).astype(np.float32))
    ref = np.asarray(f(x))
    log: list[tuple[float, int]] = []
    done = 0
    if mode == "busy":
        seconds = float(amount)
        go = barrier()
        log.append((go, 0))
        pending: deque = deque()
        submitted = 0
        while time.time() < go + seconds:
            pending.append(f(x))
            submitted += 1
            if len(pending) >= OUTSTANDING:
                for _ in range(CHUNK - 1):
                    pending.popleft()
                pending.popleft().block_until_ready()
                done += CHUNK
                log.append((time.time(), done))
        stop = time.time()
        while pending:
            last = None
            for _ in range(min(CHUNK, len(pending))):
                last = pending.popleft()
            last.block_until_ready()
            done = submitted - len(pending)
            log.append((time.time(), done))
        out.update(go=go, stop=stop, submitted=submitted, log=log, ok=bool(np.array_equal(np.asarray(last), ref)),
                   client=Runtime.get().client_id)
    else:  # burst
        runs = int(amount)
        go = barrier()
        t0 = time.time()
        futs = [f(x) for _ in range(runs)]
        submitted_at = time.time()
        (workdir / f"submitted-{name}").write_text("ok")
        for i in range(CHUNK - 1, runs, CHUNK):
            futs[i].block_until_ready()
            log.append((time.time(), i + 1))
        out.update(go=go, start=t0, submitted_at=submitted_at, log=log,
                   ok=bool(np.array_equal(np.asarray(futs[-1]), ref)))
print(json.dumps(out))
