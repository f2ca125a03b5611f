"""A job is a whole process tree run by its own supervisor, which outlives the controller.

Regression tests for issue 29: a `setsid` grandchild outlived its job (7), a job's output was kept
and served whole without a cap (8), a controller restart failed every running job (11).
Drivers here need no controller while it restarts: they print, wait for a file the test writes,
print again. No workers are started: the jobs make no `pw` calls.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from server.controller.job_files import LogReader
from server.controller.jobsup import Output, own_cgroup
from tests.conftest import REPO, LocalCluster, wait_for

pytestmark = [pytest.mark.timeout(90)]

# the driver forks a grandchild into a new session (what `setsid cmd &` does), prints its pid
# (then waits for `go` in its working directory, or with `stay` for ever)
ORPHANER = """\
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
print("grandchild", child.pid, flush=True)
while sys.argv[1:] == ["stay"] or not os.path.exists("go"):
    time.sleep(0.05)
"""

# prints, waits until the test writes `go` in its working directory, prints again
WAITER = """\
import os, sys, time
print("before", flush=True)
while not os.path.exists("go"):
    time.sleep(0.05)
print("after", flush=True)
sys.exit(int(sys.argv[1]) if sys.argv[1:] else 0)
"""


def cluster(make_cluster: Any, *args: str) -> LocalCluster:
    c: LocalCluster = make_cluster(controller_args=list(args), start=False)
    c.start_controller()
    return c


@pytest.fixture(scope="module")
def module_controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("jobs-controller")) as c:
        c.start_controller()
        yield c


@pytest.fixture
def controller(module_controller: LocalCluster) -> LocalCluster:
    """A controller (no workers) shared by the tests below with the default settings: each ends
    its own jobs, and one that stopped or restarted the controller leaves it running (started
    here again should a test have failed with it down)."""
    c = module_controller
    if c.controller is None or c.controller.poll() is not None:
        c.start_controller()
    return c


def submit(c: LocalCluster, tmp_path: Path, name: str, text: str, *args: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    r = c.pwctl("submit", str(path), "-d", *(["--", *args] if args else []))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def describe(c: LocalCluster, job_id: str) -> dict[str, Any]:
    item: dict[str, Any] = c.pwctl_json("jobs", "describe", job_id)["item"]
    return item


def wait_output(c: LocalCluster, job_id: str, text: str) -> str:
    def has() -> str | None:
        r = c.pwctl("logs", job_id)
        return r.stdout if r.returncode == 0 and text in r.stdout else None

    out: str = wait_for(has, 30, f"{text!r} in the output of {job_id}", interval=0.1)
    return out


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def grandchild_pid(c: LocalCluster, job_id: str) -> int:
    out = wait_output(c, job_id, "grandchild")
    pid = int(out.split("grandchild", 1)[1].split()[0])
    assert not gone(pid)
    return pid


def job_dir(c: LocalCluster, job_id: str) -> Path:
    return c.home / "jobs" / job_id


def test_a_setsid_grandchild_ends_with_its_job(controller: LocalCluster, tmp_path: Path) -> None:
    c = controller
    done = submit(c, tmp_path, "orphaner.py", ORPHANER)
    pid = grandchild_pid(c, done)
    (job_dir(c, done) / "go").write_text("")
    try:
        assert c.pwctl("wait", done, "--timeout", "30").returncode == 0
        assert describe(c, done)["state"] == "succeeded"
        wait_for(lambda: gone(pid), 10, "the setsid grandchild of a finished job to end")
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)

    cancelled = submit(c, tmp_path, "orphaner.py", ORPHANER, "stay")
    pid = grandchild_pid(c, cancelled)
    try:
        r = c.pwctl("cancel", cancelled, "-y")
        assert r.returncode == 0, r.stderr
        assert describe(c, cancelled)["state"] == "cancelled"
        wait_for(lambda: gone(pid), 10, "the setsid grandchild of a cancelled job to end")
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def cgroups_writable() -> bool:
    home = own_cgroup()
    return home is not None and os.access(home, os.W_OK)


@pytest.mark.skipif(not cgroups_writable(), reason="no writable cgroup v2 hierarchy here")
def test_a_killed_supervisor_leaves_nothing_of_its_job(controller: LocalCluster, tmp_path: Path) -> None:
    """The subreaper cannot end the tree once it is dead itself (an OOM kill): the job's cgroup
    can. Without it the `setsid` grandchild was left running under init."""
    c = controller
    job_id = submit(c, tmp_path, "orphaner.py", ORPHANER, "stay")
    pid = grandchild_pid(c, job_id)
    info = json.loads((job_dir(c, job_id) / "sup.json").read_text())
    group = Path(info["cgroup"])
    assert pid in [int(p) for p in (group / "cgroup.procs").read_text().split()]
    try:
        os.kill(info["pid"], signal.SIGKILL)  # the supervisor alone
        assert c.pwctl("wait", job_id, "--timeout", "30").returncode != 0
        job = describe(c, job_id)
        assert job["state"] == "failed" and "supervisor died" in job["reason"], job
        wait_for(lambda: gone(pid) and gone(info["driver_pid"]), 10, "the job's processes to end")
        wait_for(lambda: not group.exists(), 10, "the job's cgroup to be removed")
    finally:
        for p in (pid, info["driver_pid"]):
            if not gone(p):
                os.kill(p, signal.SIGKILL)

    done = submit(c, tmp_path, "burner.py", "sum(range(3_000_000))\n")
    assert c.pwctl("wait", done, "--timeout", "30").returncode == 0
    exit_doc = json.loads((job_dir(c, done) / "exit.json").read_text())
    assert exit_doc["cpu_s"] > 0.01, exit_doc  # the tree's CPU time, counted by its cgroup
    assert not Path(json.loads((job_dir(c, done) / "sup.json").read_text())["cgroup"]).exists()


@pytest.mark.parametrize("kill", [True, False], ids=["crash", "stop"])
def test_a_controller_restart_ends_no_job(controller: LocalCluster, tmp_path: Path, kill: bool) -> None:
    c = controller
    job_id = submit(c, tmp_path, "waiter.py", WAITER)
    wait_output(c, job_id, "before")
    driver = describe(c, job_id)["pid"]
    c.restart_controller(kill=kill)
    job = describe(c, job_id)
    assert job["state"] == "running", job  # adopted, not failed
    assert not gone(driver)
    follow = subprocess.Popen([sys.executable, "-m", "pwctl.cli.main", "logs", job_id, "-f"], env=c.env(),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        (job_dir(c, job_id) / "go").write_text("")
        out, err = follow.communicate(timeout=30)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 0, err
    assert out == "before\nafter\n"
    assert c.pwctl("wait", job_id, "--timeout", "30").returncode == 0
    job = describe(c, job_id)
    assert job["state"] == "succeeded" and job["exit_code"] == 0, job


def test_a_job_that_ends_while_the_controller_is_down(controller: LocalCluster, tmp_path: Path) -> None:
    c = controller
    ended = submit(c, tmp_path, "waiter.py", WAITER, "4")
    wait_output(c, ended, "before")
    lost = submit(c, tmp_path, "waiter.py", WAITER)
    wait_output(c, lost, "before")
    driver = describe(c, lost)["pid"]
    c.stop_controller(kill=True)
    (job_dir(c, ended) / "go").write_text("")
    wait_for(lambda: (job_dir(c, ended) / "exit.json").exists(), 30, "the supervisor to record the exit")
    # the machine "restarts": the supervisor and driver of `lost` die with no exit recorded
    sup = psutil.Process(driver).parent()
    assert sup is not None and "jobsup" in " ".join(sup.cmdline())
    os.killpg(sup.pid, signal.SIGKILL)
    os.killpg(driver, signal.SIGKILL)
    wait_for(lambda: gone(sup.pid) and gone(driver), 10, "the supervisor and driver to die")
    c.start_controller()
    job = describe(c, ended)
    assert job["state"] == "failed" and job["exit_code"] == 4 and job["reason"] == "exited with code 4", job
    assert c.pwctl("logs", ended).stdout == "before\nafter\n"
    assert c.pwctl("wait", ended).returncode == 4
    job = describe(c, lost)
    assert job["state"] == "failed", job
    assert "supervisor" in job["reason"] and "no exit status" in job["reason"], job


def test_job_output_is_capped_and_logs_say_it_was_truncated(make_cluster: Any, tmp_path: Path) -> None:
    c = cluster(make_cluster, "--job-log-max-mb", "1")
    # 8 MiB of numbered lines; the last one is known
    writer = ("import sys\nfor i in range(80000):\n    sys.stdout.write(f'{i:08d} ' + 'x' * 95 + '\\n')\n"
              "print('the end')\n")
    job_id = submit(c, tmp_path, "chatty.py", writer)
    assert c.pwctl("wait", job_id, "--timeout", "60").returncode == 0
    kept = sum(p.stat().st_size for p in job_dir(c, job_id).glob("output.log*"))
    assert kept <= 2**20
    r = c.pwctl("logs", job_id)
    assert r.returncode == 0
    assert r.stdout.endswith("00079999 " + "x" * 95 + "\nthe end\n")
    assert len(r.stdout) <= 2**20 + 400
    assert "truncated" in r.stdout.splitlines()[0]
    assert "00000000 " not in r.stdout
    tail = c.pwctl("logs", job_id, "--tail", "2")
    assert tail.stdout == "00079999 " + "x" * 95 + "\nthe end\n"


def test_the_log_reader_follows_the_output_across_rotations(tmp_path: Path) -> None:
    """The supervisor's writer and the controller's reader, in one process: a follower sees every
    byte once and in order while the log rotates under it; what is kept stays within the cap."""
    out = Output(tmp_path, max_bytes=1000)
    follower = LogReader(tmp_path)
    assert follower.start(0) == ""
    seen = b""
    lines = [f"line {i:04d}\n".encode() for i in range(400)]  # 4,400 bytes: rotates ~8 times
    for i, line in enumerate(lines):
        out.write(line)
        if i % 7 == 0:
            while data := follower.read():
                seen += data
    while data := follower.read():
        seen += data
    out.close()
    follower.close()
    assert seen == b"".join(lines)
    kept = (tmp_path / "output.log.1").read_bytes() + (tmp_path / "output.log").read_bytes()
    assert len(kept) <= 1000 and b"".join(lines).endswith(kept) and kept.startswith(b"line ")

    late = LogReader(tmp_path)  # a reader that comes after: the notice, then what is kept
    notice = late.start(0)
    assert notice.startswith("[pathways: output truncated:") and "--job-log-max-mb" in notice
    got = b""
    while data := late.read():
        got += data
    late.close()
    assert got == kept

    tail = LogReader(tmp_path)  # more lines than output.log holds: the rest from output.log.1
    n_cur = (tmp_path / "output.log").read_bytes().count(b"\n")
    assert tail.start(n_cur + 3) == ""
    got = b""
    while data := tail.read():
        got += data
    tail.close()
    assert got == b"".join(lines[-(n_cur + 3):])
