"""A controller restart ends no `pw` session and no job (issue 29, finding 11).

A real local cluster; a `pw` program runs a loop of jitted calls while the controller is killed
(SIGKILL) or stopped, and started again on the same port and database. The program's session
resumes (same client id, slice and buffers), calls made while the controller was away wait, a
call in flight at the crash either completes or fails naming the restart, and the program ends
with the right result. A job submitted with `pwctl submit` whose driver makes `pw` calls across a
restart ends `succeeded`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from schemas.pathways.v1 import common_pb2 as pb
from tests.conftest import REPO, LocalCluster, wait_for

pytestmark = [pytest.mark.timeout(180)]

# Keeps x = f(x) (f adds 1) going, checking the value every 25 calls; prints "running" once the
# loop runs, goes on until the file named by argv[1] exists, then runs 30 more calls. A call that
# fails because it was in flight at the restart is redone from the last checked value.
LOOP = """\
import os, sys, time
import numpy as np
import pwctl as pw
from pwctl.api.runtime import Runtime

s = pw.make_virtual_device_set().add_slice(devices=1)
f = pw.jit(lambda x: x + 1.0, mesh=s.mesh("x"))
checked, value = 0, np.zeros(4)
x = f(value)
n = 1
after, redone, errors = None, 0, []
print("running", flush=True)
while after is None or n < after:
    if after is None and os.path.exists(sys.argv[1]):
        after = n + 30
    try:
        x = f(x)  # fails when x is the output of a call lost at the restart
        n += 1
        got = np.asarray(x) if n % 25 == 0 else None
    except pw.PathwaysError as e:
        errors.append(str(e))
        x, n = f(value), checked + 1   # redo from the last value we saw
        redone += 1
        continue
    if got is not None:
        assert (got == n).all(), (got, n)
        checked, value = n, got
    time.sleep(0.001)
final = np.asarray(x)
assert (final == n).all(), (final, n)
rt = Runtime.get()
print("done", n, final.tolist(), "reconnects", rt.resume.reconnects, "redone", redone, "slice", s.name, flush=True)
for e in errors:
    print("error:", e, flush=True)
"""


def _start_loop(c: LocalCluster, tmp_path: Path, **env: str) -> tuple[subprocess.Popen[str], Path]:
    script, flag = tmp_path / "loop.py", tmp_path / "restarted"
    script.write_text(LOOP)
    proc = subprocess.Popen([sys.executable, str(script), str(flag)], env=c.env(**env), cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "running", line + proc.communicate(timeout=30)[1][-3000:]
    return proc, flag


def _finish(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err[-4000:]}"
    return out


@pytest.mark.parametrize("kill", [True, False], ids=["crash", "stop"])
def test_a_pw_program_goes_on_across_a_controller_restart(make_cluster: Any, tmp_path: Path, kill: bool) -> None:
    c: LocalCluster = make_cluster(islands=1, devices=1)
    proc, flag = _start_loop(c, tmp_path)
    try:
        time.sleep(0.5)  # calls in flight
        slices_before = {s["name"]: s["owner"] for s in c.pwctl_json("slice", "list")["items"]}
        c.stop_controller(kill=kill)
        time.sleep(1.0)  # the program keeps calling while no controller listens
        c.start_controller()
        flag.write_text("")
        out = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    done = next(line for line in out.splitlines() if line.startswith("done"))
    words = done.split()
    n = int(words[1])
    assert words[words.index("reconnects") + 1] == "1", out
    assert f"[{float(n)}, {float(n)}, {float(n)}, {float(n)}]" in done
    # every call that failed names the restart, and says what to do
    for line in out.splitlines():
        if line.startswith("error:"):
            assert "controller" in line and ("restarted" in line or "call again" in line), line
    # the slice outlived the restart (same name and owner: the session kept its id)
    name = words[words.index("slice") + 1]
    assert slices_before.get(name, "").startswith("client:")
    logs = c.controller_logs()
    assert "resumed" in logs and "Traceback" not in logs, logs[-3000:]
    # the session ended with the program: its slice went
    wait_for(lambda: name not in {s["name"] for s in c.pwctl_json("slice", "list")["items"]}, 15,
             "the program's slice released")


def test_a_session_that_does_not_come_back_is_released_after_the_grace_period(make_cluster: Any,
                                                                               tmp_path: Path) -> None:
    """A client killed with the controller never resumes: its slice goes when the grace period
    ends. A client that tries to resume an unknown session fails with a clear error."""
    c: LocalCluster = make_cluster(islands=1, devices=1, controller_args=["--session-grace", "5"])
    proc, _flag = _start_loop(c, tmp_path)

    def slices() -> set[str]:
        with c.client() as client:
            return {s.name for s in client.slices()}

    owned = slices()
    assert owned
    c.stop_controller(kill=True)
    proc.kill()
    proc.communicate()
    c.start_controller()
    assert slices() == owned  # kept for now
    wait_for(lambda: not slices(), 20, "the slice of the dead session released")
    assert "did not resume within 5 s" in c.controller_logs()


RESUME_UNKNOWN = """\
import sys
import numpy as np
import pwctl as pw
from pwctl.api.runtime import Runtime

s = pw.make_virtual_device_set().add_slice(devices=1)
f = pw.jit(lambda x: x + 1.0, mesh=s.mesh("x"))
print(np.asarray(f(np.zeros(2))).tolist(), flush=True)
sys.stdin.readline()  # the controller restarts meanwhile, with a database that never saw us
try:
    f(np.zeros(2)).result(timeout=60)
except pw.PathwaysError as e:
    print("error:", e, flush=True)
"""


def test_resuming_a_session_the_controller_does_not_know_fails_clearly(make_cluster: Any, tmp_path: Path) -> None:
    c: LocalCluster = make_cluster(islands=1, devices=1)
    proc = subprocess.Popen([sys.executable, "-c", RESUME_UNKNOWN], env=c.env(), cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "[1.0, 1.0]"
        c.stop_controller(kill=True)
        Path(c.db_url.removeprefix("sqlite:///")).unlink()  # a new database: the session is unknown there
        c.start_controller()
        out, err = proc.communicate("\n", timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "error: cannot resume session" in out, out + err[-3000:]
    assert "Traceback" not in err, err[-3000:]


JOB = """\
import os, time
import numpy as np
import pwctl as pw

s = pw.make_virtual_device_set().add_slice(devices=1)
f = pw.jit(lambda x: x * 2.0, mesh=s.mesh("x"))
print("before", np.asarray(f(np.ones(2))).tolist(), flush=True)
while not os.path.exists("go"):
    time.sleep(0.05)
print("after", np.asarray(f(np.full(2, 3.0))).tolist(), flush=True)
"""


def test_a_job_making_pw_calls_across_a_restart_succeeds(make_cluster: Any, tmp_path: Path) -> None:
    c: LocalCluster = make_cluster(islands=1, devices=1)
    script = tmp_path / "job.py"
    script.write_text(JOB)
    r = c.pwctl("submit", str(script), "-d")
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()

    def output() -> str:
        return c.pwctl("logs", job_id).stdout

    wait_for(lambda: "before" in output(), 60, "the job's first call")
    c.stop_controller(kill=True)
    c.start_controller()
    job = c.pwctl_json("jobs", "describe", job_id)["item"]
    assert job["state"] == "running", job
    (c.home / "jobs" / job_id / "go").write_text("")
    w = c.pwctl("wait", job_id, "--timeout", "90", timeout=120)
    assert w.returncode == 0, (w.stdout, w.stderr, output())
    lines = output().splitlines()
    assert [line for line in lines if line.startswith(("before", "after"))] == ["before [2.0, 2.0]", "after [6.0, 6.0]"]
    assert any(line.startswith("resumed session") for line in lines), lines  # the runtime says so on stderr
    job = c.pwctl_json("jobs", "describe", job_id)["item"]
    assert job["state"] == "succeeded", job


@pytest.mark.cluster(islands=1, devices=1)
def test_a_wait_that_must_find_its_buffers_fails_at_once_for_an_unknown_one(cluster: LocalCluster) -> None:
    """What an uncertain future asks its worker: with `must_exist`, an id the worker never saw
    fails at once naming it; without, it is waited for (it may be on its way)."""
    from pwctl.worker_client import WorkerClient
    from server.credentials import KEY_FILE, load_or_create_key, session_credential

    address = next(iter(cluster.hosts().values())).address
    # a session's credential (workers serve a session its own id range only): prefix 77's
    credential = session_credential(load_or_create_key(cluster.home / KEY_FILE), "client:test", 77)
    conn = WorkerClient(address, cluster.token, credential)
    try:
        t0 = time.monotonic()
        done, error = conn.wait([(77 << 40) | 1], 5.0, must_exist=True)
        assert (done, time.monotonic() - t0 < 4.0) == (False, True) and "does not exist" in error, error
        assert conn.wait([(77 << 40) | 1], 0.3) == (False, "")  # waited for, not ready
    finally:
        conn.close()


IN_FLIGHT = """\
import sys, time
import numpy as np
import pwctl as pw

s = pw.make_virtual_device_set().add_slice(devices=1)
f = pw.jit(lambda x: x + 1.0, mesh=s.mesh("x"))
print(np.asarray(f(np.zeros(2))).tolist(), flush=True)
sys.stdin.readline()  # the worker is stopped now: the next calls cannot finish
futures = [f(np.full(2, float(i))) for i in range(5)]
time.sleep(1.0)  # handed to the controller
print("sent", flush=True)
sys.stdin.readline()  # the controller was killed and started again, the worker continued
try:  # a call reading a future of a run in flight at the restart waits until it is known computed (settle)
    print("ok" if np.asarray(f(futures[0])).tolist() == [2.0] * 2 else "WRONG", flush=True)
except pw.PathwaysError as e:
    print("error", e, flush=True)
for i, fu in enumerate(futures):
    try:
        print("ok" if fu.result(timeout=60).tolist() == [i + 1.0] * 2 else "WRONG", flush=True)
    except pw.PathwaysError as e:
        print("error", e, flush=True)
print("after", np.asarray(f(np.ones(2))).tolist(), flush=True)
"""


@pytest.mark.cluster(islands=1, devices=1)
def test_calls_in_flight_at_a_crash_complete_or_fail_naming_the_restart(cluster: LocalCluster) -> None:
    """Calls handed to the controller while their worker cannot run them (stopped), then the
    controller is killed: after the restart each call's future gives its value or a clear error
    naming the restart (none waits for ever), as does a call reading one of them (futures.py
    `settle`), and the program's next call works."""
    proc = subprocess.Popen([sys.executable, "-c", IN_FLIGHT], env=cluster.env(), cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "[1.0, 1.0]"
        cluster.stop_worker("w-a")
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "sent"
        cluster.stop_controller(kill=True)
        cluster.start_controller()
        cluster.cont_worker("w-a")
        out, err = proc.communicate("\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    lines = out.splitlines()
    assert lines[-1] == "after [2.0, 2.0]", out + err[-3000:]
    outcomes = lines[:-1]
    assert len(outcomes) == 6, out
    for line in outcomes:
        assert line == "ok" or (line.startswith("error") and "restarted" in line), line


def test_a_session_resumes_when_its_worker_came_back_at_a_new_address(make_cluster: Any, tmp_path: Path) -> None:
    """The controller and the slice's worker both restart; the worker listens on a new port. The
    resuming client waited for the worker's *old* address for its whole reconnect window (the
    chaos run's job: 60 s of 'cannot reach the worker' per controller restart, as slice events
    are not read while it waits). It must wait for the host by name and read the slice again,
    after seeing the host back (read before, a host registering in between left the slice at the
    old address for good). Calls queued meanwhile that name the old address are refused; the
    calls pipelined behind them, reading their outputs, are refused at once too (they were
    admitted, and held the new worker until the 60 s hang timeout: 1 run in 3 took ~68 s)."""
    c: LocalCluster = make_cluster(islands=1, devices=1)
    proc, flag = _start_loop(c, tmp_path, PWCTL_RECONNECT_S="600")  # the old wait outlasts the test
    try:
        time.sleep(0.5)
        old = c.hosts()["w-a"].address
        c.stop_controller(kill=True)
        c.kill_worker("w-a")
        c.start_controller()
        # the client resumes, then waits for its slice's host (a worker takes seconds to register)
        wait_for(lambda: "resumed" in c.controller_logs(), 30, "the program's session to resume")
        c.add_worker("a", 1)
        back = time.monotonic()
        assert c.hosts()["w-a"].address != old
        flag.write_text("")
        out = _finish(proc)
        took = time.monotonic() - back
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    done = next(line for line in out.splitlines() if line.startswith("done"))
    assert "reconnects 1" in done, out
    # nothing waited for the hang timeout (60 s)
    assert took < 30, f"the program ended {took:.0f} s after its worker came back:\n{out}"
    for line in out.splitlines():  # the lost worker's buffers or the restart: never the stale address
        if line.startswith("error:"):
            assert "cannot reach the worker" not in line or old in line, line  # never a wrong address
            assert "hang detected" not in line and "never started" not in line, line
    assert "hang detected" not in c.controller_logs()


DEGRADED_AT_RESUME = """\
import sys
import numpy as np
import pwctl as pw

s = pw.make_virtual_device_set().add_slice(devices=1)
f = pw.jit(lambda x: x + 1.0, mesh=s.mesh("x"))
print(np.asarray(f(np.zeros(2))).tolist(), flush=True)
for _ in sys.stdin:  # one call per line: its result, or its error
    try:
        print(np.asarray(f(np.ones(2))).tolist(), flush=True)
    except pw.PathwaysError as e:
        print("error:", e, flush=True)
"""


def test_a_program_refused_when_its_session_resumed_runs_once_its_slice_is_back(make_cluster: Any) -> None:
    """The session resumes while its slice's worker is lost: the new controller refuses the
    program's registration (the slice is degraded). That refusal was dropped: the runtime went on
    calling a program the controller never registered ("not registered (register it first)") for
    ever, after the worker came back too (the chaos run's job and psum workload). Each call
    registers it again now: while the slice is degraded the call fails naming that, and once the
    worker is back the program runs."""
    c: LocalCluster = make_cluster(islands=1, devices=1)
    proc = subprocess.Popen([sys.executable, "-c", DEGRADED_AT_RESUME], env=c.env(), cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None

    def call() -> str:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        return proc.stdout.readline().strip()

    try:
        assert proc.stdout.readline().strip() == "[1.0, 1.0]"
        c.kill_worker("w-a")
        c.wait_host_state("w-a", pb.HOST_STATE_LOST)
        c.stop_controller()  # (its database says the host is lost: SIGTERM drains its writes)
        c.start_controller()  # the slice is restored degraded
        wait_for(lambda: "resumed" in c.controller_logs(), 30, "the program's session to resume")
        # the calls fail while the worker is away; once the runtime has read the refusal, they
        # name the degraded slice (before, they go to the lost worker's address, or meet the
        # refused registration)
        errors = [call()]
        deadline = time.monotonic() + 20
        while "is degraded" not in errors[-1] and time.monotonic() < deadline:
            time.sleep(0.1)
            errors.append(call())
        c.add_worker("a", 1)
        outcomes = []  # the slice's new address reaches the client with the slice's event
        for _ in range(50):
            outcomes.append(call())
            if outcomes[-1] == "[2.0, 2.0]":
                break
            time.sleep(0.2)
        assert outcomes[-1] == "[2.0, 2.0]", (errors, outcomes)
        assert not any("not registered" in o for o in outcomes), outcomes
        assert all(e.startswith("error:") for e in errors) and "is degraded" in errors[-1], errors
    finally:
        if proc.poll() is None:
            proc.kill()
        _out, err = proc.communicate()
    assert "Traceback" not in err, err[-3000:]
    assert "not registered again after resuming the session: slice" in err, err[-3000:]  # said why
