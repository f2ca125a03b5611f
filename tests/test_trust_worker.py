"""The worker trusts no caller (issue 29, the worker's part): every call authenticated, on loopback
too; a session reads, waits on and feeds only its own buffers; no request can wedge the worker;
no client names a shared-memory segment; malformed input is a status code and one log line.

Real processes throughout: a controller and a worker from the `cluster` fixture, sessions opened
on the controller's Session stream (which hands out the credential), raw gRPC calls to the
worker as a hostile client would make them."""

from __future__ import annotations

import _posixshmem
import contextlib
import itertools
import json
import mmap
import os
import queue
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
from server import wire
from server.credentials import PEER_HEADER, SESSION_HEADER
from server.worker.servicer import MAX_WAIT_IDS
from server.worker.transfer import DATA_CHUNK
from tests.conftest import REPO, LocalCluster, base_env, free_port, run_pwctl, wait_for

pytestmark = [pytest.mark.timeout(120), pytest.mark.cluster(islands=1, devices=1)]

_STOP = object()


@dataclass
class Session:
    """A client session on the controller, as the pw runtime opens one."""

    owner: str
    prefix: int
    credential: str
    out: queue.SimpleQueue[Any]
    call: Any

    def id(self, n: int) -> int:
        return self.prefix << 40 | n

    def release(self, address: str, *ids: int) -> None:
        self.out.put(cpb.ClientMessage(release=wpb.ReleaseBuffers(address=address, buffer_ids=list(ids))))

    def close(self) -> None:
        self.out.put(_STOP)
        self.call.cancel()


def open_session(cluster: LocalCluster, channel: grpc.Channel) -> Session:
    out: queue.SimpleQueue[Any] = queue.SimpleQueue()
    out.put(cpb.ClientMessage(hello=cpb.Hello(client_name="trust-test")))

    def requests() -> Iterator[cpb.ClientMessage]:
        while (m := out.get()) is not _STOP:
            yield m

    token = cluster.token
    call = cgrpc.ControllerStub(channel).Session(
        requests(), metadata=(("authorization", f"Bearer {token}"),) if token else ())
    welcome = next(call).welcome
    assert welcome.worker_credential, "the controller hands every session a worker credential"
    return Session(owner=f"client:{welcome.client_id}", prefix=welcome.id_prefix,
                   credential=welcome.worker_credential, out=out, call=call)


def meta(cluster: LocalCluster, s: Session | None = None) -> tuple[tuple[str, str], ...]:
    m: list[tuple[str, str]] = []
    if cluster.token:
        m.append(("authorization", f"Bearer {cluster.token}"))
    if s is not None:
        m.append((SESSION_HEADER, s.credential))
    return tuple(m)


def upload(stub: wgrpc.WorkerStub, md: Any, buffer_id: int, arr: np.ndarray, timeout_s: float = 10.0,
           **array: Any) -> wpb.PutBuffersResponse:
    req = wpb.PutBufferRequest(buffer_id=buffer_id, array=pb.ArrayProto(
        dtype=arr.dtype.name, shape=list(arr.shape), data=arr.tobytes(), **array))
    return stub.PutBuffers(iter([req]), metadata=md, timeout=timeout_s)


def fetch(stub: wgrpc.WorkerStub, md: Any, buffer_id: int, timeout_s: float = 5.0) -> np.ndarray:
    chunks = list(stub.Fetch(wpb.FetchRequest(buffer_id=buffer_id, timeout_s=timeout_s), metadata=md,
                             timeout=timeout_s + 10))
    assert len(chunks) == 1 and not chunks[0].error, chunks
    a = chunks[0].array
    return np.frombuffer(a.data, dtype=a.dtype).reshape(list(a.shape))


def code_of(fn: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        r = fn()
        if isinstance(r, Iterator):
            list(r)
    return e.value.code()


@contextlib.contextmanager
def worker_channels(cluster: LocalCluster) -> Iterator[tuple[str, grpc.Channel, wgrpc.WorkerStub, grpc.Channel]]:
    address = cluster.hosts()["w-a"].address
    wch, cch = grpc.insecure_channel(address), grpc.insecure_channel(cluster.address)
    yield address, wch, wgrpc.WorkerStub(wch), cch
    wch.close()
    cch.close()


@pytest.fixture
def worker(cluster: LocalCluster) -> Iterator[tuple[str, grpc.Channel, wgrpc.WorkerStub, grpc.Channel]]:
    """The worker of this test's own cluster (a test that stops it, or counts its buffers)."""
    with worker_channels(cluster) as w:
        yield w


@pytest.fixture
def shared_worker(module_cluster: LocalCluster) -> Iterator[tuple[str, grpc.Channel, wgrpc.WorkerStub, grpc.Channel]]:
    """The worker of the module's cluster, for tests that leave it as they found it (their
    sessions, and the buffers those own, end with the test)."""
    with worker_channels(module_cluster) as w:
        yield w


def worker_log(cluster: LocalCluster) -> str:
    return cluster.workers["w-a"].log.read_text(errors="replace")


# ---- finding 1: bogus fetches wedged the worker for good ----

def test_bogus_fetches_and_waits_cannot_wedge_the_worker_or_its_shutdown(cluster: LocalCluster, worker: Any) -> None:
    _, _, stub, cch = worker
    s = open_session(cluster, cch)
    md = meta(cluster, s)
    # far more than the worker's threads: ids that nobody will ever produce, waits with no timeout
    bogus = [stub.Fetch(wpb.FetchRequest(buffer_id=s.id(10_000 + i)), metadata=md) for i in range(150)]
    waits = [stub.Wait.future(wpb.WaitRequest(buffer_ids=[s.id(20_000 + i)]), metadata=md) for i in range(50)]
    for call in bogus[:75]:  # half of the callers give up
        call.cancel()
    for w in waits[:25]:
        w.cancel()
    time.sleep(0.5)  # let every call reach the worker (nothing to wait on: they are all waiting)
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    start = time.monotonic()
    assert upload(stub, md, s.id(1), arr).count == 1
    np.testing.assert_array_equal(fetch(stub, md, s.id(1)), arr)
    ok = stub.Wait(wpb.WaitRequest(buffer_ids=[s.id(1)], timeout_s=5), metadata=md, timeout=15)
    assert ok.ready and not ok.error
    assert time.monotonic() - start < 5.0, "a real fetch waited behind the bogus ones"
    # a bounded bogus fetch ends with "not ready", not never
    chunks = list(stub.Fetch(wpb.FetchRequest(buffer_id=s.id(30_000), timeout_s=0.2), metadata=md, timeout=10))
    assert len(chunks) == 1 and "not ready after" in chunks[0].error
    # and the worker still stops on SIGTERM with 75 fetches and 25 waits still waiting
    proc = cluster.workers["w-a"].proc
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=20)
    assert time.monotonic() - start < 10.0
    for call in bogus[75:]:
        call.cancel()
    s.close()


# ---- finding 3: a client-named shared-memory segment was read and unlinked ----

def _segment(name: str, data: bytes) -> None:
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, len(data))
        with mmap.mmap(fd, len(data)) as m:
            m[:] = data
    finally:
        os.close(fd)


def _exists(name: str) -> bool:
    return os.path.exists("/dev/shm" + name)


def test_no_client_can_make_the_worker_open_or_unlink_a_segment(
        module_cluster: LocalCluster, shared_worker: Any) -> None:
    cluster = module_cluster
    _, _, stub, cch = shared_worker
    s = open_session(cluster, cch)
    md = meta(cluster, s)
    ring = "/pw_ring_" + secrets.token_hex(8)  # looks like another worker's ring
    other = "/not-pathways-" + secrets.token_hex(4)  # an unrelated process's segment
    for name in (ring, other):
        _segment(name, np.arange(4, dtype=np.float32).tobytes())
    try:
        for i, name in enumerate((ring, other)):
            req = wpb.PutBufferRequest(buffer_id=s.id(i + 1), array=pb.ArrayProto(
                dtype="float32", shape=[4], shm_name=name.lstrip("/")))
            assert code_of(lambda r=req: stub.PutBuffers(iter([r]), metadata=md, timeout=10)) \
                == grpc.StatusCode.INVALID_ARGUMENT
            req.array.shm_name = name
            assert code_of(lambda r=req: stub.PutBuffers(iter([r]), metadata=md, timeout=10)) \
                == grpc.StatusCode.INVALID_ARGUMENT
            # nor through the peers' Transfer, which a client cannot call
            chunk = wpb.TransferChunk(buffer_id=s.id(i + 1), last=True,
                                      array=pb.ArrayProto(dtype="float32", shape=[4], shm_name=name))
            assert code_of(lambda c=chunk: stub.Transfer(iter([c]), metadata=md, timeout=10)) \
                == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda c=chunk: stub.Transfer(iter([c]), metadata=(*md, (PEER_HEADER, "0" * 64)),
                                                         timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        assert _exists(ring) and _exists(other), "the worker unlinked a segment it never handed out"
        assert "Traceback" not in worker_log(cluster)
    finally:
        for name in (ring, other):
            try:
                _posixshmem.shm_unlink(name)
            except FileNotFoundError:
                pass
    s.close()


# ---- finding 4: no isolation between tenants ----

def test_a_session_cannot_read_feed_fail_or_free_another_sessions_buffers(cluster: LocalCluster, worker: Any) -> None:
    address, _, stub, cch = worker
    a, b = open_session(cluster, cch), open_session(cluster, cch)
    assert a.prefix != b.prefix and a.owner != b.owner
    ma, mb = meta(cluster, a), meta(cluster, b)
    secret = np.array([1.0, 2.0, 3.0])
    upload(stub, ma, a.id(1), secret)
    upload(stub, mb, b.id(1), np.zeros(1))

    # reading: another session's buffer answers exactly as an id that does not exist
    def not_found(md: Any, buffer_id: int) -> str:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Fetch(wpb.FetchRequest(buffer_id=buffer_id, timeout_s=1), metadata=md, timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        return e.value.details().replace(f"{buffer_id:#x}", "ID")

    assert not_found(mb, a.id(1)) == not_found(mb, a.id(999)) == "no buffer ID on this worker"
    with pytest.raises(grpc.RpcError) as e:
        stub.Wait(wpb.WaitRequest(buffer_ids=[b.id(1), a.id(1)], timeout_s=1), metadata=mb, timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # feeding: an upload under another session's id, or claiming its owner, changes nothing
    assert code_of(lambda: upload(stub, mb, a.id(1), np.zeros(3))) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: upload(stub, mb, a.id(2), np.zeros(3))) == grpc.StatusCode.PERMISSION_DENIED
    forged = b.credential.replace(b.owner, a.owner)
    assert code_of(lambda: upload(stub, (*mb[:-1], (SESSION_HEADER, forged)), b.id(2), np.zeros(3))) \
        == grpc.StatusCode.UNAUTHENTICATED
    # failing it through the peers' transfer service
    fail = wpb.TransferChunk(buffer_id=a.id(1), last=True, error="injected")
    assert code_of(lambda: stub.Transfer(iter([fail]), metadata=mb, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    # freeing it with a release on its own session (the controller forwards releases to the worker):
    # B's release of A's buffer goes first, then one of its own; once its own is gone, A's was handled
    b.release(address, a.id(1))
    b.release(address, b.id(1))
    wait_for(lambda: stub.Stats(wpb.WorkerStatsRequest(), metadata=meta(cluster), timeout=10).buffers == 1,
             30, "B's own buffer to be released")
    np.testing.assert_array_equal(fetch(stub, ma, a.id(1)), secret)
    # and no credential at all is no access
    assert code_of(lambda: stub.Fetch(wpb.FetchRequest(buffer_id=a.id(1), timeout_s=1), metadata=meta(cluster),
                                      timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    assert "Traceback" not in worker_log(cluster)
    a.close()
    b.close()


def test_a_fetch_of_a_byte_range_sends_those_bytes_and_refuses_bad_ranges(module_cluster: LocalCluster,
                                                                         shared_worker: Any) -> None:
    """The IFRT proxy streams one shard of a larger buffer as a byte range of its Fetch."""
    cluster = module_cluster
    _, _, stub, cch = shared_worker
    s = open_session(cluster, cch)
    md = meta(cluster, s)
    arr = np.arange(1000, dtype=np.int32)
    upload(stub, md, s.id(1), arr)

    def fetched(**span: Any) -> bytes:
        chunks = list(stub.Fetch(wpb.FetchRequest(buffer_id=s.id(1), timeout_s=5, **span), metadata=md, timeout=15))
        assert not any(c.error for c in chunks) and chunks[-1].last
        return b"".join(c.array.data for c in chunks)

    assert fetched(offset=40, length=400) == arr.tobytes()[40:440]
    assert fetched(offset=3600) == arr.tobytes()[3600:]  # no length: to the end
    assert fetched(length=4000) == arr.tobytes()
    for bad in ({"offset": 3000, "length": 1001}, {"offset": 4001}, {"length": 4001}):
        with pytest.raises(grpc.RpcError) as e:
            fetched(**bad)
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "of buffer" in str(e.value.details()) and "which has 4000" in str(e.value.details())
    with pytest.raises(grpc.RpcError) as e:
        fetched(offset=4, parts=True)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    np.testing.assert_array_equal(fetch(stub, md, s.id(1)), arr)  # nothing else changed
    assert "Traceback" not in worker_log(cluster)
    s.close()


def test_a_data_message_fetch_is_the_bytes_in_order_and_fails_with_a_status(module_cluster: LocalCluster,
                                                                           shared_worker: Any) -> None:
    """FetchRequest.data_messages (what the IFRT proxy forwards to its client unparsed): only
    `FetchData` messages of at most DATA_CHUNK bytes, the range's bytes in order; a buffer that
    is not there in time is the call's FAILED_PRECONDITION; another session's buffer is refused."""
    cluster = module_cluster
    _, wch, _, cch = shared_worker
    s, other = open_session(cluster, cch), open_session(cluster, cch)
    md = meta(cluster, s)
    stub = wgrpc.WorkerStub(wch)
    arr = np.arange(3 * DATA_CHUNK // 4 + 7, dtype=np.int32)  # four messages, the last 28 bytes
    upload(stub, md, s.id(1), arr)
    raw_fetch = wch.unary_stream("/pathways.v1.Worker/Fetch", request_serializer=wpb.FetchRequest.SerializeToString,
                                 response_deserializer=None)

    def fetched(buffer_id: int = s.id(1), md: Any = md, **span: Any) -> list[bytes]:
        return list(raw_fetch(wpb.FetchRequest(buffer_id=buffer_id, timeout_s=2, data_messages=True, **span),
                              metadata=md, timeout=15))

    messages = fetched()
    assert [wire.data_length(m) for m in messages] == [DATA_CHUNK] * 3 + [28]
    assert all(wpb.FetchData.FromString(m).SerializeToString() == m for m in messages)
    assert b"".join(wpb.FetchData.FromString(m).data for m in messages) == arr.tobytes()
    span = b"".join(wpb.FetchData.FromString(m).data for m in fetched(offset=DATA_CHUNK - 4, length=DATA_CHUNK + 8))
    assert span == arr.tobytes()[DATA_CHUNK - 4 : 2 * DATA_CHUNK + 4]
    with pytest.raises(grpc.RpcError) as e:
        fetched(s.id(2))  # never made: not ready within the timeout
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not ready" in str(e.value.details())
    assert code_of(lambda: fetched(md=meta(cluster, other))) == grpc.StatusCode.NOT_FOUND  # not its buffer
    assert code_of(lambda: fetched(parts=True)) == grpc.StatusCode.INVALID_ARGUMENT
    small = arr[:1000]  # the plain fetch is unchanged (one message, within this channel's 4 MiB)
    upload(stub, md, s.id(3), small)
    np.testing.assert_array_equal(fetch(stub, md, s.id(3)), small)
    assert "Traceback" not in worker_log(cluster)
    s.close()
    other.close()


def test_session_prefixes_and_client_ids_are_not_a_sequence(module_cluster: LocalCluster, shared_worker: Any) -> None:
    cluster = module_cluster
    _, _, _, cch = shared_worker
    sessions = [open_session(cluster, cch) for _ in range(6)]
    prefixes = [s.prefix for s in sessions]
    steps = {b - a for a, b in itertools.pairwise(prefixes)}
    assert len(set(prefixes)) == 6 and steps != {1}
    assert len({s.owner for s in sessions}) == 6 and all(len(s.owner) > len("client:c") + 8 for s in sessions)
    for s in sessions:
        s.close()


# ---- findings 8 and 9: status codes, and no traceback for malformed input ----

def test_malformed_requests_get_invalid_argument_and_no_traceback(
        module_cluster: LocalCluster, shared_worker: Any) -> None:
    cluster = module_cluster
    _, wch, stub, cch = shared_worker
    s = open_session(cluster, cch)
    md = meta(cluster, s)
    raw_fetch = wch.unary_stream("/pathways.v1.Worker/Fetch")
    raw_wait = wch.unary_unary("/pathways.v1.Worker/Wait")
    garbage = b"\xff\xff\xff\xff\x0f" + os.urandom(64)
    assert code_of(lambda: raw_fetch(garbage, metadata=md, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        list(raw_fetch(garbage, metadata=md, timeout=10))
    assert "malformed request: not a valid pathways.v1.FetchRequest" in (info.value.details() or "")
    assert code_of(lambda: raw_wait(garbage, metadata=md, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    bad_uploads = [
        pb.ArrayProto(dtype="no-such-dtype", shape=[1], data=b"\0" * 8),
        pb.ArrayProto(dtype="object", shape=[1], data=b"\0" * 8),
        pb.ArrayProto(dtype="float32", shape=[1000], data=b"\0" * 8),
        pb.ArrayProto(dtype="float32", shape=[-1], data=b""),
    ]
    for i, arr in enumerate(bad_uploads):
        req = wpb.PutBufferRequest(buffer_id=s.id(i + 1), array=arr)
        assert code_of(lambda r=req: stub.PutBuffers(iter([r]), metadata=md, timeout=10)) \
            == grpc.StatusCode.INVALID_ARGUMENT, arr
    assert code_of(lambda: stub.Wait(wpb.WaitRequest(buffer_ids=[s.id(1)], timeout_s=float("nan")), metadata=md,
                                     timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    # bounds: one request names at most MAX_WAIT_IDS buffers, and one owner's waits in progress too
    too_many = [s.id(100_000 + i) for i in range(MAX_WAIT_IDS + 1)]
    assert code_of(lambda: stub.Wait(wpb.WaitRequest(buffer_ids=too_many), metadata=md, timeout=30)) \
        == grpc.StatusCode.INVALID_ARGUMENT
    big = stub.Wait.future(wpb.WaitRequest(buffer_ids=too_many[:-1]), metadata=md, timeout=60)

    def small_wait() -> grpc.StatusCode:
        try:
            stub.Wait(wpb.WaitRequest(buffer_ids=[s.id(1)], timeout_s=0.1), metadata=md, timeout=10)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()

    wait_for(lambda: small_wait() == grpc.StatusCode.RESOURCE_EXHAUSTED, 30,
             "the big wait to take the owner's whole allowance")
    big.cancel()  # its allowance comes back
    wait_for(lambda: small_wait() == grpc.StatusCode.OK, 30, "a wait to be accepted again")
    # the worker is still up and serving
    upload(stub, md, s.id(50), np.ones(2))
    np.testing.assert_array_equal(fetch(stub, md, s.id(50)), np.ones(2))
    assert "Traceback" not in worker_log(cluster)
    s.close()


# ---- finding 4: a loopback worker checked no token even when its controller required one ----

@pytest.mark.cluster(islands=1, devices=1)
def test_the_worker_requires_the_token_on_loopback(cluster: LocalCluster, worker: Any) -> None:
    _, wch, stub, cch = worker
    assert cluster.token
    s = open_session(cluster, cch)
    good = meta(cluster, s)
    wrong = (("authorization", "Bearer not-the-token"), (SESSION_HEADER, s.credential))
    missing = ((SESSION_HEADER, s.credential),)
    for md in (wrong, missing):
        assert code_of(lambda m=md: stub.Stats(wpb.WorkerStatsRequest(), metadata=m, timeout=10)) \
            == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda m=md: stub.Fetch(wpb.FetchRequest(buffer_id=s.id(1), timeout_s=1), metadata=m,
                                               timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda m=md: upload(stub, m, s.id(1), np.ones(1))) == grpc.StatusCode.UNAUTHENTICATED
    # undecodable bytes with a wrong token: UNAUTHENTICATED first
    raw = wch.unary_unary("/pathways.v1.Worker/Wait")
    assert code_of(lambda: raw(b"\xff\xff\xff", metadata=wrong, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    # the token alone is not a session: no credential, no buffers
    assert code_of(lambda: upload(stub, meta(cluster), s.id(1), np.ones(1))) == grpc.StatusCode.UNAUTHENTICATED
    # the health service needs no token (probes carry none)
    health = health_pb2_grpc.HealthStub(wch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    upload(stub, good, s.id(1), np.ones(1))
    np.testing.assert_array_equal(fetch(stub, good, s.id(1)), np.ones(1))
    assert stub.Stats(wpb.WorkerStatsRequest(), metadata=good, timeout=10).buffers == 1
    s.close()


def test_a_pw_program_still_runs_end_to_end(module_cluster: LocalCluster) -> None:
    """The real client presents its credential by itself: upload, run, fetch, wait."""
    cluster = module_cluster
    code = ("import numpy as np, pwctl as pw\n"
            "d = pw.make_virtual_device_set().add_slice(devices=1).devices\n"
            "f = pw.pmap(lambda x: x * 2.0, devices=d)\n"
            "r = f(np.array([[1.0, 2.0]]))\n"
            "pw.block_until_ready(r)\n"
            "print(np.asarray(r).tolist())\n")
    out = subprocess.run([sys.executable, "-c", code], env=cluster.env(), capture_output=True, text=True,
                         timeout=90, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[[2.0, 4.0]]"



@pytest.mark.cluster(islands=1, devices=1)
def test_pwctl_worker_start_no_token_opts_out_of_the_token_only(cluster: LocalCluster) -> None:
    """`pwctl worker start --no-token` (a private machine): callers need no token, but still the
    controller's credentials; the worker registers with the token it finds."""
    r = cluster.pwctl("worker", "start", "--island", "b", "--devices", "1", "--name", "w-nt", "--no-token",
                      timeout=90)
    assert r.returncode == 0, r.stderr
    try:
        address = cluster.hosts()["w-nt"].address
        with grpc.insecure_channel(address) as ch:
            stub = wgrpc.WorkerStub(ch)
            assert stub.Stats(wpb.WorkerStatsRequest(), timeout=10).host == "w-nt"  # no token asked
            assert code_of(lambda: stub.Fetch(wpb.FetchRequest(buffer_id=1, timeout_s=1), timeout=10)) \
                == grpc.StatusCode.UNAUTHENTICATED
    finally:
        assert cluster.pwctl("worker", "stop", "w-nt").returncode == 0


def test_pwctl_up_no_token_starts_workers_that_require_no_token(pw_home: Path) -> None:
    """`pwctl up --no-token` on a machine whose data directory holds a token: its workers answer
    callers without one (they would require it otherwise, as the test above shows)."""
    token = pw_home / "token"
    token.write_text(secrets.token_urlsafe(32) + "\n")
    token.chmod(0o600)
    address = f"127.0.0.1:{free_port()}"
    env = base_env(pw_home, PWCTL_SERVER=address)
    try:
        r = run_pwctl("up", "--islands", "1", "--devices", "1", "--listen", address, "--no-token", env=env,
                      timeout=120)
        assert r.returncode == 0, r.stderr
        hosts = run_pwctl("host", "list", "-o", "json", env=env)
        (host,) = json.loads(hosts.stdout)["items"]
        with grpc.insecure_channel(host["address"]) as ch:
            assert wgrpc.WorkerStub(ch).Stats(wpb.WorkerStatsRequest(), timeout=10).host == host["name"]
        with grpc.insecure_channel(address) as ch:  # the controller too: `up --no-token` passed it on
            assert cgrpc.ControllerStub(ch).GetInfo(cpb.GetInfoRequest(), timeout=10).address == address
        (pid,) = json.loads((pw_home / "cluster.json").read_text())["worker_pids"].values()
        assert b"--no-token" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    finally:
        down = run_pwctl("down", "-y", env=env)
        assert down.returncode == 0, down.stderr


# ---- the pieces, in process ----

def test_a_wait_that_ends_leaves_nothing_and_a_settle_wakes_it_once() -> None:
    from server.worker.buffers import BufferStore

    store = BufferStore()
    woken: list[int] = []
    latches = [(i, store.watch([i], lambda i=i: woken.append(i))) for i in range(1000)]
    assert store.waiting_ids() == 1000
    for i, latch in latches[1:]:
        assert latch is not None
        store.unwatch([i], latch)  # the caller cancelled, or its wait timed out
    assert store.waiting_ids() == 1 and woken == []
    store.put(0, np.zeros(1), 8, owner="client:x", client_ref=True)  # held for its client
    store.put(0, np.ones(1), 8, owner="client:x", client_ref=True)
    assert woken == [0] and store.waiting_ids() == 0
    assert store.watch([0], lambda: woken.append(-1)) is None  # settled already: no wait at all
    # an upload may not take over another owner's buffer
    assert not store.put(0, np.ones(1), 8, owner="client:y", client_ref=True, same_owner=True)
    assert store.owner_of(0) == "client:x"


def test_credentials_bind_owner_and_prefix_and_the_key_file_is_private(tmp_path: Path) -> None:
    from server.credentials import (
        check_peer,
        check_session,
        load_or_create_key,
        peer_credential,
        session_credential,
    )

    key = load_or_create_key(tmp_path / "worker.key")
    assert (tmp_path / "worker.key").stat().st_mode & 0o777 == 0o600
    assert load_or_create_key(tmp_path / "worker.key") == key and len(key) == 32
    (tmp_path / "damaged.key").write_text("not hex\n")
    fresh = load_or_create_key(tmp_path / "damaged.key")
    assert len(fresh) == 32 and fresh != key and load_or_create_key(tmp_path / "damaged.key") == fresh
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged.key", "worker.key"]  # no temporary left
    cred = session_credential(key, "job:job-1", 77)
    caller = check_session(key, cred)
    assert caller is not None and (caller.owner, caller.prefix) == ("job:job-1", 77)
    assert caller.owns_id(77 << 40 | 5) and not caller.owns_id(78 << 40 | 5)
    other = secrets.token_bytes(32)
    for forged in (cred.replace("77|", "78|", 1), cred.replace("job-1", "job-2"),
                   cred[:-1] + ("1" if cred[-1] == "0" else "0"),  # the MAC's last digit changed
                   session_credential(other, "job:job-1", 77), "", "|||", "77|job:job-1|"):
        assert check_session(key, forged) is None, forged
    assert check_peer(key, peer_credential(key)) and not check_peer(key, peer_credential(other))
    assert not check_peer(key, cred)


def test_the_controller_refuses_runs_and_drops_releases_naming_another_sessions_ids() -> None:
    """The release path goes through the controller: a session's release or run naming ids
    outside its prefix never reaches a worker (in process, over the real session manager)."""
    from tests.test_dispatcher import events
    from tests.test_sessions import Sessions, release

    p = Sessions()
    s = p.open()  # prefix 0
    prog = p.register(s)
    foreign = 5 << 40 | 1
    for inputs, outputs in (([foreign], [201]), ([100], [foreign])):
        p.send(s, cpb.ClientMessage(run=cpb.RunProgram(run_id=7, program_id=prog.program_id, input_ids=inputs,
                                                       output_ids=outputs, input_homes=["a:1"])))
        assert p.outbox.take() == []  # nothing enqueued anywhere
        evs = events(s)
        assert evs[0] == cpb.SessionEvent(finished=cpb.RunFinished(
            run_id=7, ok=False, error=f"no buffer {foreign:#x} in this session"))
    p.send(s, release(foreign, 300))
    mine = wpb.ReleaseBuffers(buffer_ids=[300], owner=s.owner)
    assert p.outbox.take() == [("b", cpb.ControllerToWorker(release=mine))]


def test_prefixes_are_random_distinct_and_keep_ids_signed_64_bit() -> None:
    """Ids are `prefix << 40 | n` and travel as signed 64-bit integers (traces, the database):
    the prefix stays below 2**23."""
    from tests.test_sessions import Sessions

    manager = Sessions().manager
    prefixes = [manager.new_id_prefix() for _ in range(2000)]
    assert len(set(prefixes)) == 2000 and all(0 < p < 1 << 23 for p in prefixes)
    assert max(prefixes) > 1 << 20 and sorted(prefixes) != prefixes  # spread out, not a sequence


def test_the_tcp_transfer_port_takes_only_the_clusters_workers(
        module_cluster: LocalCluster, shared_worker: Any) -> None:
    """The workers' raw TCP transfer link (tcplink.py) takes the peer credential in its hello, not
    the cluster token every tenant holds: a tenant cannot plant a value in another session's
    buffer through it (nor fail one)."""
    cluster = module_cluster
    import socket
    import struct

    _, _, stub, cch = shared_worker
    a = open_session(cluster, cch)
    data_address = stub.Stats(wpb.WorkerStatsRequest(), metadata=meta(cluster, a), timeout=10).data_address
    assert data_address, "the worker serves a TCP transfer port"
    host, _, port = data_address.rpartition(":")
    planted = np.full(3, 666.0)
    secret = (cluster.token or "").encode()
    header = wpb.TransferChunk(buffer_id=a.id(2), array=pb.ArrayProto(dtype="float64", shape=[3])).SerializeToString()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(struct.pack("!4sH", b"PWH1", len(secret)) + secret)
        sock.sendall(struct.pack("!4sI", b"PWF1", len(header)) + header + planted.tobytes())
        sock.settimeout(3.0)
        try:
            closed = sock.recv(1) == b""  # refused: the worker hangs up without a word
        except ConnectionResetError:
            closed = True  # refused, with the frame still unread
        except TimeoutError:
            closed = False  # taken: the link waits for the next frame
    assert closed, "the worker kept a transfer link opened with the cluster token alone"
    mine = np.array([1.0, 2.0, 3.0])
    upload(stub, meta(cluster, a), a.id(2), mine)
    np.testing.assert_array_equal(fetch(stub, meta(cluster, a), a.id(2)), mine)
    assert "Traceback" not in worker_log(cluster)
    a.close()


def test_an_upload_that_comes_before_the_workers_registration_waits_for_it(cluster: LocalCluster) -> None:
    """A restarted worker's clients learn its address from the controller as the controller
    registers it, so their first upload can reach the worker before its Registered message does.
    It was refused at once (UNAVAILABLE), which ended the client's upload stream for good: the
    chaos run's stuck calls. It now waits for the registration (and the client opens a new
    stream when one ended, pwctl/worker_client.py), until the call's own deadline: here the
    controller comes back 6 s later (a loaded machine's restart; the worker once gave up at 5 s)."""
    import re
    import threading

    with grpc.insecure_channel(cluster.address) as cch:
        s = open_session(cluster, cch)
        cluster.stop_controller(kill=True)
        cluster.kill_worker("w-a")
        w = cluster.add_worker("a", 1, wait=False)  # serves, but cannot register: no controller
        address = wait_for(lambda: (m := re.search(r"serving at (\S+)", w.log.read_text(errors="replace")))
                           and m.group(1), 60, "the new worker serving")
        result: dict[str, Any] = {}

        def put() -> None:
            with grpc.insecure_channel(address) as wch:
                try:
                    result["reply"] = upload(wgrpc.WorkerStub(wch), meta(cluster, s), s.id(1), np.arange(3.0),
                                             timeout_s=40.0)
                except grpc.RpcError as e:
                    result["error"] = e.code()

        t = threading.Thread(target=put)
        began = time.monotonic()
        t.start()
        with grpc.insecure_channel(address) as wch:  # a call whose own deadline comes first ends at it
            code = code_of(lambda: wgrpc.WorkerStub(wch).Fetch(
                wpb.FetchRequest(buffer_id=s.id(1), timeout_s=1.0), metadata=meta(cluster, s), timeout=1.0))
            assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), code
            assert time.monotonic() - began < 5.0
        time.sleep(max(0.0, began + 6.0 - time.monotonic()))  # the upload waits while the worker has no controller
        assert t.is_alive(), result
        cluster.start_controller()
        t.join(30)
        assert result.get("reply") is not None and result["reply"].count == 1, result
        with grpc.insecure_channel(address) as wch:
            assert fetch(wgrpc.WorkerStub(wch), meta(cluster, s), s.id(1)).tolist() == [0.0, 1.0, 2.0]


def test_the_clients_uploads_go_on_after_the_worker_ended_their_stream(
        module_cluster: LocalCluster, shared_worker: Any) -> None:
    """An upload stream the worker ends (here: an upload it refuses) is opened again for the next
    upload; before, every later upload to that worker was queued behind the ended stream and never
    sent, and the runs reading them waited for them."""
    cluster = module_cluster
    from pwctl.worker_client import WorkerClient

    address, _, _, cch = shared_worker
    s = open_session(cluster, cch)
    lost: list[tuple[list[int], str]] = []
    wc = WorkerClient(address, cluster.token, s.credential,
                      on_lost=lambda uploads, error: lost.append(([u.buffer_id for u in uploads], error)))
    try:
        bad = (s.prefix ^ 1) << 40 | 5
        wc.put(bad, np.zeros(2), s.owner)  # another session's id prefix: refused, the stream ends
        assert wait_for(lambda: lost, 10, "the worker ending the stream")
        # the refused upload is given up at once, with the worker's reason, and not sent again
        assert lost == [([bad], lost[0][1])] and "not one of this session's ids" in lost[0][1], lost
        assert wc.unacknowledged() == 0
        wc.put(s.id(7), np.arange(4.0), s.owner)
        value, error = wc.fetch(s.id(7), 10.0)
        assert error == "" and value is not None and value.tolist() == [0.0, 1.0, 2.0, 3.0], error
    finally:
        wc.close()
        s.close()
