"""A caller killed in the middle of a worker's `Fetch` stream ends the handler quietly (issue 28,
the chaos full run of seed 31: the worker logged gRPC's traceback for such a fetch).

Why it logged: gRPC's aio server writes an async generator handler's messages itself; when a write
fails because the caller's connection is gone before gRPC has marked the call closed by the client,
its `_handle_exceptions` logs the write's ExecuteBatchError with `_LOGGER.exception` (a traceback).
A handler that writes with `context.write` can end such a write as the cancellation it is
(server/worker/handlers.py `server_stream`). Real processes throughout: a controller and a worker,
a client process that starts a 32 MiB fetch and is SIGKILLed mid-stream, several times over."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_trust_worker import meta, open_session, upload, worker_channels, worker_log

from schemas.pathways.v1 import worker_pb2 as wpb
from tests.conftest import REPO, LocalCluster

pytestmark = [pytest.mark.timeout(180), pytest.mark.cluster(islands=1, devices=1)]

MIB = 1 << 20
# The caller: starts a fetch (its messages taken as bytes: FetchChunks, or data messages), reads
# `sys.argv[4]` of them, says so, and waits to be killed.
FETCHER = """
import sys, time, grpc
from schemas.pathways.v1 import worker_pb2 as wpb
address, buffer_id, metadata, reads, data_messages = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \\
    sys.argv[5] == "1"
md = tuple(tuple(kv.split("=", 1)) for kv in metadata.split(";") if kv)
ch = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
fetch = ch.unary_stream("/pathways.v1.Worker/Fetch", request_serializer=wpb.FetchRequest.SerializeToString)
call = fetch(wpb.FetchRequest(buffer_id=buffer_id, timeout_s=10, data_messages=data_messages), metadata=md)
for _ in range(reads):
    next(call)
print("reading", flush=True)
time.sleep(120)
"""


def test_a_fetching_caller_killed_mid_stream_leaves_no_traceback(cluster: LocalCluster) -> None:
    with worker_channels(cluster) as (address, _, stub, cch):
        s = open_session(cluster, cch)
        md = meta(cluster, s)
        arr = np.random.default_rng(0).integers(0, 255, 32 * MIB, dtype=np.uint8)
        upload(stub, md, s.id(1), arr, timeout_s=60)
        encoded = ";".join(f"{k}={v}" for k, v in md)
        for round_ in range(12):  # a race in gRPC: killed at several points of the stream
            reads, data_messages = (0, 1, 3)[round_ % 3], round_ % 2
            proc = subprocess.Popen([sys.executable, "-c", FETCHER, address, str(s.id(1)), encoded, str(reads),
                                     str(data_messages)], cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            try:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                assert line == "reading\n", proc.stderr.read() if proc.stderr else ""
                time.sleep(0.05 * (round_ % 4))
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
        # the worker still serves: a range of the buffer, to a caller that reads it
        chunks = list(stub.Fetch(wpb.FetchRequest(buffer_id=s.id(1), timeout_s=10, offset=MIB, length=MIB),
                                 metadata=md, timeout=60))
        got = b"".join(c.array.data for c in chunks)
        assert not any(c.error for c in chunks) and got == arr.tobytes()[MIB : 2 * MIB]
        s.close()
    time.sleep(1.0)  # the last kills' handlers end on the worker's own time
    log = worker_log(cluster)
    assert "Traceback" not in log and "ExecuteBatchError" not in log, log[-4000:]
