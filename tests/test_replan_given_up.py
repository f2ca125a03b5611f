"""A run refused for its plan that is not sent again (pwctl/api/replan.py): what follows from it.

A run reading an output of a run given up (refused MAX_REPLANS times, or not sent again) is refused
too, by the controller, for that output, which nothing will ever compute (dispatch.py: such a run
is refused 'the same way', for its plan). It was sent again, refused again, up to MAX_REPLANS times,
though its own slice never moved, and failed ending '... its slices kept moving': now it fails at
its first refusal, naming the run whose output it reads and that run's failure, not sent again.

A re-sending that cannot go out (the runtime closed: its uploads refused) counted as one sent: the
run's error said 'sent again once' for a send that never went out. Only sends that went out count.

Real processes where the choreography allows: a controller and its workers (slice a's worker frozen,
declared lost and replaced at a new address, MAX_REPLANS + 1 times, while the relay holds the
client's messages, as in test_replan_twice.py), the `pw` program in its own process reaching the
controller through the relay. The refusal of a run at the moment its runtime closes cannot be staged
(the session's reader handles it within the microseconds between `close` marking the runtime closed
and cancelling the session's stream): that test hands a closed runtime's `Replans` the controller's
refusal of a run it kept, as the session's reader would have.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import pytest
from stepped import end, start
from stepped import line as _line
from stepped import say as _say

from pwctl.api.replan import MAX_REPLANS, Replans
from schemas.pathways.v1 import controller_pb2 as cpb
from tests.conftest import LocalCluster
from tests.moves import move
from tests.relay import Relay

if TYPE_CHECKING:
    from pwctl.api.runtime import Runtime

pytestmark = [pytest.mark.timeout(240)]

DEPENDENT = """\
import json, sys, time
import numpy as np
import pwctl as pw
from pwctl.api.runtime import Runtime

vds = pw.make_virtual_device_set()
a = vds.add_slice(devices=1, island="a")
b = vds.add_slice(devices=1, island="b")
ga = pw.pmap(lambda v: v + 1.0, devices=a.devices)
gb = pw.pmap(lambda v: v * 2.0, devices=b.devices)
x = np.ones((1, 2), np.float32)
assert np.asarray(gb(ga(x))).tolist() == [[4.0, 4.0]]
rt = Runtime.get()
print(json.dumps({"address": a.address}), flush=True)
sys.stdin.readline()  # the client's messages are held
fa = ga(x)
print(json.dumps({"address": a.address}), flush=True)
while True:
    run = fa.run_id
    sys.stdin.readline()  # a moved, and the run went on to the controller: refused
    start = time.monotonic()
    while fa.run_id == run and not rt.run_failed(run) and time.monotonic() - start < 30:
        time.sleep(0.01)  # sent again, or failed
    print(json.dumps({"sent_again": fa.run_id != run, "failed": rt.run_failed(run)[:500]}), flush=True)
    if fa.run_id == run:
        break
sys.stdin.readline()  # the relay passes everything now
start = time.monotonic()
fb = gb(fa)  # b never moved; it reads a's output, which nothing will compute
first = fb.run_id
try:
    fb.result(timeout=30)
    error = ""
except Exception as e:
    error = f"{type(e).__name__}: {e}"[:2000]
sent, run = 0, first
while run in rt.replans.replanned:  # the runs it was sent again as
    run, sent = rt.replans.replanned[run], sent + 1
print(json.dumps({"error": error, "sent_again": sent, "s": time.monotonic() - start, "producer": fa.run_id}),
      flush=True)
"""


@pytest.mark.cluster(islands=2, devices=1, heartbeat_timeout=3)
def test_a_call_reading_an_output_of_a_run_given_up_fails_at_once_naming_it(cluster: LocalCluster) -> None:
    relay = Relay(cluster.address)
    proc = start(cluster.env(), relay, DEPENDENT)
    frozen = [f"frozen-{k}" for k in range(MAX_REPLANS + 1)]
    try:
        old = _line(proc)["address"]
        relay.hold_open_requests()  # the session's messages (the run, each re-sending) wait
        _say(proc)
        assert _line(proc) == {"address": old}
        for k, name in enumerate(frozen):  # a's run refused MAX_REPLANS + 1 times: given up
            move(cluster, name)
            assert relay.pass_requests() > 0
            _say(proc)
            out = _line(proc)
            assert out["sent_again"] == (k < MAX_REPLANS), (k, out)
        assert "its slices kept moving" in out["failed"], out
        producer_error = out["failed"]
        relay.release()
        _say(proc)
        out = _line(proc)
        # before: sent again MAX_REPLANS times, each refused, then 'ProgramError: input 0 (buffer ...)
        # will never be computed: run ... (planned anew and sent again 3 times already: its slices kept moving)'
        assert out["sent_again"] == 0, out
        assert out["error"] == (f"ProgramError: input 0 reads an output of run {out['producer']:#x}, which failed: "
                                f"{producer_error}"), out
        assert out["s"] < 5, out
        assert proc.wait(timeout=30) == 0
    finally:
        end(proc, relay)
        for name in frozen:
            if name in cluster.workers:
                cluster.kill_worker(name)


CLOSING = """\
import json, sys
import numpy as np
import pwctl as pw
from pwctl.api import runtime
from pwctl.api.runtime import Runtime
from schemas.pathways.v1 import controller_pb2 as cpb

runtime.CLOSE_DRAIN_S = 0.0  # (the run's end is held: not waited for)
a = pw.make_virtual_device_set().add_slice(devices=1)
g = pw.pmap(lambda v: v + 1.0, devices=a.devices)
x = np.ones((1, 2), np.float32)
assert np.asarray(g(x)).tolist() == [[2.0, 2.0]]
rt = Runtime.get()
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()  # the session's events are held: the next run is kept (not told handled)
f = g(x)
run = f.run_id
kept = rt.replans.unanswered([run])
rt.close()  # the runtime closes; the controller's refusal of the run comes now
why = f"run {run:#x} was planned on an older placement of slice {a.name!r}: send it again"
error = rt.replans.refused(cpb.RunFinished(run_id=run, ok=False, error=why, replan=True,
                                           slice_generations=[rt.slices[a.name].info.generation]))
print(json.dumps({"kept": kept, "why": why, "error": error, "sent_again": run in rt.replans.replanned,
                  "given_up": rt.replans.gave_up([run])}), flush=True)
"""


@pytest.mark.cluster(islands=1, devices=1)
def test_a_resending_that_never_went_out_is_not_counted(cluster: LocalCluster) -> None:
    relay = Relay(cluster.address)
    proc = start(cluster.env(), relay, CLOSING)
    try:
        assert _line(proc) == {"ready": True}
        relay.hold_open_replies()
        _say(proc)
        out = _line(proc)
        assert out["kept"] and not out["sent_again"] and out["given_up"], out
        # before: '... send it again (planned anew and sent again once already)': its upload refused,
        # the runtime closed, the run never went out again
        assert out["error"] == out["why"], out
        assert proc.wait(timeout=30) == 0
    finally:
        end(proc, relay)


@dataclass
class _Run:
    """What is kept of a run (replan.py `Sent`): its future inputs' runs; never sent again here."""

    reads: list[tuple[int, int]] = field(default_factory=list)
    slices: list[str] = field(default_factory=list)
    replans: int = 0

    def send_again(self, rt: Runtime) -> int:
        raise AssertionError("not sent again: it reads an output of a run given up")

    def producers(self) -> list[tuple[int, int]]:
        return self.reads


def _refusal(run_id: int) -> cpb.RunFinished:
    return cpb.RunFinished(run_id=run_id, ok=False, replan=True,
                           error=f"input 1 (buffer 0x7) will never be computed: run {run_id - 1:#x} ...")


def test_a_chain_of_readers_of_a_run_given_up_names_its_first_failure_once() -> None:
    """The state alone (no session: a run given up because of its input reads nothing of the
    runtime): each reader names the run it reads, and the first failure, not one nested per link."""
    replans = Replans(cast("Runtime", None), threading.Lock())
    replans.keep(2, _Run(reads=[(0, 9), (1, 1)]))  # (9: a run that did not fail)
    replans.keep(3, _Run(reads=[(0, 2)]))
    first = "run 0x1 was planned on an older placement of slice 'a' (generation 1 -> 2): send it again"
    assert replans.refused(cpb.RunFinished(run_id=1, ok=False, replan=True, error=first)) == first  # not kept: given up
    assert replans.refused(_refusal(2)) == f"input 1 reads an output of run 0x1, which failed: {first}"
    assert replans.refused(_refusal(3)) == f"input 0 reads an output of run 0x2, which failed: {first}"
    assert replans.gave_up([2]) and replans.gave_up([3]) and not replans.moved([1, 2, 3])
