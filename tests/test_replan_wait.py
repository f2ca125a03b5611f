"""A wait on a call whose input upload failed waits for the controller's answer to the call first:
the controller may have refused it for its plan (its slice moved), and then the client sends it
again where the slice is now (pwctl/api/replan.py), input included, and the call succeeds.

The slice's worker is frozen and declared lost, and a new worker takes its place at a new address,
while the session's events are held (a TCP relay): the client calls on the slice as it knew it,
uploading the input to the frozen worker; the controller refuses the run (held). The frozen worker
is then killed: the upload stream to it ends, and once its reopenings fail the upload is given up
and the run failed on the client (`Runtime._uploads_lost`). A wait made then (futures.py `_poll`)
reported that failure at once, before the refusal that the relay then let through, which would
have sent the call again ("input buffer ... of this run was lost: uploads to the worker at OLD
failed"); now it waits for the controller's answer (up to replan.py ANSWER_S) and gets the value.

Real processes: a controller and a worker, the `pw` program in its own process reaching the
controller through the relay."""

from __future__ import annotations

import pytest
from stepped import end, start
from stepped import line as _line
from stepped import say as _say

from schemas.pathways.v1 import common_pb2 as pb
from tests.conftest import LocalCluster, wait_for
from tests.moves import slice_address
from tests.relay import Relay

pytestmark = [pytest.mark.timeout(180), pytest.mark.cluster(islands=1, devices=1, heartbeat_timeout=3)]

PROGRAM = """\
import json, sys, time
import numpy as np
import pwctl as pw
from pwctl.api.runtime import Runtime

a = pw.make_virtual_device_set().add_slice(devices=1)
g = pw.pmap(lambda v: v + 1.0, devices=a.devices)
x = np.ones((1, 2), np.float32)
assert np.asarray(g(x)).tolist() == [[2.0, 2.0]]
rt = Runtime.get()
print(json.dumps({"address": a.address}), flush=True)
sys.stdin.readline()  # a's worker is frozen and declared lost, another took its place; nothing heard
f = g(x)
print(json.dumps({"address": a.address}), flush=True)
sys.stdin.readline()  # the frozen worker is killed: the upload to it fails
start = time.monotonic()
while not rt.run_failed(f.run_id) and time.monotonic() - start < 60:
    time.sleep(0.01)
print(json.dumps({"failed": rt.run_failed(f.run_id)}), flush=True)
try:
    out = {"value": np.asarray(f.result(timeout=30)).tolist(), "error": ""}
except Exception as e:
    out = {"value": None, "error": f"{type(e).__name__}: {e}"[:500]}
out.update(address=f.home)
print(json.dumps(out), flush=True)
"""


def test_a_wait_on_a_call_whose_upload_failed_waits_for_its_refusal_and_gets_the_value(
        cluster: LocalCluster) -> None:
    relay = Relay(cluster.address)
    proc = start(cluster.env(), relay, PROGRAM)
    try:
        old = _line(proc)["address"]
        relay.hold_open_replies()  # the session tells nothing: not the loss, not the move, not the refusal
        cluster.stop_worker("w-a")
        cluster.workers["frozen"] = cluster.workers.pop("w-a")
        wait_for(lambda: cluster.hosts()["w-a"].state == pb.HOST_STATE_LOST, 30, "w-a declared lost")
        cluster.add_worker("a", 1, name="w-a")  # at a new address
        new = cluster.hosts()["w-a"].address
        assert new != old
        wait_for(lambda: slice_address(cluster) == new, 30, "the slice on the new worker")
        _say(proc)
        assert _line(proc) == {"address": old}  # planned on what it knew
        cluster.kill_worker("frozen")
        _say(proc)
        failed = _line(proc)["failed"]
        assert "of this run was lost" in failed, failed  # on the client: the refusal is still held
        relay.release()
        out = _line(proc)
        assert out == {"value": [[2.0, 2.0]], "error": "", "address": new}, out
        assert proc.wait(timeout=30) == 0
    finally:
        end(proc, relay)
