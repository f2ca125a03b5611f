"""An upload whose release reached its worker is not sent again (pwctl/worker_client.py
`WorkerClient.released`, pwctl/api/runtime.py `_upload_wanted`).

A `pw` call releases each of its uploads right after its run; the controller sends a release on
to the worker only once every run the client sent before it is over, and tells the client when
it arrived (`releases_done`). An upload the worker took but whose acknowledgement was lost (the
worker died right after) was sent again on the next stream: to a worker restarted at the same
address, which stored it and, its release gone to the worker before, kept it until the session
ended. Now the client drops it, unless its run was in flight at a controller restart (the
release sent again then passed a controller that never knew the run).

Real processes: a controller and a worker, a `pw` program in its own process, the client
library's `WorkerClient` against the worker, and a TCP relay (tests/relay.py) between them that
holds the worker's replies (its acknowledgements) while the client's uploads get through."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from pwctl.worker_client import WorkerClient
from schemas.pathways.v1 import worker_pb2 as wpb
from tests.conftest import LocalCluster, wait_for
from tests.relay import Relay
from tests.test_trust_worker import fetch
from tests.test_upload_loss import AFTER_RESTART, RELAYED, Scripted, assert_not_sent_again, opened_session, restarted_at

pytestmark = [pytest.mark.timeout(150), pytest.mark.cluster(islands=1, devices=1)]

SUCCEEDED = RELAYED + """\
sys.stdin.readline()  # the relay holds the worker's replies: the upload gets in, its acknowledgement does not
f = inc(np.ones((1, 2)))
start = time.monotonic()
while (rt.in_flight() or rt._sender.unacked) and time.monotonic() - start < 30:  # the run over, the release in
    time.sleep(0.05)
print(json.dumps({"error": rt.run_failed(f.run_id), "in_flight": rt.in_flight(), "releases": len(rt._sender.unacked),
                  "unacknowledged": wc.unacknowledged()}), flush=True)
""" + AFTER_RESTART


def test_a_succeeded_runs_upload_is_not_sent_again_to_the_restarted_worker(cluster: LocalCluster) -> None:
    """The worker takes a run's upload and runs it, but its acknowledgement is held; the run is
    over and the upload's release reached the worker. The worker dies and restarts at the same
    address, and the link breaks: the upload is dropped, not sent again. Sent again, the new
    worker stored it (it never saw it, nor its release) and kept it until the session ended."""
    address = cluster.hosts()["w-a"].address
    relay = Relay(address)
    try:
        with Scripted(SUCCEEDED, relay.address, cluster.env()) as client:
            relay.hold_replies()
            out = client.step()
            assert out == {"error": "", "in_flight": 0, "releases": 0, "unacknowledged": 1}, out
            cluster.kill_worker("w-a")
            worker = restarted_at(cluster, address)
            assert_not_sent_again(cluster, relay, client, "the succeeded run's upload was sent again and is kept")
    finally:
        relay.close()
    assert "Traceback" not in worker.log.read_text(errors="replace")


GIVEN_UP = RELAYED + """\
sys.stdin.readline()  # the relay holds the worker's replies
f = inc(np.ones((1, 2)))
start = time.monotonic()
while (rt.in_flight() or rt._sender.unacked) and time.monotonic() - start < 30:
    time.sleep(0.05)
print(json.dumps({"in_flight": rt.in_flight(), "releases": len(rt._sender.unacked),
                  "unacknowledged": wc.unacknowledged()}), flush=True)
sys.stdin.readline()  # the relay refuses connections now: nothing gets through to the worker from here
start = time.monotonic()
while wc.unacknowledged() and time.monotonic() - start < 30:
    time.sleep(0.05)
time.sleep(0.5)
print(json.dumps({"unacknowledged": wc.unacknowledged(), "error": rt.run_failed(f.run_id)}), flush=True)
"""


def test_a_succeeded_runs_upload_that_cannot_be_sent_again_does_not_fail_its_run(module_cluster: LocalCluster) -> None:
    """The same upload, acknowledgement held, run over and release in; then the worker cannot be
    reached from the client any more. The upload was sent again for seconds, then given up, and
    its run, which had succeeded, was failed in the client ("input buffer ... was lost") and
    cancelled on the controller. Now it is dropped at once and the run stays succeeded."""
    relay = Relay(module_cluster.hosts()["w-a"].address)
    try:
        with Scripted(GIVEN_UP, relay.address, module_cluster.env()) as client:
            relay.hold_replies()
            for expected in ({"in_flight": 0, "releases": 0, "unacknowledged": 1}, {"unacknowledged": 0, "error": ""}):
                assert client.step() == expected
                relay.refuse()
            assert client.wait(timeout=30) == 0
    finally:
        relay.close()


def test_only_the_uploads_whose_release_arrived_are_dropped_the_others_are_sent_again(
        module_cluster: LocalCluster) -> None:
    """Of two uploads a broken link did not deliver, the one marked released is dropped and the
    other sent again: an upload whose run may still read it is never lost."""
    cluster = module_cluster
    with opened_session(cluster) as (s, stub, md, address):
        relay = Relay(address)
        lost: list[object] = []
        wc = WorkerClient(relay.address, cluster.token, s.credential, on_lost=lambda ups, e: lost.append(ups),
                          wanted=lambda u: not u.released)
        try:
            wc.put(s.id(1), np.arange(3.0))
            wait_for(lambda: wc.unacknowledged() == 0, 20, "the first upload to be acknowledged")
            relay.hold()  # the link stalls: what is sent now stays in the relay
            wc.put(s.id(2), np.ones(4))
            wc.put(s.id(3), np.full(4, 3.0))
            wc.released([s.id(2), s.id(9)])  # 9: not an upload of this client's
            time.sleep(0.3)
            assert wc.unacknowledged() == 2
            relay.cut()
            relay.release()
            np.testing.assert_array_equal(fetch(stub, md, s.id(3), timeout_s=20), np.full(4, 3.0))
            wait_for(lambda: wc.unacknowledged() == 0, 20, "the upload sent again to be acknowledged")
            reply = stub.Wait(wpb.WaitRequest(buffer_ids=[s.id(2)], timeout_s=1.0, must_exist=True), metadata=md,
                              timeout=10)
            assert not reply.ready and reply.error, reply  # never sent again: the worker does not know it
            assert not lost
        finally:
            wc.close()
            relay.close()


WANTED = """\
import json
from pwctl.api.runtime import Runtime
from pwctl.worker_client import Upload

rt = Runtime.get()
run = rt.new_id()
out = {"fresh": rt._upload_wanted(Upload(rt.new_id(), [], run)),
       "released": rt._upload_wanted(Upload(rt.new_id(), [], run, released=True))}
rt.resume.strand(run, ())  # in flight at a controller restart: the release may have passed one that did not know it
out["uncertain"] = rt._upload_wanted(Upload(rt.new_id(), [], run, released=True))
rt._fail_run(run, "failed")
out["failed"] = rt._upload_wanted(Upload(rt.new_id(), [], run))
print(json.dumps(out), flush=True)
"""


def test_a_released_upload_of_a_run_uncertain_after_a_controller_restart_is_still_wanted(
        module_cluster: LocalCluster) -> None:
    """A release sent again on a resumed session passes the new controller's barrier at once (it
    never knew the run, which its worker may still hold, waiting for this input): its upload is
    sent again. One released on the controller that knew its run is not; nor is one whose run failed."""
    r = subprocess.run([sys.executable, "-c", WANTED], env=module_cluster.env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"fresh": True, "released": False, "uncertain": True, "failed": False}, out
