"""A call made just after a slice's worker came back at a new address, before the session's reader
took the controller's `SliceChanged`, runs there (pwctl/api/runtime.py `catch_up`).

The worker is killed (its host declared lost: the session hears `HostLost`) and started again on a
new port. A call that used the slice's old address uploaded its input there and was refused ('input
0 is held by the worker at OLD, which is not ready'), its output waited for at the old address too:
the first call after a worker's move failed. Now a call on a slice whose worker the session knows
lost reads the slice again from the controller first. A worker back at its old address leaves the
session's lost workers then (else every later call would read the slice again).

Real processes: a controller and a worker, a `pw` program in its own process that reaches the
controller through a TCP relay (tests/relay.py); the relay holds the controller's replies on the
connections open then (the session's stream: its `SliceChanged`), while new connections go through."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import LocalCluster
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
while s.address not in rt.lost_workers and time.monotonic() - start < 30:  # the session heard of it (HostLost)
    time.sleep(0.05)
print(json.dumps({"lost": s.address in rt.lost_workers}), flush=True)
sys.stdin.readline()  # the worker is back at a new address; the session's events are held
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


def _line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    line = proc.stdout.readline() if proc.stdout else ""
    assert line, f"the program ended: {proc.stderr.read()[-3000:] if proc.stderr else ''}"
    return json.loads(line)


def _say(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()


@pytest.mark.parametrize("back", ["at a new address", "at its old address"])
def test_a_call_before_the_session_heard_of_the_worker_back_runs_there(cluster: LocalCluster, back: str) -> None:
    relay = Relay(cluster.address)
    env = cluster.env()
    env["PWCTL_SERVER"] = relay.address
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = _line(proc)
        assert first["warm"] == [[2.0, 2.0]], first
        cluster.kill_worker("w-a")
        _say(proc)
        assert _line(proc) == {"lost": True}
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
        relay.release()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        relay.close()
