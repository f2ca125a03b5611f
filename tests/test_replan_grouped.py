"""A wait on futures of several workers (`pw.block_until_ready` of a pytree) that one of their runs
is sent again under, planned anew (pwctl/api/replan.py): the wait looks for that future where it
is now, and gets it.

`block_until_ready` groups the futures by their worker and waits on one group after the other. A
future's run sent again while an earlier group is waited on moves it (its home, then its run id):
its group, read before, named its old worker, while its run id was read only when its turn came,
after the move. The wait then looked for it at the old worker under the new run's id, which no
re-sending moves any more: it failed there ('the worker at OLD does not answer: its host was
lost'), the value computed all along where the slice is now. Now a group's run ids are read with
its homes, before them: a run sent again since moves the wait there.

The slice b's worker is killed and another takes its place at a new address while the session's
events are held (a TCP relay): the client calls on b as it knew it (reading an output of a's, so
that nothing is uploaded to b) and the controller refuses the run (held). The wait on a's future
and b's begins with a's worker frozen; the events then go through (b's run sent again), and a's
worker goes on.

Real processes: a controller and two workers, the `pw` program in its own process reaching the
controller through the relay."""

from __future__ import annotations

import time

import pytest
from stepped import end, start
from stepped import line as _line
from stepped import say as _say

from schemas.pathways.v1 import common_pb2 as pb
from tests.conftest import LocalCluster, wait_for
from tests.moves import slice_address
from tests.relay import Relay

# (a's worker is frozen for seconds: not declared lost meanwhile; b's is killed, lost at once)
pytestmark = [pytest.mark.timeout(180), pytest.mark.cluster(islands=2, devices=1, heartbeat_timeout=60)]

PROGRAM = """\
import json, sys, threading, time
import numpy as np
import pwctl as pw
from pwctl.api.runtime import Runtime

vds = pw.make_virtual_device_set()
a = vds.add_slice(devices=1, island="a")
b = vds.add_slice(devices=1, island="b")
ga = pw.pmap(lambda v: v + 1.0, devices=a.devices)
gb = pw.pmap(lambda v: v * 2.0, devices=b.devices)
x = np.ones((1, 2), np.float32)
assert np.asarray(gb(ga(x))).tolist() == [[4.0, 4.0]]  # (nothing uploaded to b's worker)
rt = Runtime.get()
print(json.dumps({"a": a.address, "b": b.address}), flush=True)
sys.stdin.readline()  # b's worker was killed, another took its place; nothing heard
fa = ga(x)
fb = gb(fa)  # planned on b's old worker: refused (held)
first = fb.run_id


def watch():
    start = time.monotonic()
    while first not in rt.replans.replanned and time.monotonic() - start < 60:
        time.sleep(0.01)
    print(json.dumps({"sent_again": first in rt.replans.replanned}), flush=True)


print(json.dumps({"b": fb.home}), flush=True)
sys.stdin.readline()  # a's worker is frozen
threading.Thread(target=watch, daemon=True).start()
print(json.dumps({"waiting": True}), flush=True)
try:
    pw.block_until_ready((fa, fb), timeout=60)
    out = {"value": np.asarray(fb).tolist(), "error": ""}
except Exception as e:
    out = {"value": None, "error": f"{type(e).__name__}: {e}"[:500]}
out.update(b=fb.home)
print(json.dumps(out), flush=True)
"""


def test_a_wait_on_several_workers_finds_a_future_whose_run_was_sent_again_meanwhile(cluster: LocalCluster) -> None:
    relay = Relay(cluster.address)
    proc = start(cluster.env(), relay, PROGRAM)
    try:
        old = _line(proc)["b"]
        relay.hold_open_replies()  # the session tells nothing: not the move, not the refusal
        cluster.kill_worker("w-b")
        wait_for(lambda: cluster.hosts()["w-b"].state == pb.HOST_STATE_LOST, 30, "w-b declared lost")
        cluster.add_worker("b", 1, name="w-b")
        new = cluster.hosts()["w-b"].address
        assert new != old
        wait_for(lambda: slice_address(cluster, "b") == new, 30, "slice b on the new worker")
        _say(proc)
        assert _line(proc) == {"b": old}  # planned on what it knew
        cluster.stop_worker("w-a")  # the wait on a's future, the first group, lasts meanwhile
        _say(proc)
        assert _line(proc) == {"waiting": True}
        time.sleep(0.5)  # (grouped meanwhile, a's group waited on)
        relay.release()  # b's move, then the refusal: b's run sent again while a's group is waited on
        assert _line(proc) == {"sent_again": True}
        cluster.cont_worker("w-a")
        out = _line(proc)
        # before: 'ProgramError: the worker at OLD does not answer: its host w-b was lost ...'
        assert out == {"value": [[4.0, 4.0]], "error": "", "b": new}, out
        assert proc.wait(timeout=30) == 0
    finally:
        end(proc, relay)
