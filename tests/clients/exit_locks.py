"""A `pw` program's exit while the locks of its gRPC streams are held (tests/test_exit.py).

At interpreter exit, atexit handlers run (the runtime's close among them), then finalization
freezes every daemon thread where it stands: one of gRPC's threads, or the runtime's, frozen
inside a call's lock keeps it for ever. This program stands in for such threads: an atexit
handler registered before the runtime opens (so it runs after the runtime's close) starts
threads that take the lock of each stream the runtime had (the session's, the uploads') and end
holding it. The program must still exit.

argv[1]: "fetched" (the last result fetched, as PAIR in test_multihost.py does), "in_flight"
(runs still going, their futures alive at exit), or "close" (closes the runtime itself and prints,
as JSON, the threads and gRPC call objects left behind).
"""

import atexit
import gc
import json
import sys
import threading

import grpc._channel
import jax
import numpy as np

import pwctl as pw
from pwctl.api.runtime import Runtime

mode = sys.argv[1]
locks: list[threading.Condition] = []


def hold_them() -> None:
    for lock in locks:  # each thread ends holding its lock, as a frozen one would keep it
        threading.Thread(target=lock.acquire, daemon=True).start()
    print("held", len(locks), flush=True)


if mode != "close":
    atexit.register(hold_them)  # before the runtime registers its close: runs after it

s = pw.make_virtual_device_set().add_slice(devices=2)
step = pw.pmap(lambda x: x + jax.lax.psum(x, "i"), devices=s.devices, axis_name="i")
x = np.arange(2 * 3, dtype=np.float64).reshape(2, 3)
assert np.allclose(np.asarray(step(x)), x + x.sum(0))
rt = Runtime.get()
# the stream's lock: grpc's call object (`_MultiThreadedRendezvous`) takes it when collected
locks.append(rt._call._call._state.condition)
locks.extend(conn._stream.call._call._state.condition for conn in rt._workers.values() if conn._stream is not None)
if mode == "in_flight":  # runs of a second or so each, not waited for: in flight at exit, futures alive
    slow = pw.pmap(lambda x: jax.lax.fori_loop(0, 20_000_000, lambda i, v: v * 0.5 + 1.0, x), devices=s.devices,
                   axis_name="i")
    alive = [slow(x) for _ in range(4)]
    print("in flight", rt.in_flight(), flush=True)
elif mode == "close":
    rt.close()
    calls = [o for o in gc.get_objects() if isinstance(o, grpc._channel._MultiThreadedRendezvous)]
    print(json.dumps({"threads": [t.name for t in threading.enumerate() if t is not threading.main_thread()],
                      "calls": len(calls), "streams": len(locks)}), flush=True)
del rt
print("pair ok", flush=True)
