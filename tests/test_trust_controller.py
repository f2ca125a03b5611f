"""Issue 29, the controller's side: regression tests for findings 2, 5, 8, 9 and 10, and the verbs
that remove hosts and islands (with the collection of long-lost hosts).

Each test talks to a real controller (and real workers where the finding needs one) the way a
hostile or careless caller would: raw gRPC with hand-made messages, or bytes that are no message.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import LocalCluster, base_env, free_port, run_pwctl, token_channel, wait_for

from pwctl import local
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc

pytestmark = pytest.mark.timeout(120)


class HeldStream:
    """A bidirectional call driven by hand: `message` sent, then the request side held open (for
    `timeout` s at most) until `close`."""

    def __init__(self, method: Callable[..., Any], message: Any, timeout: float, **kwargs: Any) -> None:
        self._stop = threading.Event()
        self.call = method(self._upstream(message, timeout), timeout=timeout, **kwargs)

    def _upstream(self, message: Any, timeout: float) -> Iterator[Any]:
        yield message
        self._stop.wait(timeout)

    def first(self) -> Any:
        """The controller's first answer (raises grpc.RpcError when it refused)."""
        return next(iter(self.call))

    def close(self) -> None:
        self._stop.set()
        self.call.cancel()


class RawWorker(HeldStream):
    """A WorkerConnect stream driven by hand: sends `reg`, then stays open until closed."""

    def __init__(self, address: str, reg: cpb.RegisterWorker, token: str | None = None) -> None:
        self.channel = token_channel(address, token)
        super().__init__(cgrpc.ControllerStub(self.channel).WorkerConnect, cpb.WorkerToController(register=reg), 30)

    def close(self) -> None:
        super().close()
        self.channel.close()


def registration(name: str, island: str, devices: int, credential: str = "") -> cpb.RegisterWorker:
    reg = cpb.RegisterWorker(name=name, island=island, address="127.0.0.1:1", pid=4242, device_kind="cpu",
                             device_count=devices, machine_id="test")
    if credential:
        reg.credential = credential
    return reg


def refused(cluster: LocalCluster, reg: cpb.RegisterWorker) -> grpc.RpcError:
    w = RawWorker(cluster.address, reg, cluster.token)
    try:
        with pytest.raises(grpc.RpcError) as info:
            w.first()
        return info.value
    finally:
        w.close()


def shared_cluster(islands: int, devices: int, *controller_args: str) -> Any:
    """A module-scoped cluster of this shape for the tests below that leave it as they found it
    (each keeps its own assertions; the invariant check runs when the module ends)."""

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
        with LocalCluster(tmp_path_factory.mktemp("shared-cluster"), controller_args=controller_args) as c:
            c.start([(chr(ord("a") + i), devices) for i in range(islands)])
            yield c

    return fixture


# one island: one worker of one device (the malformed requests, the unknown ids); of two devices
# (the absurd registrations, the slice owners); and one with both small limits the limit tests
# set (each test looks at its own: a worker's devices, or the sessions and watches open)
cluster_1x1 = shared_cluster(1, 1)
cluster_1x2 = shared_cluster(1, 2)
cluster_limits = shared_cluster(1, 1, "--max-devices-per-host", "1", "--max-sessions", "2", "--max-watches", "1")


def no_tracebacks(c: LocalCluster) -> None:
    logs = c.controller_logs()
    assert "Traceback" not in logs, logs[logs.find("Traceback") - 500:][:3000]


# ---- finding 2: absurd sizes ----
def test_a_worker_declaring_absurd_devices_is_refused_at_once(cluster_1x2: LocalCluster) -> None:
    """50,000 devices froze the controller for ~107 s and left an island nothing could remove;
    now: INVALID_ARGUMENT naming the limit, nothing recorded, the controller answering."""
    cluster = cluster_1x2
    start = time.monotonic()
    err = refused(cluster, registration("huge", "evil", 50_000))
    took = time.monotonic() - start
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "50000 devices, over the limit of 1024 per host" in err.details()
    assert took < 5.0, f"refused after {took:.1f} s"
    with cluster.client() as c:
        assert [i.name for i in c.islands()] == ["a"]
        assert sorted(h.name for h in c.hosts()) == ["w-a"]
    # names and other strings are bounded too; a refused registration changes nothing
    for reg, text in [
        (registration("x" * 129, "a", 1), "invalid host name"),
        (registration("bad/name", "a", 1), "invalid host name"),
        (registration("ok", "i" * 65, 1), "invalid island name"),
        (registration("ok", "a", 0), "at least one device"),
    ]:
        e = refused(cluster, reg)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and text in e.details(), (e.code(), e.details())
    assert sorted(cluster.hosts()) == ["w-a"]
    no_tracebacks(cluster)


def test_the_device_cap_is_configurable(cluster_limits: LocalCluster) -> None:
    cluster = cluster_limits
    err = refused(cluster, registration("two", "a", 2))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit of 1 per host" in err.details()


def test_open_sessions_and_watches_are_bounded(cluster_limits: LocalCluster) -> None:
    """Idle sessions and unread watch streams grew the controller from 164 MiB to 1.1 GiB."""
    cluster = cluster_limits
    channel = cluster.channel()
    stub = cgrpc.ControllerStub(channel)
    stop = threading.Event()

    def hello() -> Iterator[cpb.ClientMessage]:
        yield cpb.ClientMessage(hello=cpb.Hello(client_name="idle"))
        stop.wait(30)

    try:
        calls = [stub.Session(hello(), timeout=30) for _ in range(2)]
        for call in calls:
            assert next(iter(call)).WhichOneof("msg") == "welcome"
        with pytest.raises(grpc.RpcError) as info:
            next(iter(stub.Session(hello(), timeout=30)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 client sessions are open, the limit (the controller's --max-sessions)" in info.value.details()
        watch = stub.Watch(cpb.WatchRequest(interval_s=10), timeout=30)
        next(iter(watch))
        with pytest.raises(grpc.RpcError) as info:
            next(iter(stub.Watch(cpb.WatchRequest(interval_s=10), timeout=30)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        watch.cancel()
        calls[0].cancel()
        # closed ones free their place
        wait_for(lambda: _opens(stub, hello), 10, "a session slot to free up")
    finally:
        stop.set()
        channel.close()
    no_tracebacks(cluster)


def _opens(stub: cgrpc.ControllerStub, hello: object) -> bool:
    try:
        call = stub.Session(hello(), timeout=30)  # type: ignore[operator]
        ok = next(iter(call)).WhichOneof("msg") == "welcome"
        call.cancel()
        return ok
    except grpc.RpcError:
        return False


def test_listing_pages_are_bounded() -> None:
    from pwctl.units import parse_duration
    from server.controller.limits import MAX_PAGE, page_size

    assert page_size(0) == MAX_PAGE and page_size(10**9) == MAX_PAGE and page_size(7) == 7
    assert parse_duration("24h") == 86400 and parse_duration("90") == 90 and parse_duration("0") == 0
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration("soon")


# ---- finding 4: CreateSlice owner ----
def test_a_caller_owns_slices_only_as_its_own_session_or_job(cluster_1x2: LocalCluster) -> None:
    """`CreateSlice(owner="job:<someone else's job>")` was accepted; now only the caller's own
    session (or its job) may be named, and nothing changes otherwise."""
    cluster = cluster_1x2
    # channels of one process share a connection; another tenant's process has its own (a
    # local subchannel pool gives this test's attacker one)
    victim = cluster.channel()
    attacker = cluster.channel(options=[("grpc.use_local_subchannel_pool", 1)])
    stop = threading.Event()

    def hello() -> Iterator[cpb.ClientMessage]:
        yield cpb.ClientMessage(hello=cpb.Hello(client_name="victim"))
        stop.wait(30)

    try:
        session = cgrpc.ControllerStub(victim).Session(hello(), timeout=30)
        welcome = next(iter(session))
        assert welcome.WhichOneof("msg") == "welcome"
        own = f"client:{welcome.welcome.client_id}"
        spec = cpb.SliceSpec(devices=1)
        bad = cgrpc.ControllerStub(attacker)
        for owner in (own, "job:job-victim", "client:c1", "job:nobody"):
            with pytest.raises(grpc.RpcError) as info:
                bad.CreateSlice(cpb.CreateSliceRequest(spec=spec, owner=owner), timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, (owner, info.value.code())
            assert "a caller owns slices only as its own session or job" in info.value.details()
        with cluster.client() as c:
            assert c.slices() == []
        # the session's own connection may: the slice is the session's
        mine = cgrpc.ControllerStub(victim).CreateSlice(cpb.CreateSliceRequest(spec=spec, owner=own), timeout=10)
        assert mine.slice.owner == own
        # a named slice needs no session
        named = bad.CreateSlice(cpb.CreateSliceRequest(spec=cpb.SliceSpec(name="shared", devices=1)), timeout=10)
        assert named.slice.owner == ""
    finally:
        stop.set()
        victim.close()
        attacker.close()
    no_tracebacks(cluster)


# ---- finding 5: host-name takeover ----
@pytest.mark.cluster(islands=2, devices=2)
def test_a_live_hosts_name_is_not_taken_without_its_credential(cluster: LocalCluster) -> None:
    """A registration under a live host's name replaced it (its slice remapped, its executor
    reset); now it is ALREADY_EXISTS and the real host keeps its place."""
    before = cluster.hosts()["w-a"]
    for wrong in ("", "not-the-credential"):
        err = refused(cluster, registration("w-a", "a", 2, credential=wrong))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS, (err.code(), err.details())
        assert "host w-a is registered and ready" in err.details()
    cred_file = cluster.home / "hosts" / "w-a.credential"
    assert stat.S_IMODE(cred_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(cred_file.parent.stat().st_mode) == 0o700
    credential = cred_file.read_text().strip()
    assert len(credential) >= 40
    after = cluster.hosts()["w-a"]
    assert (after.state, after.pid, after.address, after.id) == (pb.HOST_STATE_READY, before.pid, before.address,
                                                                  before.id)
    assert "refused a registration as host w-a" in cluster.controller_logs()

    # the database keeps a digest, never the credential
    import sqlite3
    with sqlite3.connect(cluster.home / "pw.db") as db:
        (kept,) = db.execute("SELECT credential_hash FROM hosts WHERE name = 'w-a'").fetchone()
    assert kept and len(kept) == 64 and credential not in kept

    # the controller restarts: the worker proves itself and is back as the same host
    cluster.restart_controller()
    back = cluster.wait_ready(["w-a"])["w-a"]
    assert (back.id, back.pid) == (before.id, before.pid)
    assert cred_file.read_text().strip() == credential  # kept, not reissued

    # once lost, the name is anyone's: a new process takes it and gets a new credential
    cluster.kill_worker("w-b")
    cluster.wait_host_state("w-b", pb.HOST_STATE_LOST)
    w = RawWorker(cluster.address, registration("w-b", "b", 2), cluster.token)
    try:
        got = w.first()
        assert got.registered.credential and got.registered.credential != credential
    finally:
        w.close()
    no_tracebacks(cluster)


# ---- removing hosts and islands ----
@pytest.mark.cluster(islands=2, devices=2)
def test_host_and_island_delete(cluster: LocalCluster) -> None:
    r = cluster.pwctl("host", "delete", "w-b", "-y")
    assert r.returncode == 4 and "host w-b is ready: stop its worker first, or pass --force" in r.stderr, r.stderr
    r = cluster.pwctl("island", "delete", "b", "-y")
    assert r.returncode == 4 and "island b still holds host(s) w-b" in r.stderr, r.stderr
    r = cluster.pwctl("host", "delete", "nobody", "-y")
    assert r.returncode == 3 and "no host named 'nobody'" in r.stderr
    r = cluster.pwctl("host", "delete", "w-b")  # no terminal: refuses rather than deleting
    assert r.returncode == 2 and "pass -y" in r.stderr

    # a slice on the lost host's devices, degraded (nowhere to go): the host stays
    with cluster.client() as c:
        c.create_slice(cpb.SliceSpec(name="pinned", devices=2, island="b"))
    cluster.kill_worker("w-b")
    cluster.wait_host_state("w-b", pb.HOST_STATE_LOST)
    r = cluster.pwctl("host", "delete", "w-b", "-y")
    assert r.returncode == 4 and "still mapped by slice(s) pinned" in r.stderr, r.stderr
    r = cluster.pwctl("island", "delete", "b", "-y")
    assert r.returncode == 4
    assert cluster.pwctl("slice", "delete", "pinned", "-y").returncode == 0

    r = cluster.pwctl("host", "delete", "w-b", "-y")
    assert r.returncode == 0, r.stderr
    assert "w-b" not in cluster.hosts()
    assert cluster.pwctl("island", "delete", "b", "-y").returncode == 0
    with cluster.client() as c:
        assert [i.name for i in c.islands()] == ["a"]
    cluster.restart_controller()  # the deletions are in the database
    cluster.wait_ready(["w-a"])
    with cluster.client() as c:
        assert [i.name for i in c.islands()] == ["a"]
        assert [h.name for h in c.hosts()] == ["w-a"]

    # a live host with --force: lost first, then gone; its worker registers again as a new host
    before = cluster.hosts()["w-a"]
    r = cluster.pwctl("host", "delete", "w-a", "-y", "--force")
    assert r.returncode == 0, r.stderr
    again = cluster.wait_ready(["w-a"])["w-a"]
    assert again.id != before.id
    no_tracebacks(cluster)


@pytest.mark.cluster(islands=2, devices=1, controller_args=["--lost-host-ttl", "1s"])
def test_hosts_lost_longer_than_the_ttl_are_collected(cluster: LocalCluster) -> None:
    cluster.kill_worker("w-b")
    cluster.wait_host_state("w-b", pb.HOST_STATE_LOST)

    def gone() -> bool:
        with cluster.client() as c:
            return "w-b" not in {h.name for h in c.hosts()} and [i.name for i in c.islands()] == ["a"]

    wait_for(gone, 20, "the lost host and its island to be collected")
    assert "host w-b (island b) deleted: lost for more than 1 s" in cluster.controller_logs()
    assert cluster.hosts()["w-a"].state == pb.HOST_STATE_READY  # the live one stays


# ---- findings 8 and 9: malformed requests and unknown ids ----
UNARY = ["GetInfo", "Shutdown", "ListIslands", "ListHosts", "ListDevices", "DeleteHost", "DeleteIsland",
         "CreateSlice", "ListSlices", "GetSlice", "DeleteSlice", "SubmitJob", "ListJobs", "GetJob", "CancelJob",
         "GetTrace"]
SERVER_STREAMING = ["StreamLogs", "Watch"]
BIDI = ["WorkerConnect", "Session"]
GARBAGE = b"\xff\xff\xff\xff\x0f\x08garbage"


def test_malformed_requests_are_invalid_argument_without_tracebacks(cluster_1x1: LocalCluster) -> None:
    cluster = cluster_1x1
    channel = cluster.channel()
    try:
        for method in UNARY:
            call = channel.unary_unary(f"/pathways.v1.Controller/{method}")
            with pytest.raises(grpc.RpcError) as info:
                call(GARBAGE, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value.code())
            assert "malformed request: not a valid pathways.v1." in info.value.details()
        for method in SERVER_STREAMING:
            stream = channel.unary_stream(f"/pathways.v1.Controller/{method}")
            with pytest.raises(grpc.RpcError) as info:
                list(stream(GARBAGE, timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value.code())
        for method in BIDI:
            bidi = channel.stream_stream(f"/pathways.v1.Controller/{method}")
            with pytest.raises(grpc.RpcError) as info:
                list(bidi(iter([GARBAGE]), timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value.code())
        # many more: the log stays short (rate-limited warnings, no tracebacks)
        get_info = channel.unary_unary("/pathways.v1.Controller/GetInfo")
        for _ in range(300):
            with pytest.raises(grpc.RpcError):
                get_info(GARBAGE, timeout=10)
    finally:
        channel.close()
    with cluster.client() as c:
        assert c.info().hosts == 1  # still up, nothing changed
    no_tracebacks(cluster)
    warnings = [ln for ln in cluster.controller_logs().splitlines() if "malformed request" in ln]
    assert len(warnings) < 40, len(warnings)


def test_unknown_ids_are_not_found(cluster_1x1: LocalCluster) -> None:
    cluster = cluster_1x1
    stub = cgrpc.ControllerStub(cluster.channel())
    calls = {
        "StreamLogs": lambda: list(stub.StreamLogs(cpb.StreamLogsRequest(id="job-nope"), timeout=10)),
        "GetJob": lambda: stub.GetJob(cpb.GetJobRequest(id="job-nope"), timeout=10),
        "CancelJob": lambda: stub.CancelJob(cpb.CancelJobRequest(id="job-nope"), timeout=10),
        "GetSlice": lambda: stub.GetSlice(cpb.GetSliceRequest(name="nope"), timeout=10),
        "DeleteHost": lambda: stub.DeleteHost(cpb.DeleteHostRequest(name="nope"), timeout=10),
        "DeleteIsland": lambda: stub.DeleteIsland(cpb.DeleteIslandRequest(name="nope"), timeout=10),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, (name, info.value.code(), info.value.details())
    no_tracebacks(cluster)


# ---- finding 10: file modes ----
def test_data_directory_database_and_logs_are_private(pw_home: Path) -> None:
    """The data directory was 0755 and the database and logs 0644 (the token 0600)."""
    os.chmod(pw_home, 0o755)  # as an older version left it: tightened when used
    address = f"127.0.0.1:{free_port()}"
    env = base_env(pw_home, PWCTL_SERVER=address)
    db = pw_home / "pw.db"
    try:
        r = run_pwctl("server", "start", "--listen", address, "--db", f"sqlite:///{db}", env=env)
        assert r.returncode == 0, r.stderr
        assert stat.S_IMODE(pw_home.stat().st_mode) == 0o700
        assert stat.S_IMODE(db.stat().st_mode) == 0o600
        assert stat.S_IMODE((pw_home / "server.log").stat().st_mode) == 0o600
    finally:
        if run_pwctl("server", "stop", env=env).returncode != 0:
            local.stop_controller(timeout=2.0)


def test_a_session_that_never_reads_ends_instead_of_growing() -> None:
    """Events for a client that does not read them are bounded (client_session.MAX_QUEUED)."""
    from server.controller.client_session import MAX_QUEUED, ClientSession

    s = ClientSession(client_id="c1", id_prefix=1, name="idle", job_id="", priority=0, weight=1.0, sequential=False)
    for i in range(MAX_QUEUED + 500):
        s.run_failed(i, "x")
    assert s.overflowed and s.queue.qsize() == MAX_QUEUED + 2
    items = [s.queue.get_nowait() for _ in range(s.queue.qsize())]
    assert items[-1] is None
    last = items[-2]
    assert last is not None and "events unread: the controller ended it" in last.error
