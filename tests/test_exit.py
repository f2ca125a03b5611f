"""A `pw` program's exit cannot hang on a lock that a frozen daemon thread holds.

At interpreter exit, atexit handlers (the runtime's close) run while daemon threads still run;
then finalization freezes each daemon thread where it stands, keeping any lock it held. gRPC's
call object for a stream (`_MultiThreadedRendezvous`) takes its call's lock when it is collected:
left for finalization to collect, it waited for ever on a lock held by one of gRPC's threads (or
the runtime's) frozen inside it, and the program hung after its last line (once in CI, in
test_multihost.py's PAIR). The runtime's close now ends its threads and collects the calls while
every thread still runs. tests/clients/exit_locks.py holds those locks for good at exit, in the
frozen threads' place: before the fix it hung there every time.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LocalCluster

CLIENT = Path(__file__).parent / "clients" / "exit_locks.py"
EXIT_S = 90.0  # the program takes seconds (under load, more); a hang at exit runs into this

pytestmark = [pytest.mark.timeout(240), pytest.mark.cluster(islands=1, devices=2)]


def run(cluster: LocalCluster, mode: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([sys.executable, str(CLIENT), mode], env=cluster.env(PYTHONFAULTHANDLER="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=EXIT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # where it hangs (PYTHONFAULTHANDLER)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{mode}: the program did not exit within {EXIT_S:g} s; its output:\n{out}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("mode", ["fetched", "in_flight"])
def test_a_program_exits_though_its_streams_locks_are_held_at_exit(module_cluster: LocalCluster, mode: str) -> None:
    r = run(module_cluster, mode)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    # the session's stream and the upload stream to the worker: both held after the runtime closed
    assert lines[-2:] == ["pair ok", "held 2"], r.stdout
    if mode == "in_flight":
        assert "in flight 0" not in r.stdout, r.stdout  # runs were still going at exit


def test_close_ends_its_threads_and_leaves_no_grpc_call_to_finalization(module_cluster: LocalCluster) -> None:
    r = run(module_cluster, "close")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    left = json.loads(r.stdout.splitlines()[0])
    assert left["streams"] == 2, left
    assert left["calls"] == 0, left  # none left for finalization to collect
    assert not [name for name in left["threads"] if name.startswith("pw-")], left  # the session's, the uploads'
