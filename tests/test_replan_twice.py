"""A slice that moves twice within one round trip of a call: the call is refused for its plan,
sent again planned on the slice's first new place, refused again (it moved on meanwhile), and sent
again where it is now; the caller gets the value (pwctl/api/replan.py MAX_REPLANS).

The slice's worker is frozen and declared lost, and a new worker takes its place at a new address,
while the session's events are held (a TCP relay): the client calls on the slice as it knew it and
the controller refuses the run (held). The slice then moves again (that worker frozen too, a third
one in its place) before the events go through: the client reads the slice's first move (the
`SliceChanged` before the refusal), sends the run again planned on it, and the controller refuses
that one too. Before, a run refused again failed with the controller's reason ('run ... was planned
on an older placement of slice ...: send it again'); now it is sent again where the slice is now.

A slice that keeps moving (each time between the client's sending of the run and its arrival: the
relay holds the client's messages while the slice moves, then passes them on) fails the call after
MAX_REPLANS re-sendings, at the next refusal, in one line naming how many times it was sent again;
not a call sent again for ever. So does a wait on it that began before that refusal came (its
worker's host declared lost meanwhile): it waits for the controller's answer, then says its reason
(futures.py `_poll`), not the loss of a worker the refused run never reached.

Real processes: a controller and its workers in turn (each frozen, declared lost, and replaced at
a new address), the `pw` program in its own process reaching the controller through the relay."""

from __future__ import annotations

import time

import pytest
from stepped import end, start
from stepped import line as _line
from stepped import say as _say

from pwctl.api.replan import MAX_REPLANS
from tests.conftest import LocalCluster
from tests.moves import move
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
first = f.run_id
print(json.dumps({"address": a.address}), flush=True)
sys.stdin.readline()  # the slice moved again; the session's events go through now
start = time.monotonic()
try:
    out = {"value": np.asarray(f.result(timeout=60)).tolist(), "error": ""}
except Exception as e:
    out = {"value": None, "error": f"{type(e).__name__}: {e}"[:500]}
sent, run = 0, first
while run in rt.replans.replanned:  # the runs it was sent again as
    run, sent = rt.replans.replanned[run], sent + 1
out.update(address=f.home, sent_again=sent)
print(json.dumps(out), flush=True)
"""


MOVING = """\
import json, sys, time
import numpy as np
import pwctl as pw
from pwctl.api import replan
from pwctl.api.runtime import Runtime

# a wait that began before the last refusal waits for it (the relay lets it through a second later)
replan.ANSWER_S = 60.0
a = pw.make_virtual_device_set().add_slice(devices=1)
g = pw.pmap(lambda v: v + 1.0, devices=a.devices)
x = np.ones((1, 2), np.float32)
assert np.asarray(g(x)).tolist() == [[2.0, 2.0]]
rt = Runtime.get()
print(json.dumps({"address": a.address}), flush=True)
sys.stdin.readline()  # the client's messages are held
f = g(x)
print(json.dumps({"address": a.address}), flush=True)
while True:
    run = f.run_id
    if sys.stdin.readline().strip() == "wait":  # the slice moved again, the run still held: waited on now
        start = time.monotonic()
        while f.home not in rt.lost_workers and time.monotonic() - start < 30:
            time.sleep(0.01)  # (its worker's host declared lost: the session said so)
        print(json.dumps({"lost": f.home in rt.lost_workers, "failed": rt.run_failed(run)}), flush=True)
    else:  # the slice moved, and the run went on to the controller
        start = time.monotonic()
        while f.run_id == run and not rt.run_failed(run) and time.monotonic() - start < 30:
            time.sleep(0.01)  # refused: sent again, or failed
    out = {"sent_again": f.run_id != run, "address": a.address, "error": ""}
    if not out["sent_again"]:
        try:
            f.result(timeout=10)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"[:1000]
    out["s"] = time.monotonic() - start
    print(json.dumps(out), flush=True)
    if not out["sent_again"]:
        break
"""


def test_a_call_whose_slice_moved_twice_within_its_round_trip_gets_the_value(cluster: LocalCluster) -> None:
    relay = Relay(cluster.address)
    proc = start(cluster.env(), relay, PROGRAM)
    try:
        old = _line(proc)["address"]
        relay.hold_open_replies()  # the session tells nothing: not the moves, not the refusal
        move(cluster, "frozen-1")
        _say(proc)
        assert _line(proc) == {"address": old}  # planned on what it knew; refused at once (held)
        new = move(cluster, "frozen-2")  # (taking the heartbeat timeout: the run was refused before)
        relay.release()
        _say(proc)
        out = _line(proc)
        # before: 'run ... was planned on an older placement of slice ...: send it again'
        assert out == {"value": [[2.0, 2.0]], "error": "", "address": new, "sent_again": 2}, out
        assert proc.wait(timeout=30) == 0
    finally:
        end(proc, relay)
        for name in ("frozen-1", "frozen-2"):  # (SIGCONT, SIGKILL)
            if name in cluster.workers:
                cluster.kill_worker(name)


@pytest.mark.parametrize("wait", ["after", "before"])
def test_a_call_whose_slice_keeps_moving_fails_after_max_replans_in_one_line(cluster: LocalCluster,
                                                                             wait: str) -> None:
    """`wait`: whether the caller waits on the call after its last refusal (the run failed already)
    or before it (its worker's host declared lost, the run not answered yet: the wait waits for the
    controller's answer, then says the refusal's reason; it said the worker's loss, 'the worker at
    ... does not answer', though the refused run never reached that worker)."""
    relay = Relay(cluster.address)
    proc = start(cluster.env(), relay, MOVING)
    frozen = [f"frozen-{k}" for k in range(MAX_REPLANS + 1)]
    try:
        old = _line(proc)["address"]
        relay.hold_open_requests()  # the session's messages (the run, each re-sending) wait
        _say(proc)
        assert _line(proc) == {"address": old}
        for k, name in enumerate(frozen):
            new = move(cluster, name)  # (the run, planned before, waits meanwhile)
            last = k == MAX_REPLANS
            if last and wait == "before":
                assert proc.stdin is not None
                proc.stdin.write("wait\n")
                proc.stdin.flush()
                assert _line(proc) == {"lost": True, "failed": ""}  # the run not refused yet: still held
                time.sleep(1.0)  # (the wait began meanwhile)
                assert relay.pass_requests() > 0  # refused a 4th time now, while the caller waits
            else:
                assert relay.pass_requests() > 0  # the run goes on: refused, planned on an older placement
                _say(proc)
            out = _line(proc)
            if not last:  # sent again where the slice is now (its SliceChanged came first)
                assert out["sent_again"] and out["address"] == new and not out["error"], (k, out)
                continue
            # before: sent again once (refused again: failed), or, unbounded, sent again for ever
            error = out["error"]
            assert not out["sent_again"] and "older placement" in error, out
            assert f"sent again {MAX_REPLANS} times already: its slices kept moving" in error, out
            assert error.startswith("ProgramError: ") and "\n" not in error and out["s"] < 5, out
        relay.release()
    finally:
        end(proc, relay)
        for name in frozen:
            if name in cluster.workers:
                cluster.kill_worker(name)
