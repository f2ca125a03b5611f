"""The load the chaos run keeps going while it kills processes: `python -m bench.chaos.workload`.

A `pw` client with a program across both islands (island a doubles, island b adds one: every
call crosses workers) called in a loop, each result checked against NumPy. One JSON line per
call on stdout: `{"start": t0, "end": t1, "ok": true|false, "wrong": bool, "error": "..."}`
(wall-clock seconds). A session that ends (the controller went away) is one last line with
`"session_ended": true`, then exit 3: the chaos run starts a new workload.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def main() -> None:
    import pwctl as pw
    from pwctl.api.runtime import Runtime
    from pwctl.errors import ConnectionFailed

    first = os.environ.get("CHAOS_FIRST", "a")
    second = os.environ.get("CHAOS_SECOND", "b")
    ds = pw.make_virtual_device_set()
    d1 = ds.add_slice(devices=1, island=first).devices
    d2 = ds.add_slice(devices=1, island=second).devices
    f = pw.pmap(lambda x: x * 2.0, devices=d1)
    g = pw.pmap(lambda x: x + 1.0, devices=d2)

    @pw.program
    def across(v):
        return g(f(v))

    i = 0
    print(json.dumps({"ready": time.time()}), flush=True)
    while True:
        i += 1
        x = np.full((1,), float(i % 1000))
        start = time.time()
        line: dict[str, object] = {"start": start}
        try:
            r = np.asarray(across(x))
            line.update(ok=True, wrong=not np.allclose(r, x * 2.0 + 1.0))
        except ConnectionFailed as e:  # a worker out of reach, or the session gone with the controller
            line.update(ok=False, wrong=False, error=f"{type(e).__name__}: {str(e)[:300]}",
                        session_ended=bool(Runtime.get()._session_error))
        except Exception as e:  # every failure the user would see, with its message
            line.update(ok=False, wrong=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        line["end"] = time.time()
        print(json.dumps(line), flush=True)
        if line.get("session_ended"):
            sys.exit(3)
        if not line["ok"]:
            time.sleep(0.05)  # a failing cluster is not hammered


if __name__ == "__main__":
    main()
