"""Uploads a stream lost: the client knows which the worker did not acknowledge and sends them
again, or gives them up at once (pwctl/worker_client.py); the worker drops an array cut off
mid-way on such a stream instead of failing it, since it comes again (servicer.py `Uploads`).

Before, a `pw` upload over one message (64 MiB) ended the client's upload stream, and that upload
and every one queued behind it were lost: the runs reading them waited for the controller's hang
timeout (60 s). A stream that broke lost what it had not delivered the same way.

Real processes: a controller and a worker (`module_cluster`, shared; `cluster` for a test that
kills the worker or counts its buffers), a `pw` program in its own process, the
client library's `WorkerClient` against the worker, and a TCP relay (tests/relay.py) between
them where a connection must break while both ends live."""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from pwctl.worker_client import PIECE_BYTES, WorkerClient, upload_messages
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
from tests.conftest import LocalCluster, wait_for
from tests.relay import Relay
from tests.test_trust_worker import Session, fetch, meta, open_session, worker_log

pytestmark = [pytest.mark.timeout(150), pytest.mark.cluster(islands=1, devices=1)]

LARGE = """\
import json, sys, time
import numpy as np
import pwctl as pw

s = pw.make_virtual_device_set().add_slice(devices=1)
inc = pw.pmap(lambda x: x + 1.0, devices=s.devices)
assert np.asarray(inc(np.zeros((1, 4), np.float32))).tolist() == [[1.0] * 4]
big = np.arange((80 << 20) // 4, dtype=np.float32).reshape(1, -1)  # 80 MiB: over one message
a = inc(big)
b = inc(np.full((1, 4), 2.0, np.float32))  # uploaded right behind it, on the same stream
out = {}
for key, fut in (("big", a), ("behind", b)):
    start = time.monotonic()
    try:
        v = fut.result(timeout=30)
        out[key] = {"ok": True, "head": v[0, :3].tolist(), "last": float(v[0, -1]), "s": time.monotonic() - start}
    except Exception as e:
        out[key] = {"ok": False, "error": f"{type(e).__name__}: {e}", "s": time.monotonic() - start}
print(json.dumps(out), flush=True)
"""


def test_a_pw_upload_over_one_message_and_the_uploads_behind_it_reach_the_worker(module_cluster: LocalCluster) -> None:
    cluster = module_cluster
    r = subprocess.run([sys.executable, "-c", LARGE], env=cluster.env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    last = float((80 << 20) // 4 - 1) + 1.0
    assert out["big"]["ok"] and out["big"]["head"] == [1.0, 2.0, 3.0] and out["big"]["last"] == last, out
    assert out["behind"]["ok"] and out["behind"]["head"] == [3.0, 3.0, 3.0], out
    assert out["big"]["s"] < 25 and out["behind"]["s"] < 10, out  # the old code: the 30 s timeout, then the hang
    assert "Traceback" not in worker_log(cluster)


def fetch_whole(stub: wgrpc.WorkerStub, md: Any, buffer_id: int, timeout_s: float = 10.0) -> np.ndarray:
    """A buffer's value, from as many chunks as it comes in."""
    chunks = list(stub.Fetch(wpb.FetchRequest(buffer_id=buffer_id, timeout_s=timeout_s), metadata=md,
                             timeout=timeout_s + 10))
    assert chunks and not chunks[0].error, chunks[0].error if chunks else "no reply"
    head = chunks[0].array
    data = b"".join(c.array.data for c in chunks)
    return np.frombuffer(data, dtype=head.dtype).reshape(list(head.shape))


@contextlib.contextmanager
def opened_session(cluster: LocalCluster) -> Iterator[tuple[Session, wgrpc.WorkerStub, Any, str]]:
    address = cluster.hosts()["w-a"].address
    big = [("grpc.max_receive_message_length", 256 << 20)]  # fetches of arrays over 4 MiB come whole
    with grpc.insecure_channel(address, options=big) as wch, grpc.insecure_channel(cluster.address) as cch:
        s = open_session(cluster, cch)
        yield s, wgrpc.WorkerStub(wch), meta(cluster, s), address
        s.close()


@pytest.fixture
def session(module_cluster: LocalCluster) -> Iterator[tuple[Session, wgrpc.WorkerStub, Any, str]]:
    """A session on the module's cluster, with a stub for its worker (the tests that use it leave
    the cluster as they found it: their buffers go with their session)."""
    with opened_session(module_cluster) as s:
        yield s


@pytest.fixture
def own_session(cluster: LocalCluster) -> Iterator[tuple[Session, wgrpc.WorkerStub, Any, str]]:
    """A session on this test's own cluster (a test that counts the worker's buffers)."""
    with opened_session(cluster) as s:
        yield s


def test_uploads_a_broken_connection_did_not_deliver_are_sent_again(module_cluster: LocalCluster, session: Any) -> None:
    cluster = module_cluster
    s, stub, md, address = session
    relay = Relay(address)
    lost: list[Any] = []
    wc = WorkerClient(relay.address, cluster.token, s.credential, on_lost=lambda ups, e: lost.append((ups, e)))
    try:
        wc.put(s.id(1), np.arange(3.0))
        wait_for(lambda: wc.unacknowledged() == 0, 20, "the first upload to be acknowledged")
        # readers of the next two wait on the worker (as a run's task would)
        waiting = stub.Wait.future(wpb.WaitRequest(buffer_ids=[s.id(2), s.id(3)], timeout_s=40), metadata=md,
                                   timeout=50)
        relay.hold()  # the link stalls: what is sent now stays in the relay's buffers
        big = np.arange(PIECE_BYTES // 8 * 2 + 5, dtype=np.float64)  # in three pieces
        wc.put(s.id(2), big)
        wc.put(s.id(3), np.ones(4))
        time.sleep(0.5)
        assert wc.unacknowledged() == 2
        start = time.monotonic()
        relay.cut()  # the connection breaks (an RST both ways); the link works again after
        relay.release()
        reply = waiting.result(timeout=30)
        took = time.monotonic() - start
        assert reply.ready and not reply.error, reply
        assert took < 10, took
        np.testing.assert_array_equal(fetch_whole(stub, md, s.id(2)), big)
        np.testing.assert_array_equal(fetch(stub, md, s.id(3)), np.ones(4))
        assert wc.unacknowledged() == 0 and not lost and relay.accepted >= 2
    finally:
        wc.close()
        relay.close()
    assert "Traceback" not in worker_log(cluster)


def test_uploads_that_cannot_get_through_are_given_up_within_seconds(
        module_cluster: LocalCluster, session: Any) -> None:
    cluster = module_cluster
    s, stub, md, address = session
    relay = Relay(address)
    lost: list[tuple[list[int], str, float]] = []
    wc = WorkerClient(relay.address, cluster.token, s.credential,
                      on_lost=lambda ups, e: lost.append(([u.buffer_id for u in ups], e, time.monotonic())))
    try:
        wc.put(s.id(1), np.arange(3.0))
        wait_for(lambda: wc.unacknowledged() == 0, 20, "the first upload to be acknowledged")
        relay.hold()
        wc.put(s.id(2), np.ones(4), run_id=s.id(100))
        wc.put(s.id(3), np.ones(5), run_id=s.id(101))
        time.sleep(0.3)
        start = time.monotonic()
        relay.refuse()  # the worker cannot be reached any more from here
        wait_for(lambda: lost, 20, "the uploads to be given up")
        (ids, error, when), = lost
        assert ids == [s.id(2), s.id(3)] and f"uploads to the worker at {relay.address} failed" in error, lost
        assert when - start < 10, when - start
        assert wc.unacknowledged() == 0
        # the link is back: the next upload opens a stream again and gets through
        relay.release()
        wc.put(s.id(4), np.arange(2.0))
        np.testing.assert_array_equal(fetch(stub, md, s.id(4), timeout_s=10), np.arange(2.0))
    finally:
        wc.close()
        relay.close()


def test_an_array_cut_off_on_an_acknowledged_stream_is_kept_for_its_second_sending(
        module_cluster: LocalCluster, session: Any) -> None:
    """On `Uploads` a cut-off array is dropped without failing what waits for it (the client sends
    it again); on `PutBuffers`, whose callers do not, the waiter gets the reason at once
    (tests/test_worker_refused_uploads.py)."""
    cluster = module_cluster
    s, stub, md, _ = session
    arr = np.arange(PIECE_BYTES // 4 + 3, dtype=np.float32)
    first, *rest = upload_messages(s.id(5), arr)
    assert rest, "the array goes in pieces"
    waiting = stub.Wait.future(wpb.WaitRequest(buffer_ids=[s.id(5)], timeout_s=40), metadata=md, timeout=50)
    reqs: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def requests() -> Iterator[wpb.PutBufferRequest]:
        while (r := reqs.get()) is not None:
            yield r

    call = stub.Uploads(requests(), metadata=md, timeout=60)
    reqs.put(first)
    assert next(call).handled == 1  # the first piece is in
    call.cancel()
    reqs.put(None)
    time.sleep(1.0)
    assert not waiting.done(), "the waiter is not failed: the array comes again"
    acks = [a.handled for a in stub.Uploads(iter([first, *rest]), metadata=md, timeout=30)]
    assert acks == sorted(set(acks)) and acks[-1] == len(rest) + 1, acks  # the last covers all
    reply = waiting.result(timeout=20)
    assert reply.ready and not reply.error, reply
    np.testing.assert_array_equal(fetch_whole(stub, md, s.id(5)), arr)
    assert "Traceback" not in worker_log(cluster)


def test_an_upload_sent_again_after_the_worker_freed_it_is_not_kept(cluster: LocalCluster, own_session: Any) -> None:
    """The copy a client sends again (its acknowledgement was lost with the stream) of an upload
    the worker stored, served and freed since is dropped: kept, nobody would ever release it."""
    s, stub, md, address = own_session

    def buffers() -> int:
        return stub.Stats(wpb.WorkerStatsRequest(), metadata=meta(cluster), timeout=10).buffers

    before = buffers()
    (msg,) = upload_messages(s.id(6), np.arange(4.0))
    assert [a.handled for a in stub.Uploads(iter([msg]), metadata=md, timeout=30)] == [1]
    np.testing.assert_array_equal(fetch(stub, md, s.id(6)), np.arange(4.0))
    s.release(address, s.id(6))
    wait_for(lambda: buffers() == before, 30, "the released upload to be freed")
    msg.again = True
    assert [a.handled for a in stub.Uploads(iter([msg]), metadata=md, timeout=30)] == [1]
    time.sleep(0.5)
    assert buffers() == before
    # an upload sent again that the worker never got is stored as any other
    (other,) = upload_messages(s.id(7), np.ones(2))
    other.again = True
    assert [a.handled for a in stub.Uploads(iter([other]), metadata=md, timeout=30)] == [1]
    np.testing.assert_array_equal(fetch(stub, md, s.id(7)), np.ones(2))


GIVEN_UP = """\
import json, sys, time
import numpy as np
import pwctl as pw
from pwctl.api.runtime import Runtime
from pwctl.worker_client import WorkerClient

vds = pw.make_virtual_device_set()
s = vds.add_slice(devices=1)
inc = pw.pmap(lambda x: x + 1.0, devices=s.devices)
assert np.asarray(inc(np.zeros((1, 2)))).tolist() == [[1.0, 1.0]]
rt = Runtime.get()
# from here this client's uploads to the worker go through the relay (sys.argv[1]); the
# controller still reaches the worker directly
rt._workers[s.address] = WorkerClient(sys.argv[1], rt.client.token, rt._credential, on_lost=rt._uploads_lost)
print("ready", flush=True)
sys.stdin.readline()  # the relay refuses connections now
start = time.monotonic()
f = inc(np.ones((1, 2)))
while not rt.run_failed(f.run_id) and time.monotonic() - start < 30:
    time.sleep(0.05)
failed = time.monotonic() - start
while rt.in_flight() and time.monotonic() - start < 30:  # until the controller says the run is over
    time.sleep(0.05)
print(json.dumps({"error": rt.run_failed(f.run_id), "failed_s": failed, "over_s": time.monotonic() - start,
                  "in_flight": rt.in_flight()}), flush=True)
"""


def test_a_run_whose_upload_is_given_up_fails_at_once_in_the_client_and_on_the_worker(
        module_cluster: LocalCluster) -> None:
    """The client cannot reach the worker (the controller still can): the upload is given up
    within seconds, the run fails in the client naming the input, and the client cancels it on
    the controller, which drops it on the worker: the run is over at once, not at the hang timeout."""
    cluster = module_cluster
    relay = Relay(cluster.hosts()["w-a"].address)
    proc = subprocess.Popen([sys.executable, "-c", GIVEN_UP, relay.address], env=cluster.env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read() if proc.stderr else ""
        relay.refuse()
        proc.stdin.write("\n")
        proc.stdin.flush()
        out = json.loads(proc.stdout.readline())
        assert "input buffer" in out["error"] and "of this run was lost" in out["error"], out
        assert f"uploads to the worker at {relay.address} failed" in out["error"], out
        assert out["failed_s"] < 10 and out["over_s"] < 15 and out["in_flight"] == 0, out
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        relay.close()
    assert "hang detected" not in cluster.controller_logs()
    assert "Traceback" not in worker_log(cluster)


# A client program's start (Scripted): a 1-device slice and `inc` over it, this client's uploads
# to the worker through the relay at sys.argv[1] from its second call on (as rt.worker makes its
# clients: `wc`; the controller still reaches the worker directly), its stream open, then "ready".
RELAYED = """\
import json, sys, time
import numpy as np
import pwctl as pw
from pwctl.api.runtime import Runtime
from pwctl.worker_client import WorkerClient

s = pw.make_virtual_device_set().add_slice(devices=1)
inc = pw.pmap(lambda x: x + 1.0, devices=s.devices)
assert np.asarray(inc(np.zeros((1, 2)))).tolist() == [[1.0, 1.0]]
rt = Runtime.get()
wc = rt._workers[s.address] = WorkerClient(sys.argv[1], rt.client.token, rt._credential, on_lost=rt._uploads_lost,
                                           wanted=rt._upload_wanted)
assert np.asarray(inc(np.ones((1, 2)))).tolist() == [[2.0, 2.0]]  # its stream is open: uploads go on it
print("ready", flush=True)
"""


# The client's side of `assert_not_sent_again` (after a program that set `wc` up: RELAYED).
AFTER_RESTART = """\
sys.stdin.readline()  # the worker is back at its address; the relay broke the held link and copies again
start = time.monotonic()
while wc.unacknowledged() and time.monotonic() - start < 30:
    time.sleep(0.05)
print(json.dumps({"unacknowledged": wc.unacknowledged(), "s": time.monotonic() - start}), flush=True)
sys.stdin.readline()
print(json.dumps({"again": np.asarray(inc(np.full((1, 2), 2.0))).tolist()}), flush=True)
"""


class Scripted:
    """A client program run as a subprocess in step with its test: it prints "ready" (checked
    here), then, each time it reads a line (`go`), one JSON line (`read`); `step` is both."""

    def __init__(self, program: str, arg: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", program, arg], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert self._line().strip() == "ready", self._stderr()
        except BaseException:
            self.close()
            raise

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def _stderr(self) -> str:
        return self.proc.stderr.read() if self.proc.stderr else ""

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def read(self) -> Any:
        line = self._line()
        assert line, self._stderr()
        return json.loads(line)

    def step(self) -> Any:
        self.go()
        return self.read()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> Scripted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


RESTARTED = RELAYED + """\
sys.stdin.readline()  # the relay holds the link: the upload stays in it, unacknowledged
f = inc(np.ones((1, 2)))
start = time.monotonic()
while not rt.run_failed(f.run_id) and time.monotonic() - start < 60:  # the worker is killed meanwhile
    time.sleep(0.05)
print(json.dumps({"error": rt.run_failed(f.run_id), "unacknowledged": wc.unacknowledged()}), flush=True)
""" + AFTER_RESTART


def test_an_upload_whose_run_failed_is_not_sent_again_to_the_restarted_worker(cluster: LocalCluster) -> None:
    """The worker is killed while a run's upload is unacknowledged; the controller fails the run
    (host lost) and the client learns it. When the link comes back, the worker has restarted at
    the same address: the upload is dropped, not sent again. Sent again, the new worker stored it
    (it never saw it, nor its release) and kept it until the session's buffers went."""
    address = cluster.hosts()["w-a"].address
    relay = Relay(address)
    try:
        with Scripted(RESTARTED, relay.address, cluster.env()) as client:
            relay.hold()
            time.sleep(0.2)
            client.go()
            time.sleep(1.0)  # the run is sent, its upload waits in the relay
            cluster.kill_worker("w-a")
            out = client.read()
            assert "w-a" in out["error"] and out["unacknowledged"] == 1, out
            worker = restarted_at(cluster, address)
            assert_not_sent_again(cluster, relay, client, "the failed run's upload was sent again and is kept")
    finally:
        relay.close()
    assert "Traceback" not in worker.log.read_text(errors="replace")


def restarted_at(cluster: LocalCluster, address: str) -> Any:
    """Worker w-a (killed) started again at its old address; its process."""
    worker = cluster.add_worker("a", 1, name="w-a", program=("-m", "server.worker", "--listen", address))
    assert cluster.hosts()["w-a"].address == address
    return worker


def assert_not_sent_again(cluster: LocalCluster, relay: Relay, client: Scripted, why: str) -> None:
    """The worker restarted at its address: the relay breaks the link it held and copies again;
    the client's upload not acknowledged was not sent again (the worker's buffers did not grow),
    and its next call works."""
    address = cluster.hosts()["w-a"].address
    with grpc.insecure_channel(address) as ch:
        stub = wgrpc.WorkerStub(ch)

        def buffers() -> int:
            return stub.Stats(wpb.WorkerStatsRequest(), metadata=meta(cluster), timeout=10).buffers

        before = buffers()
        relay.cut()  # the held link breaks: the client opens a new stream, to the new worker
        relay.release()
        out = client.step()
        assert out["unacknowledged"] == 0, out
        time.sleep(1.0)  # an upload sent again would be stored by now (it is acknowledged after)
        assert buffers() == before, why
    assert client.step() == {"again": [[3.0, 3.0]]}  # the link and the restarted worker work
    assert client.wait(timeout=30) == 0


CROWDED = """\
import json, threading
from collections import OrderedDict
import pwctl as pw
from pwctl.api.runtime import Runtime
from pwctl.worker_client import Upload

rt = Runtime.get()


class Crowded(OrderedDict):
    # the runtime's failed runs, whose lookups wait for one another (up to 2 s) before they answer:
    # two reports that race both look before either records the run
    barrier = threading.Barrier(2, timeout=2.0)

    def __contains__(self, key):
        found = super().__contains__(key)
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:  # the other one does not come (it waits for the first)
            pass
        return found


class Recorded:
    # the session stream's queue, recording the cancel_run messages put on it
    def __init__(self, q):
        self.q, self.cancels = q, []

    def put(self, item):
        if hasattr(item, "WhichOneof") and item.WhichOneof("msg") == "cancel_run":
            self.cancels.append(item.cancel_run.run_id)
        self.q.put(item)

    def get(self, *args, **kwargs):
        return self.q.get(*args, **kwargs)

    def get_nowait(self):
        return self.q.get_nowait()


rt._failed_runs = Crowded(rt._failed_runs)
rt._out = sent = Recorded(rt._out)
run = rt.new_id()
a, b = (Upload(rt.new_id(), [], run) for _ in range(2))
# two workers' clients give up an input of the same run at the same moment, each from its thread
threads = [threading.Thread(target=rt._uploads_lost, args=([u], f"worker {i} gone")) for i, u in enumerate((a, b))]
for t in threads:
    t.start()
for t in threads:
    t.join()
rt._uploads_lost([a, b], "later")  # and again, later, both in one report
cancels = sent.cancels
print(json.dumps({"cancels": cancels, "run": run, "error": rt.run_failed(run)}), flush=True)
"""


def test_a_run_is_cancelled_once_however_many_of_its_uploads_are_lost(module_cluster: LocalCluster) -> None:
    """Each worker's client reports its lost uploads from its own thread: two reports for inputs of
    one run at the same moment sent a `cancel_run` each (both looked up the run before either
    recorded it); now one, and none for a later report of the same run."""
    cluster = module_cluster
    r = subprocess.run([sys.executable, "-c", CROWDED], env=cluster.env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["cancels"] == [out["run"]], out
    assert "of this run was lost: worker" in out["error"], out


BOUNDED = """\
import json
from pwctl.api import runtime
from pwctl.api.runtime import Runtime
from pwctl.worker_client import Upload

rt = Runtime.get()
limit = rt._failed_runs.limit
rt._failed_runs.limit = 8  # the real runtime's map, its bound lowered: 12 runs lose an input, one after another
runs = [rt.new_id() for _ in range(12)]
for run in runs:
    rt._uploads_lost([Upload(rt.new_id(), [], run)], "worker gone")
print(json.dumps({"limit": limit, "max": runtime.MAX_FAILED_RUNS, "kept": len(rt._failed_runs),
                  "errors": [rt.run_failed(run) for run in runs]}), flush=True)
"""


def test_runs_failed_by_a_lost_upload_are_remembered_within_the_bound(module_cluster: LocalCluster) -> None:
    """Runs failed in the client (a lost upload) were remembered without a bound (only the
    controller's RunFinished trimmed the map); every insertion now keeps MAX_FAILED_RUNS."""
    cluster = module_cluster
    r = subprocess.run([sys.executable, "-c", BOUNDED], env=cluster.env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["limit"] == out["max"] == 4096, out
    assert out["kept"] == 8, out
    errors = out["errors"]
    assert errors[:4] == ["", "", "", ""], out  # the oldest four forgotten
    assert all("of this run was lost: worker gone" in e for e in errors[4:]), out


def test_acknowledgements_are_coalesced_and_the_last_covers_every_message(session: Any) -> None:
    """A burst of small uploads gets far fewer acknowledgements than messages (server/worker/acks.py:
    one per message cost a third of a small-upload loop's calls/s), each a count covering all
    before it, the last one every message; every upload is stored."""
    s, stub, md, _ = session
    n = 300
    msgs = [m for i in range(n) for m in upload_messages(s.id(1000 + i), np.full(4, float(i)))]
    acks = [a.handled for a in stub.Uploads(iter(msgs), metadata=md, timeout=60)]
    assert acks and acks == sorted(set(acks)) and acks[-1] == n, acks
    assert len(acks) < n // 2, f"{len(acks)} acknowledgements for {n} messages"
    for i in (0, n // 2, n - 1):
        np.testing.assert_array_equal(fetch(stub, md, s.id(1000 + i)), np.full(4, float(i)))
