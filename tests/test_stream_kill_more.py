"""A caller killed mid-stream, for the server streams tests/test_stream_kill.py leaves out: the
standard health service's `Watch` (on the controller and on a worker), the controller's
`WorkerConnect` (a raw worker that registers, is sent more than it reads, and is SIGKILLed) and
the IFRT proxy's `IfrtSession` (a raw proxy client that keeps asking for 20 KB answers it never
reads). Real processes throughout; each round kills a fresh caller process, and then the servers'
logs must hold no traceback and the servers must still serve.

What each case can catch: `WorkerConnect`'s and `IfrtSession`'s writes are in flight, held by flow
control, when the caller dies, so a write that fails before gRPC marks the call closed by the
client reaches the handler (the path `rpcguard.write_or_cancel` ends as a cancellation). Health's
`Watch` writes only when the status changes, so its handler is waiting, not writing, at the kill:
that case checks the cancellation of a waiting handler (grpc_health's own code) stays quiet.
Without rpcguard.write_or_cancel, WorkerConnect's case logs gRPC's ExecuteBatchError traceback;
IfrtSession's caught a session whose close was cut short (its test). Last, the one such record
no handler can prevent, a final status sent after the caller died, is one INFO line
(rpcguard.FinalStatusFilter, docs/architecture.md "Callers that die mid-call")."""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from test_trust_worker import meta, open_session, worker_log

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc
from server import rpcguard
from tests.conftest import REPO, LocalCluster, wait_for

pytestmark = [pytest.mark.timeout(120), pytest.mark.cluster(islands=1, devices=1)]

ROUNDS = 8
# The caller: opens the stream `sys.argv[1]` at `sys.argv[2]`, reads its first answer, says so,
# goes on asking (IfrtSession) or waits, never reading again, and waits to be killed.
CALLER = """
import sys, time, grpc
mode, address, token, arg = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
md = (("authorization", "Bearer " + token),) if token else ()
ch = grpc.insecure_channel(address)
if mode == "Health":
    from grpc_health.v1 import health_pb2 as hpb
    call = ch.unary_stream("/grpc.health.v1.Health/Watch", request_serializer=hpb.HealthCheckRequest.SerializeToString,
                           response_deserializer=hpb.HealthCheckResponse.FromString)(hpb.HealthCheckRequest(service=arg))
    assert next(call).status == hpb.HealthCheckResponse.SERVING
elif mode == "WorkerConnect":  # arg: the host's name and address
    from schemas.pathways.v1 import controller_pb2 as cpb
    name, at = arg.split(",")
    reg = cpb.RegisterWorker(name=name, island="killed", address=at, pid=4242, device_kind="cpu", device_count=1,
                             machine_id="killed")
    def upstream():
        yield cpb.WorkerToController(register=reg)
        time.sleep(120)
    call = ch.stream_stream("/pathways.v1.Controller/WorkerConnect",
                            request_serializer=cpb.WorkerToController.SerializeToString,
                            response_deserializer=cpb.ControllerToWorker.FromString)(upstream(), metadata=md)
    assert next(call).WhichOneof("msg") == "registered"
elif mode == "IfrtSession":  # GetDefaultLayout of 4096 dimensions, forever: 20 KB answers
    import itertools
    from server.proxy import protocol as proto_mod
    from server.proxy.service import DEVICES_KEY, TOKEN_KEY
    P = proto_mod.protocol()
    meta = P.GrpcIfrtSessionMetadata()
    meta.version.protocol_version = proto_mod.MAX_PROTOCOL_VERSION
    meta.initialization_data.attributes[DEVICES_KEY].int64_value = 1
    if token:
        meta.initialization_data.attributes[TOKEN_KEY].string_value = token.encode()
    def requests():
        for op in itertools.count(1):
            req = P.IfrtRequest()
            req.request_metadata.op_id = op
            if op == 1:
                req.init_request.SetInParent()
            else:
                req.get_default_layout_request.dims.extend(range(4096))
            yield req.SerializeToString()
            if op % 32 == 0:
                time.sleep(0.001)
    call = ch.stream_stream("/" + proto_mod.SERVICE_NAME + "/IfrtSession")(
        requests(), metadata=[(proto_mod.SESSION_METADATA_HEADER, meta.SerializeToString())])
    status = P.IfrtResponse.FromString(next(call)).response_metadata.status
    assert status.code == 0, status.message
else:
    raise SystemExit(f"unknown mode {mode}")
print("reading", flush=True)
time.sleep(120)
"""


def kill_callers(mode: str, address: str, token: str, arg: Callable[[int], str],
                 flood: Callable[[int, threading.Event], None] | None = None) -> None:
    """ROUNDS callers of `mode`, each SIGKILLed 0.1-0.4 s after its first answer (a race in gRPC:
    killed at several points of the stream); `flood(round, stop)` runs in a thread from the first
    answer until `stop` is set, after the kill."""
    for round_ in range(ROUNDS):
        proc = subprocess.Popen([sys.executable, "-c", CALLER, mode, address, token, arg(round_)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stop = threading.Event()
        thread = threading.Thread(target=flood, args=(round_, stop)) if flood is not None else None
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == "reading\n", proc.stderr.read() if proc.stderr else ""
            if thread is not None:
                thread.start()
            time.sleep(0.1 + 0.1 * (round_ % 4))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            stop.set()
            if thread is not None and thread.is_alive():
                thread.join(timeout=30)


def no_tracebacks(cluster: LocalCluster) -> None:
    time.sleep(1.0)  # the last kill's handler ends on the server's own time
    for name, log in (("worker", worker_log(cluster)), ("controller", cluster.controller_logs())):
        assert "Traceback" not in log and "ExecuteBatchError" not in log, f"{name}:\n{log[-4000:]}"


def still_serves(cluster: LocalCluster) -> None:
    """The controller answers a Watch (its token and guard in the path), and its worker is ready."""
    with grpc.insecure_channel(cluster.address) as ch:
        watch = cgrpc.ControllerStub(ch).Watch(cpb.WatchRequest(interval_s=0.1), metadata=meta(cluster), timeout=30)
        assert next(watch).ListFields()
        watch.cancel()
    assert cluster.hosts()["w-a"].state == pb.HOST_STATE_READY


@pytest.mark.parametrize("server", ["controller", "worker"])
def test_a_health_watcher_killed_mid_stream_leaves_no_traceback(cluster: LocalCluster, server: str) -> None:
    address = cluster.address if server == "controller" else cluster.hosts()["w-a"].address
    kill_callers("Health", address, "", lambda _: "")  # no token: the health service needs none
    kill_callers("Health", address, "", lambda _: "pathways.v1.Controller" if server == "controller"
                 else "pathways.v1.Worker")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert got.status == health_pb2.HealthCheckResponse.SERVING
    still_serves(cluster)
    no_tracebacks(cluster)


def test_a_worker_killed_mid_stream_leaves_no_traceback(cluster: LocalCluster) -> None:
    """A raw worker registers (a host of its own, on island `killed`), and a session sends it
    releases of 5,000 ids (45 KB each), one every 5 ms, that it never reads: the controller is
    writing on its WorkerConnect stream, held by flow control, when it is killed."""
    with grpc.insecure_channel(cluster.address) as cch:
        s = open_session(cluster, cch)
        ids = [s.id(i) for i in range(1, 50_001)]

        def flood(round_: int, stop: threading.Event) -> None:
            while not stop.wait(0.01):
                s.release(f"127.0.0.1:{round_ + 1}", *ids)

        kill_callers("WorkerConnect", cluster.address, cluster.token or "",
                     lambda r: f"killed-{r},127.0.0.1:{r + 1}", flood)
        s.close()
    # each killed worker's stream ended: its host is no longer ready
    wait_for(lambda: all(h.state != pb.HOST_STATE_READY for n, h in cluster.hosts().items() if n != "w-a"),
             30, "the killed workers' hosts to leave READY")
    assert len(cluster.hosts()) == ROUNDS + 1
    still_serves(cluster)
    no_tracebacks(cluster)


def test_a_proxy_client_killed_mid_session_leaves_no_traceback(cluster: LocalCluster) -> None:
    """The session's answer writer fails as the caller dies and cancels the session's reader; that
    cancel came after gRPC's own, in the middle of the session's close (its cluster session, the
    owner's buffers and slice), in about half of the rounds: every session must close in full."""
    kill_callers("IfrtSession", cluster.address, cluster.token or "", lambda _: "")

    def sessions(what: str) -> set[str]:
        return set(re.findall(rf"proxy: session ([0-9a-f]+) {what}", cluster.controller_logs()))

    wait_for(lambda: len(sessions("opened")) == ROUNDS and sessions("closed") == sessions("opened"), 30,
             "every killed proxy session to close in full")
    still_serves(cluster)
    no_tracebacks(cluster)


def _grpc_logs(caplog: pytest.LogCaptureFixture, ops: tuple[object, ...] | None,
               start_error: int = 0) -> logging.LogRecord:
    """What grpc.aio's `_handle_exceptions` logs for a failed batch of `ops` (its own call, on its
    own logger, with a real ExecuteBatchError worded as core's callback words it), as captured."""
    from grpc._cython import cygrpc

    text = f"Failed grpc_call_start_batch: {start_error}" if ops is None else f'Failed "execute_batch": {ops}'
    try:
        raise cygrpc.ExecuteBatchError(text)
    except cygrpc.ExecuteBatchError:
        method = "/pathways.v1.Controller/StreamLogs"  # formatted before logging, as gRPC does
        logging.getLogger(rpcguard.GRPC_LOGGER).exception(
            f"ExecuteBatchError raised in core by servicer method [{method}]")
    return caplog.records[-1]


def test_a_final_status_the_caller_did_not_live_to_see_is_one_line_and_nothing_else_is(
        caplog: pytest.LogCaptureFixture) -> None:
    from grpc._cython import cygrpc

    status = cygrpc.SendStatusFromServerOperation((), cygrpc.StatusCode.ok, "", 0)
    message = cygrpc.SendMessageOperation(b"x", 0)
    metadata = cygrpc.SendInitialMetadataOperation((), 0)
    rpcguard.quiet_final_status()
    rpcguard.quiet_final_status()  # once per process, however often called
    logger = logging.getLogger(rpcguard.GRPC_LOGGER)
    try:
        assert sum(isinstance(f, rpcguard.FinalStatusFilter) for f in logger.filters) == 1
        with caplog.at_level(logging.INFO, rpcguard.GRPC_LOGGER):
            # a stream's final status; a unary call's answer with its status (and metadata)
            for ops in ((status,), (message, status), (metadata, message, status)):
                r = _grpc_logs(caplog, ops)
                assert (r.levelno, r.exc_info) == (logging.INFO, None)
                assert r.getMessage() == ("/pathways.v1.Controller/StreamLogs: final status not sent, "
                                          "the call ended first (its caller gone)")
            # a message write (the handler's to end) and a batch core refused (a bug) stay errors
            for ops, start_error in (((message,), 0), (None, 8)):
                r = _grpc_logs(caplog, ops, start_error)
                assert r.levelno == logging.ERROR and r.exc_info is not None
                assert r.getMessage().startswith("ExecuteBatchError raised in core by servicer method")
    finally:
        for f in [f for f in logger.filters if isinstance(f, rpcguard.FinalStatusFilter)]:
            logger.removeFilter(f)


@pytest.mark.parametrize("client", ["killed", "connected"])
def test_a_controller_stopping_waits_for_proxy_sessions_to_close(cluster: LocalCluster, client: str) -> None:
    """A proxy client killed just before the controller is told to stop (its session's close is
    then under way, in a task nothing awaits), or one still connected (the server's stop cancels
    its stream): the orderly stop waits for the close before it closes the database and the
    worker links, so the log has the session's close line and no error."""
    proc = subprocess.Popen([sys.executable, "-c", CALLER, "IfrtSession", cluster.address, cluster.token or "", ""],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "reading\n", proc.stderr.read() if proc.stderr else ""
        if client == "killed":
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        cluster.stop_controller()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert cluster.controller is not None and cluster.controller.returncode == 0
    logs = cluster.controller_logs()
    opened = re.findall(r"proxy: session ([0-9a-f]+) opened", logs)
    assert len(opened) == 1, logs[-4000:]
    assert f"proxy: session {opened[0]} closed" in logs, logs[-4000:]
    assert "Traceback" not in logs and " ERROR " not in logs, logs[-4000:]
