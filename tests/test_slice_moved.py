"""A call made just after a slice's worker came back at a new address, before the session's reader
took the controller's `SliceChanged`, runs there (pwctl/api/runtime.py `catch_up`); whether or not
the session told of the host's loss before.

The worker is killed (its host declared lost: the session hears `HostLost`) and started again on a
new port. A call that used the slice's old address uploaded its input there and was refused ('input
0 is held by the worker at OLD, which is not ready'), its output waited for at the old address too:
the first call after a worker's move failed. Now a call on a slice whose worker the session knows
lost reads the slice again from the controller first. A worker back at its old address leaves the
session's lost workers then (else every later call would read the slice again).

Told nothing by the session (its events held from before the worker was killed), the client's only
sign is its upload stream to the worker, which ended with the worker: a call on a slice there reads
the slice again first too. Before, the first call after the move uploaded to the old address and
failed. A slice whose worker is really lost (not back) fails the call within seconds, naming the
lost host, with the session's events still held.

Real processes: a controller and a worker, a `pw` program in its own process that reaches the
controller through a TCP relay (tests/relay.py); the relay holds the controller's replies on the
connections open then (the session's stream: its `SliceChanged`), while new connections go through."""

from __future__ import annotations

import subprocess

import pytest
from stepped import end, start
from stepped import line as _line
from stepped import say as _say

from schemas.pathways.v1 import common_pb2 as pb
from tests.conftest import LocalCluster, wait_for
from tests.relay import Relay

pytestmark = [pytest.mark.timeout(180), pytest.mark.cluster(islands=1, devices=1)]

PROGRAM = """\
import json, sys, time
import numpy as np
import pwctl as pw
from pwctl.api.runtime import Runtime

s = pw.make_virtual_device_set().add_slice(devices=1)
inc = pw.pmap(lambda v: v + 1.0, devices=s.devices)
x = np.ones((1, 2), np.float32)
print(json.dumps({"warm": np.asarray(inc(x)).tolist(), "address": s.address}), flush=True)
sys.stdin.readline()  # the worker was killed and its host declared lost
rt, start = Runtime.get(), time.monotonic()
while sys.argv[1] == "told" and s.address not in rt.lost_workers and time.monotonic() - start < 30:
    time.sleep(0.05)  # the session heard of it (HostLost)
print(json.dumps({"lost": s.address in rt.lost_workers}), flush=True)
sys.stdin.readline()  # the worker is back (or declared lost for good); the session's events are held
start = time.monotonic()
try:
    out = {"value": np.asarray(inc(x).result(timeout=30)).tolist(), "error": ""}
except Exception as e:
    out = {"value": None, "error": f"{type(e).__name__}: {e}"[:500]}
out.update(s=time.monotonic() - start, address=s.address, checks=rt.on_lost_worker)
print(json.dumps(out), flush=True)
sys.stdin.readline()  # the events go through again
print(json.dumps({"after": np.asarray(inc(x)).tolist()}), flush=True)
"""


def _start(cluster: LocalCluster, relay: Relay, told: str) -> subprocess.Popen[str]:
    return start(cluster.env(), relay, PROGRAM, told)


@pytest.mark.parametrize("told", ["told", "untold"])
@pytest.mark.parametrize("back", ["at a new address", "at its old address"])
def test_a_call_before_the_session_heard_of_the_worker_back_runs_there(cluster: LocalCluster, back: str,
                                                                        told: str) -> None:
    relay = Relay(cluster.address)
    proc = _start(cluster, relay, told)
    try:
        first = _line(proc)
        assert first["warm"] == [[2.0, 2.0]], first
        if told == "untold":  # from before the loss: the session tells neither it nor the move
            relay.hold_open_replies()
        cluster.kill_worker("w-a")
        _say(proc)
        assert _line(proc) == {"lost": told == "told"}
        relay.hold_open_replies()  # the session's stream: its events (the coming SliceChanged) wait
        same = back == "at its old address"
        listen = ("--listen", first["address"]) if same else ()
        cluster.add_worker("a", 1, name="w-a", program=("-m", "server.worker", *listen))
        new = cluster.hosts()["w-a"].address
        assert (new == first["address"]) == same, (new, first)
        _say(proc)
        out = _line(proc)
        relay.release()
        # before: refused, naming the old address (a new one), or each later call read the slice again
        assert out["error"] == "" and out["value"] == [[2.0, 2.0]], out
        assert out["address"] == new and out["checks"] is False, out  # later calls read nothing again
        _say(proc)
        assert _line(proc) == {"after": [[2.0, 2.0]]}
        assert proc.wait(timeout=30) == 0
    finally:
        end(proc, relay)


def test_a_call_on_a_slice_whose_worker_is_lost_fails_at_once_naming_its_host(cluster: LocalCluster) -> None:
    relay = Relay(cluster.address)
    proc = _start(cluster, relay, "untold")
    try:
        assert _line(proc)["warm"] == [[2.0, 2.0]]
        relay.hold_open_replies()  # the session tells nothing of the loss
        cluster.kill_worker("w-a")
        wait_for(lambda: cluster.hosts()["w-a"].state == pb.HOST_STATE_LOST, 20, "w-a declared lost")
        _say(proc)
        assert _line(proc) == {"lost": False}
        _say(proc)
        out = _line(proc)
        # before: 'cannot reach the worker at OLD' (no host named), or an upload's failure after its resends
        assert out["value"] is None and "w-a" in out["error"] and "lost" in out["error"], out
        assert "\n" not in out["error"] and out["s"] < 3, out
    finally:
        end(proc, relay)


LOOKUPS = """\
import json, sys, time
import numpy as np
import pwctl as pw
from pwctl.api.runtime import Runtime

s = pw.make_virtual_device_set().add_slice(devices=1)
inc = pw.pmap(lambda v: v + 1.0, devices=s.devices)
x = np.ones((1, 2), np.float32)
print(json.dumps({"warm": np.asarray(inc(x)).tolist()}), flush=True)
rt, start = Runtime.get(), time.monotonic()
while s.address not in rt.lost_workers and time.monotonic() - start < 30:  # HostLost
    time.sleep(0.05)
for step in ("reachable", "unreachable"):
    sys.stdin.readline()
    took = []
    for _ in range(4):  # each read the slice again: it stays on the lost host
        start = time.monotonic()
        inc(x)
        took.append(time.monotonic() - start)
    print(json.dumps({step: took}), flush=True)
"""


def test_calls_on_a_lost_workers_slice_share_one_connection_and_skip_an_unreachable_controller(
        cluster: LocalCluster) -> None:
    """While a slice stays on a lost host, each call reads it again (`catch_up`): on one connection
    kept for that (before: a new one each); and once the controller did not answer, the calls go on
    at once for a while (before: each waited 5 s for its own lookup)."""
    relay = Relay(cluster.address)
    proc = start(cluster.env(), relay, LOOKUPS)
    try:
        assert _line(proc)["warm"] == [[2.0, 2.0]]
        cluster.kill_worker("w-a")
        wait_for(lambda: cluster.hosts()["w-a"].state == pb.HOST_STATE_LOST, 20, "w-a declared lost")
        accepted = relay.accepted
        _say(proc)
        took = _line(proc)["reachable"]
        assert relay.accepted - accepted <= 1, (relay.accepted - accepted, took)  # before: 4
        relay.hold()  # the controller answers nothing now (connections are still accepted)
        _say(proc)
        took = _line(proc)["unreachable"]
        relay.release()
        # before: 5 s each; now the first waits for its lookup (2 s), the next ones do not
        assert took[0] < 4 and max(took[1:]) < 1, took
    finally:
        end(proc, relay)
