"""A caller killed in the middle of any server stream ends its handler quietly: no traceback in
the server's log, and the server goes on serving (the house rule: nothing logged as a traceback
on bad input; tests/test_worker_fetch_kill.py covers the worker's `Fetch`).

gRPC's aio server logs a write that fails before it has marked the call closed by the client
(ExecuteBatchError) with a traceback; the handlers write through `rpcguard.write_or_cancel`,
which ends such a write as the cancellation it is. Real processes: a controller and a worker,
and a client process per round that opens the stream, keeps the server writing to it (it sends
requests that are answered, and stops reading), and is SIGKILLed mid-stream.

Before the fix, Session (512 KiB refusals) and StreamLogs (a 24 MiB log) logged
"ExecuteBatchError raised in core by servicer method" with a traceback in every run: their writes
were under way, held by flow control, when the caller died. Watch's and the worker's Waits and
Uploads answers are small and seldom in flight at the kill (Waits also dropped a failed write
itself): those cases guard the same path, with the server's own answers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_trust_worker import meta, open_session, upload, worker_channels, worker_log

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc
from schemas.pathways.v1 import worker_pb2 as wpb
from tests.conftest import REPO, LocalCluster

pytestmark = [pytest.mark.timeout(180), pytest.mark.cluster(islands=1, devices=1)]

ROUNDS = 8
# The caller: opens the stream `sys.argv[1]`, reads one answer, says so, goes on sending requests
# that are answered (or waits for updates) without reading them, and waits to be killed.
CALLER = """
import itertools, sys, time, grpc
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb
mode, address, metadata, name, prefix = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
md = tuple(tuple(kv.split("=", 1)) for kv in metadata.split(";") if kv)
ch = grpc.insecure_channel(address)

def forever(first, make):
    yield from first
    for i in itertools.count(1):
        yield make(i)
        if i % 32 == 0:
            time.sleep(0.001)

if mode == "Waits":
    call = ch.stream_stream("/pathways.v1.Worker/Waits", request_serializer=wpb.WaitRequest.SerializeToString)(
        forever((), lambda i: wpb.WaitRequest(buffer_ids=[int(name)], timeout_s=10, seq=i)), metadata=md)
elif mode == "Uploads":
    data = bytes(4096)
    call = ch.stream_stream("/pathways.v1.Worker/Uploads", request_serializer=wpb.PutBufferRequest.SerializeToString)(
        forever((), lambda i: wpb.PutBufferRequest(buffer_id=prefix << 40 | (1000 + i), array=pb.ArrayProto(
            dtype="uint8", shape=[4096], data=data))), metadata=md)
elif mode == "Session":  # each run refused with an answer that names its program: 512 KiB
    big = "p" * (512 << 10)
    call = ch.stream_stream("/pathways.v1.Controller/Session", request_serializer=cpb.ClientMessage.SerializeToString)(
        forever([cpb.ClientMessage(hello=cpb.Hello(client_name="killed"))],
                lambda i: cpb.ClientMessage(batch=cpb.ClientBatch(messages=[cpb.ClientMessage(run=cpb.RunProgram(
            run_id=i << 10 | j, program_id=big)) for j in range(4)]))), metadata=md)
elif mode == "Watch":
    call = ch.unary_stream("/pathways.v1.Controller/Watch", request_serializer=cpb.WatchRequest.SerializeToString)(
        cpb.WatchRequest(interval_s=0.1), metadata=md)
elif mode == "StreamLogs":
    call = ch.unary_stream("/pathways.v1.Controller/StreamLogs",
                           request_serializer=cpb.StreamLogsRequest.SerializeToString)(
        cpb.StreamLogsRequest(id=name), metadata=md)
else:
    raise SystemExit(f"unknown mode {mode}")
next(call)
print("reading", flush=True)
time.sleep(120)
"""

WORKER_STREAMS = ("Waits", "Uploads")
CONTROLLER_STREAMS = ("Session", "Watch", "StreamLogs")
# a job whose log is 24 MiB: its stream is written in chunks the killed reader leaves unread
LOUD_JOB = b"import sys\nline = 'x' * 1023 + '\\n'\nfor _ in range(24 << 10):\n    sys.stdout.write(line)\n"


def _kill_callers(mode: str, address: str, md: tuple[tuple[str, str], ...], name: str, prefix: int) -> None:
    encoded = ";".join(f"{k}={v}" for k, v in md)
    for round_ in range(ROUNDS):  # a race in gRPC: killed at several points of the stream
        proc = subprocess.Popen([sys.executable, "-c", CALLER, mode, address, encoded, name, str(prefix)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == "reading\n", proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1 + 0.1 * (round_ % 4))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)


def _loud_job(cluster: LocalCluster) -> str:
    with cluster.client() as c:
        job = c.submit_job(cpb.SubmitJobRequest(entrypoint="loud.py", script=LOUD_JOB)).id
        deadline = time.monotonic() + 60
        while c.get_job(job).state not in (cpb.JOB_STATE_SUCCEEDED, cpb.JOB_STATE_FAILED):
            assert time.monotonic() < deadline, "the loud job did not end"
            time.sleep(0.2)
        assert c.get_job(job).state == cpb.JOB_STATE_SUCCEEDED
    return job


@pytest.mark.parametrize("mode", WORKER_STREAMS + CONTROLLER_STREAMS)
def test_a_caller_killed_mid_stream_leaves_no_traceback(cluster: LocalCluster, mode: str) -> None:
    with worker_channels(cluster) as (address, _, stub, cch):
        s = open_session(cluster, cch)
        md = meta(cluster, s)
        arr = np.arange(16, dtype=np.uint8)
        upload(stub, md, s.id(1), arr)
        if mode in WORKER_STREAMS:
            _kill_callers(mode, address, md, str(s.id(1)), s.prefix)
        elif mode == "StreamLogs":
            _kill_callers(mode, cluster.address, meta(cluster), _loud_job(cluster), 0)
        else:
            _kill_callers(mode, cluster.address, meta(cluster), "", 0)
        # both still serve: a fetch from the worker, a status from the controller
        chunks = list(stub.Fetch(wpb.FetchRequest(buffer_id=s.id(1), timeout_s=10), metadata=md, timeout=30))
        assert not any(c.error for c in chunks) and chunks[0].array.data == arr.tobytes()
        watch = cgrpc.ControllerStub(cch).Watch(cpb.WatchRequest(interval_s=0.1), metadata=meta(cluster), timeout=30)
        assert next(watch).ListFields()
        watch.cancel()
        s.close()
    time.sleep(1.0)  # the last kills' handlers end on the servers' own time
    for name, log in (("worker", worker_log(cluster)), ("controller", cluster.controller_logs())):
        assert "Traceback" not in log and "ExecuteBatchError" not in log, f"{name}:\n{log[-4000:]}"
