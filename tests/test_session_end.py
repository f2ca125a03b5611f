"""A `pw` program whose controller went away says so in one line, and exits quietly.

The controller stops (SIGTERM: it tells its sessions it is shutting down) while a `pw` program
lives; the program's session thread starts resuming the session (it logs one line), and the
program exits right then. Closing at exit closes the runtime's channel under the resuming thread,
whose next call failed ("ValueError: Cannot invoke RPC: Channel closed!"): the thread died with a
traceback of two chained exceptions on the program's stderr. Now the thread ends quietly once the
runtime is closed, whatever it was doing, and the exit status is the program's.

Real processes: a controller and one worker, the program in its own process. It exits as soon as
the test reads the line: within the first second of resuming, while the thread waits for the old
stream's sender (sender.py `next_stream`), before it opens a new stream on the closed channel.
"""

from __future__ import annotations

import select
import signal
import subprocess
import sys
from typing import IO

import pytest

from tests.conftest import REPO, LocalCluster

pytestmark = [pytest.mark.timeout(120), pytest.mark.cluster(islands=1, devices=1)]

PROGRAM = """\
import sys, time
import numpy as np
import pwctl as pw
from pwctl.api.runtime import Runtime

s = pw.make_virtual_device_set().add_slice(devices=1)
f = pw.jit(lambda x: x + 1.0, mesh=s.mesh("x"))
assert np.asarray(f(np.zeros(2))).tolist() == [1.0, 1.0]
rt = Runtime.get()
while rt.in_flight():  # (closing then has no run to wait for: it closes at once)
    time.sleep(0.01)
print("ready", flush=True)
sys.stdin.readline()
sys.exit(int(sys.argv[1]))
"""


def _line(stream: IO[str], proc: subprocess.Popen[str], timeout: float) -> str:
    """The next line of `stream` (a pipe of `proc`), waited for up to `timeout` s."""
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, f"nothing within {timeout:g} s (exit status {proc.poll()})"
    return stream.readline()


@pytest.mark.parametrize("status", [0, 3])
def test_a_program_exiting_while_its_session_resumes_says_one_line_and_no_traceback(
        cluster: LocalCluster, status: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM, str(status)], env=cluster.env(), cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=1)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        assert _line(proc.stdout, proc, 90).strip() == "ready", proc.communicate(timeout=30)[1][-3000:]
        assert cluster.controller is not None
        cluster.controller.send_signal(signal.SIGTERM)  # "the controller is shutting down"
        lost = _line(proc.stderr, proc, 30)
        proc.stdin.write("\n")  # exits now: the session thread is resuming
        proc.stdin.flush()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    cluster.stop_controller()
    assert lost.startswith(f"lost the session with the server at {cluster.address} (the controller is shutting "
                           "down); resuming it"), lost + err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert err.strip() == "", err  # the one line above, nothing after it
    assert proc.returncode == status, err


CLOSED = """\
import numpy as np
import pwctl as pw
from pwctl.api.runtime import Runtime

s = pw.make_virtual_device_set().add_slice(devices=1)
f = pw.jit(lambda x: x + 1.0, mesh=s.mesh("x"))
y = f(np.zeros(2))
rt = Runtime.get()
rt.close()
try:
    y.result()
    print("fetched")
except pw.PathwaysError as e:
    print(f"{type(e).__name__}: {e}")
"""


def test_a_future_of_a_closed_runtime_says_so_in_one_line(cluster: LocalCluster) -> None:
    """A runtime opens no worker connection once closed (its session thread, resuming, asks for
    one: close() would not close it): a call on a closed runtime's future says it is closed."""
    r = subprocess.run([sys.executable, "-c", CLOSED], env=cluster.env(), cwd=REPO, capture_output=True, text=True,
                       timeout=90)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stdout == (f"ConnectionFailed: the pw runtime's session with the server at {cluster.address} is "
                        "closed\n"), r.stdout + r.stderr[-3000:]
