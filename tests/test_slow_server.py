"""A controller that is slow to answer a new connection (a loaded machine, a long pause: here
frozen with SIGSTOP for a moment) is waited for, not reported unreachable.

gRPC gives a connection attempt `grpc.min_reconnect_backoff_ms` at the least (its minimum connect
timeout). The clients set it to 200 ms, to reconnect soon after a controller restart: a server
whose handshake (TCP, TLS, HTTP/2 settings) took longer failed the attempt, and every call made
meanwhile failed UNAVAILABLE, "cannot reach the server", from a controller that was up (the CI
rehearsal at load ~10: two `pw` programs of test_programs failed so at their session's start).
Real processes: a controller and a worker (`cluster`), `pwctl` and a `pw` program as users run
them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, LocalCluster

pytestmark = [pytest.mark.timeout(120), pytest.mark.cluster(islands=1, devices=1)]

# imports first (JAX's take seconds), then connects when told to (a line on stdin): to a
# controller frozen at that moment
PROGRAM = """
import sys, numpy as np, pwctl as pw
from pwctl.client import Client
sys.stdin.readline()
print(" ".join(i.name for i in Client().islands()), flush=True)  # a unary call on a new channel
vds = pw.make_virtual_device_set()  # the session stream on another
s = vds.add_slice(devices=1)
print(np.asarray(pw.pmap(lambda v: v + 1.0, devices=s.devices)(np.zeros((1, 2), np.float32))).tolist())
"""


def test_a_controller_slow_to_answer_new_connections_is_waited_for(cluster: LocalCluster) -> None:
    c = cluster
    assert c.controller is not None
    pid = c.controller.pid
    program = subprocess.Popen([sys.executable, "-c", PROGRAM], env=c.env(), cwd=REPO, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert program.stdin is not None
    time.sleep(3)  # its imports (connecting waits for the line anyway)
    os.kill(pid, signal.SIGSTOP)  # it accepts connections (the kernel does) but answers nothing
    thaw = threading.Timer(1.5, os.kill, (pid, signal.SIGCONT))
    try:
        started = time.monotonic()
        thaw.start()
        program.stdin.write("go\n")
        program.stdin.flush()
        out, err = program.communicate(timeout=60)
        assert program.returncode == 0, err[-3000:]
        assert out.split("\n")[:2] == ["a", "[[1.0, 1.0]]"], out + err[-3000:]
        assert time.monotonic() - started >= 1.0  # (it did wait for the frozen controller)
    finally:
        thaw.cancel()
        os.kill(pid, signal.SIGCONT)
        if program.poll() is None:
            program.kill()
            program.communicate()
