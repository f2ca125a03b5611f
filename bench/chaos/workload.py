"""The load the chaos run keeps going while it kills processes:
`python -m bench.chaos.workload KIND`, KIND one of

- `across`: a `pw` program across both islands (island a doubles, island b adds one: every call
  crosses workers);
- `psum`: a `pw.pmap` with a psum over both devices of island a (a collective each call);
- `proxy`: an unmodified JAX program (`JAX_PLATFORMS=proxy`, set by the chaos run) calling a jitted
  function on the cluster through the IFRT proxy.

Each is called in a loop, every result checked against NumPy. One JSON line per call on stdout:
`{"kind": KIND, "start": t0, "end": t1, "ok": true|false, "wrong": bool, "error": "..."}`
(wall-clock seconds). A `pw` session that ends (the controller went away for longer than the
client's reconnect window) is one last line with `"session_ended": true`, then exit 3; a proxy
program exits 3 at its first failed call (the jaxlib client cannot resume a session, and a run
failed by a lost worker fails the program as it would locally). The chaos run starts a new one.

With `CHAOS_JOB=1` the program is a job's driver (`across` only): failed calls do not end it, a
session that ends does (the job then fails: the check is that none does), and it exits 0 once a
file `stop` appears in its working directory.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from collections.abc import Callable

import numpy as np

KINDS = ("across", "psum", "proxy")
Call = Callable[[int], tuple[np.ndarray, np.ndarray]]  # call number -> (result, expected)


def _across() -> Call:
    import pwctl as pw

    ds = pw.make_virtual_device_set()
    d1 = ds.add_slice(devices=1, island=os.environ.get("CHAOS_FIRST", "a")).devices
    d2 = ds.add_slice(devices=1, island=os.environ.get("CHAOS_SECOND", "b")).devices
    f = pw.pmap(lambda x: x * 2.0, devices=d1)
    g = pw.pmap(lambda x: x + 1.0, devices=d2)

    @pw.program
    def across(v: np.ndarray) -> np.ndarray:
        return g(f(v))

    def call(i: int) -> tuple[np.ndarray, np.ndarray]:
        x = np.full((1,), float(i % 1000))
        return np.asarray(across(x)), x * 2.0 + 1.0

    return call


def _psum() -> Call:
    import jax

    import pwctl as pw

    d = pw.make_virtual_device_set().add_slice(devices=2, island=os.environ.get("CHAOS_FIRST", "a")).devices
    h = pw.pmap(lambda x: jax.lax.psum(x, "i") + 1.0, devices=d, axis_name="i")

    def call(i: int) -> tuple[np.ndarray, np.ndarray]:
        x = np.array([float(i % 1000), 2.0 * (i % 1000)])
        return np.asarray(h(x)), np.full((2,), x.sum() + 1.0)

    return call


def _proxy() -> Call:
    import jax

    f = jax.jit(lambda v: v * 3.0 - 1.0)

    def call(i: int) -> tuple[np.ndarray, np.ndarray]:
        x = np.full((4,), float(i % 1000), np.float32)
        return np.asarray(f(x)), x * 3.0 - 1.0

    return call


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "across"
    if kind not in KINDS:
        sys.exit(f"workload: KIND is one of {', '.join(KINDS)}, not {kind!r}")
    as_job = os.environ.get("CHAOS_JOB") == "1"
    # the chaos run sends SIGUSR1 before it kills a stuck workload: every thread's stack, on stderr
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from pwctl.api.runtime import Runtime
    from pwctl.errors import ConnectionFailed

    call = {"across": _across, "psum": _psum, "proxy": _proxy}[kind]()
    i = 0
    print(json.dumps({"kind": kind, "ready": time.time()}), flush=True)
    while not (as_job and os.path.exists("stop")):
        i += 1
        start = time.time()
        line: dict[str, object] = {"kind": kind, "start": start}
        try:
            r, expected = call(i)
            line.update(ok=True, wrong=not np.allclose(r, expected))
        except ConnectionFailed as e:  # a worker out of reach, or the session gone with the controller
            line.update(ok=False, wrong=False, error=f"{type(e).__name__}: {str(e)[:300]}",
                        session_ended=bool(Runtime.get()._session_error))
        except Exception as e:  # every failure the user would see, with its message
            line.update(ok=False, wrong=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        line["end"] = time.time()
        print(json.dumps(line), flush=True)
        if line.get("session_ended") or (kind == "proxy" and not line["ok"]):
            sys.exit(3)
        if not line["ok"]:
            time.sleep(0.05)  # a failing cluster is not hammered


if __name__ == "__main__":
    main()
