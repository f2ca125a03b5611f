"""The client's transport layer: typed errors that keep the status, retries for reads only, and
no raw `grpc.RpcError` reaching a caller, on the controller's calls, the session stream and the
worker service.

Status mapping and retries run against in-process gRPC servers whose handlers fail on purpose
(the only way to get every status code on demand); the rest against a real local cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from pwctl.client import Client
from pwctl.errors import (
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    EXIT_REJECTED,
    EXIT_USAGE,
    AlreadyExists,
    ConnectionFailed,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PathwaysError,
    PermissionDenied,
    Rejected,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    exit_code_for,
)
from pwctl.transport import RetryPolicy
from pwctl.worker_client import WorkerClient
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
from tests.conftest import REPO, LocalCluster, free_port

S = grpc.StatusCode

# status code -> (typed error, exit code of pwctl)
EXPECTED: dict[grpc.StatusCode, tuple[type[PathwaysError], int]] = {
    S.INVALID_ARGUMENT: (InvalidArgument, EXIT_USAGE),
    S.NOT_FOUND: (NotFound, EXIT_NOT_FOUND),
    S.ALREADY_EXISTS: (AlreadyExists, EXIT_REJECTED),
    S.RESOURCE_EXHAUSTED: (ResourceExhausted, EXIT_REJECTED),
    S.FAILED_PRECONDITION: (FailedPrecondition, EXIT_REJECTED),
    S.PERMISSION_DENIED: (PermissionDenied, EXIT_REJECTED),
    S.UNAUTHENTICATED: (Unauthenticated, EXIT_REJECTED),
    S.UNAVAILABLE: (Unavailable, EXIT_FAILED),
    S.DEADLINE_EXCEEDED: (DeadlineExceeded, EXIT_FAILED),
    S.INTERNAL: (PathwaysError, EXIT_FAILED),
}


class FailingController(cgrpc.ControllerServicer):
    """GetSlice fails with the status its request names; ListIslands fails UNAVAILABLE
    `unavailable` times, then answers; CreateSlice and Session always fail UNAVAILABLE."""

    def __init__(self, unavailable: int = 0) -> None:
        self.unavailable = unavailable
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def _count(self, name: str) -> int:
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            return self.calls[name]

    def GetSlice(self, request: cpb.GetSliceRequest, context: grpc.ServicerContext) -> cpb.Slice:
        self._count("GetSlice")
        context.abort(S[request.name], f"refused {request.name.lower()}")

    def ListIslands(self, request: cpb.ListIslandsRequest, context: grpc.ServicerContext) -> cpb.ListIslandsResponse:
        if self._count("ListIslands") <= self.unavailable:
            context.abort(S.UNAVAILABLE, "restarting")
        return cpb.ListIslandsResponse()

    def CreateSlice(self, request: cpb.CreateSliceRequest, context: grpc.ServicerContext) -> cpb.CreateSliceResponse:
        self._count("CreateSlice")
        context.abort(S.UNAVAILABLE, "restarting")

    def Session(self, request_iterator: Iterator[cpb.ClientMessage],
                context: grpc.ServicerContext) -> Iterator[cpb.SessionEvent]:
        self._count("Session")
        context.abort(S.PERMISSION_DENIED, "not your session")
        yield cpb.SessionEvent()  # never reached: makes this a generator, as a streaming handler is


class FailingWorker(wgrpc.WorkerServicer):
    """Wait fails RESOURCE_EXHAUSTED, Fetch PERMISSION_DENIED (neither is a lost worker)."""

    def Wait(self, request: wpb.WaitRequest, context: grpc.ServicerContext) -> wpb.WaitReply:
        context.abort(S.RESOURCE_EXHAUSTED, "too many waiters")

    def Fetch(self, request: wpb.FetchRequest, context: grpc.ServicerContext) -> Iterator[wpb.FetchChunk]:
        context.abort(S.PERMISSION_DENIED, "not your buffer")
        yield wpb.FetchChunk()


@pytest.fixture
def serve() -> Iterator[object]:
    """`serve(controller=..., worker=...)` starts an in-process gRPC server; returns its address."""
    servers: list[grpc.Server] = []

    def start(controller: cgrpc.ControllerServicer | None = None,
              worker: wgrpc.WorkerServicer | None = None) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        if controller is not None:
            cgrpc.add_ControllerServicer_to_server(controller, server)
        if worker is not None:
            wgrpc.add_WorkerServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(grace=None)


def test_every_status_code_becomes_its_typed_error_with_code_details_and_exit_code(serve) -> None:
    address = serve(controller=FailingController())
    with Client(server=address, token="t", timeout=5.0) as c:
        for code, (cls, exit_code) in EXPECTED.items():
            with pytest.raises(PathwaysError) as info:
                c.get_slice(code.name)
            err = info.value
            assert type(err) is cls, (code, type(err))
            assert err.code == code and err.details == f"refused {code.name.lower()}"
            assert err.exit_code == exit_code_for(err) == exit_code
    # the base classes callers already catch still catch the new ones
    assert issubclass(AlreadyExists, Rejected) and issubclass(Unauthenticated, Rejected)
    assert issubclass(Unavailable, ConnectionFailed) and issubclass(DeadlineExceeded, ConnectionFailed)


def test_reads_are_retried_while_unavailable_writes_never(serve) -> None:
    ctl = FailingController(unavailable=2)
    address = serve(controller=ctl)
    with Client(server=address, timeout=10.0) as c:
        assert c.islands() == []  # two UNAVAILABLE, then the answer
        assert ctl.calls["ListIslands"] == 3
        with pytest.raises(Unavailable) as info:
            c.create_slice(cpb.SliceSpec(name="s", devices=1))
        assert ctl.calls["CreateSlice"] == 1  # a lost reply must not create it twice
        assert "cannot reach the server" in str(info.value) and info.value.details == "restarting"
        with pytest.raises(NotFound):  # only UNAVAILABLE is retried
            c.get_slice("NOT_FOUND")
        assert ctl.calls["GetSlice"] == 1

    ctl = FailingController(unavailable=100)
    address = serve(controller=ctl)
    with Client(server=address, timeout=10.0, retry=RetryPolicy(max_attempts=4, initial_backoff_s=0.01)) as c:
        with pytest.raises(Unavailable):
            c.islands()
        assert ctl.calls["ListIslands"] == 4  # then it gives up


def test_the_session_stream_fails_with_a_typed_error(serve) -> None:
    address = serve(controller=FailingController())
    with Client(server=address, timeout=5.0) as c:
        stream = c.session(iter([cpb.ClientMessage(hello=cpb.Hello(client_name="t"))]))
        with pytest.raises(PermissionDenied) as info:
            list(stream)
        assert info.value.code == S.PERMISSION_DENIED and info.value.details == "not your session"


def test_worker_calls_raise_typed_errors_and_report_a_lost_worker(serve) -> None:
    worker = WorkerClient(serve(worker=FailingWorker()), token=None)
    try:
        with pytest.raises(ResourceExhausted) as info:
            worker.wait([1, 2], timeout_s=1.0)
        assert info.value.details == "too many waiters"
        with pytest.raises(PermissionDenied):
            worker.fetch(1, timeout_s=1.0)
    finally:
        worker.close()

    gone = WorkerClient(f"127.0.0.1:{free_port()}", token=None)  # nothing listens there
    try:
        ready, error = gone.wait([1], timeout_s=1.0)
        assert not ready and error.startswith("cannot reach the worker at 127.0.0.1:")
        value, error = gone.fetch(1, timeout_s=1.0)
        assert value is None and "(host lost?)" in error
    finally:
        gone.close()


def test_a_real_cluster_answers_with_typed_errors(module_cluster: LocalCluster) -> None:
    with module_cluster.client() as c:
        with pytest.raises(NotFound) as nf:
            c.get_slice("nope")
        assert nf.value.code == S.NOT_FOUND and "nope" in nf.value.details
        c.create_slice(cpb.SliceSpec(name="twice", devices=1))
        try:
            with pytest.raises(AlreadyExists) as ae:
                c.create_slice(cpb.SliceSpec(name="twice", devices=1))
            assert ae.value.exit_code == EXIT_REJECTED
            with pytest.raises(ResourceExhausted):
                c.create_slice(cpb.SliceSpec(name="huge", devices=1000))
        finally:
            c.delete_slice("twice", force=True)
    # a worker call the server does not serve (the controller has no worker service): typed too
    not_a_worker = WorkerClient(module_cluster.address, token=module_cluster.token)
    try:
        with pytest.raises(PathwaysError) as info:
            not_a_worker.wait([1], timeout_s=1.0)
        assert info.value.code == S.UNIMPLEMENTED
    finally:
        not_a_worker.close()


REGISTER_SPY = textwrap.dedent("""
    import json
    import numpy as np
    import pwctl as pw
    from pwctl.api.registration import Registrations

    sent = []  # per register message: how many functions carried their bytes
    register_once = Registrations.register_once

    def spy(self, graph, infos):
        sent.append(sum(1 for i in infos if i.exported))
        return register_once(self, graph, infos)

    Registrations.register_once = spy
    s = pw.make_virtual_device_set().add_slice(devices=1)
    double = pw.pmap(lambda x: x * 2.0, devices=s.devices)
    first = np.asarray(double(np.array([1.0]))).tolist()
    after_first = list(sent)

    @pw.program
    def twice(x):
        return double(double(x))

    second = np.asarray(twice(np.array([1.0]))).tolist()
    print(json.dumps({"first": first, "second": second, "after_first": after_first, "sent": sent}))
""")


def test_a_function_registers_in_one_round_trip_and_goes_by_id_afterwards(module_cluster: LocalCluster) -> None:
    r = subprocess.run([sys.executable, "-c", REGISTER_SPY], env=module_cluster.env(), cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["first"] == [2.0] and out["second"] == [4.0]
    assert out["after_first"] == [1]  # one message, the bytes in it: no "missing" round trip
    assert out["sent"] == [1, 0]  # the program reuses the function: its id alone
