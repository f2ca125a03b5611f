"""Jobs end to end: `pwctl submit/logs/wait/cancel/jobs` against a real local cluster.

Drivers are tiny scripts written into the test's temp dir; every wait polls with a deadline.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import REPO, LocalCluster, popen_interruptible, wait_for

pytestmark = [pytest.mark.cluster(islands=1, devices=2), pytest.mark.timeout(60)]

SEED = REPO / "examples" / "seed_program.py"

SLEEPER = "import time\nprint('started', flush=True)\ntime.sleep(120)\n"


def script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def submit_detached(c: LocalCluster, path: Path, *args: str) -> str:
    r = c.pwctl("submit", str(path), "-d", *args)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    assert job_id.startswith("job-") and "\n" not in job_id, r.stdout  # only the id on stdout
    return job_id


def describe(c: LocalCluster, job_id: str) -> dict[str, Any]:
    doc = c.pwctl_json("jobs", "describe", job_id)
    assert doc["kind"] == "Job"
    item: dict[str, Any] = doc["item"]
    return item


def wait_output(c: LocalCluster, job_id: str, text: str) -> None:
    def has() -> bool:
        r = c.pwctl("logs", job_id)
        return r.returncode == 0 and text in r.stdout

    wait_for(has, 20, f"{text!r} in the output of {job_id}", interval=0.1)


def pid_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_attached_submit_streams_output_and_exits_with_the_job_code(
        module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster
    path = script(tmp_path, "three.py", "import sys\nprint('args', sys.argv[1:])\nsys.exit(3)\n")
    r = c.pwctl("submit", str(path), "--name", "three", "--", "a", "--b")
    assert r.returncode == 3, r.stderr
    assert r.stdout == "args ['a', '--b']\n"
    assert "submitted; watch it with `pwctl status --watch`" in r.stderr
    job_id = r.stderr.split()[1]
    job = describe(c, job_id)
    assert job["state"] == "failed" and job["exit_code"] == 3 and job["reason"] == "exited with code 3"
    assert job["name"] == "three" and job["args"] == ["a", "--b"]
    assert job["ended_at"].endswith("Z")
    # wait on an ended job exits with its code too; a unique prefix names it
    assert c.pwctl("wait", job_id.removeprefix("job-")[:5]).returncode == 3


def test_a_driver_that_raises_fails_and_the_server_carries_on(module_cluster: LocalCluster,
                                                              tmp_path: Path) -> None:
    c = module_cluster
    path = script(tmp_path, "boom.py", "print('before')\nraise RuntimeError('boom in the driver')\n")
    job_id = submit_detached(c, path)
    assert c.pwctl("wait", job_id, "--timeout", "20").returncode == 1
    job = describe(c, job_id)
    assert job["state"] == "failed" and job["exit_code"] == 1
    logs = c.pwctl("logs", job_id)
    assert "before" in logs.stdout and "Traceback" in logs.stdout
    assert "RuntimeError: boom in the driver" in logs.stdout
    tail = c.pwctl("logs", job_id, "--tail", "1")
    assert tail.stdout == "RuntimeError: boom in the driver\n"
    assert c.pwctl("island", "list").returncode == 0  # the server is fine
    ok = script(tmp_path, "ok.py", "print('still works')\n")
    r = c.pwctl("submit", str(ok))
    assert r.returncode == 0 and r.stdout == "still works\n"


def test_a_driver_killed_like_by_the_oom_killer_fails_with_the_reason(module_cluster: LocalCluster,
                                                                      tmp_path: Path) -> None:
    c = module_cluster
    path = script(tmp_path, "oom.py", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    r = c.pwctl("submit", str(path))
    assert r.returncode == 1
    assert "killed by SIGKILL (out of memory?)" in r.stderr
    job = describe(c, r.stderr.split()[1])
    assert job["state"] == "failed" and job["exit_code"] is None
    assert job["reason"] == "killed by SIGKILL (out of memory?)"


def test_detached_then_logs_follow_and_wait(module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster
    path = script(tmp_path, "slow.py", "import sys, time\n"
                  "for i in range(5):\n    print('line', i, flush=True)\n    time.sleep(0.2)\n"
                  "sys.exit(3)\n")
    job_id = submit_detached(c, path)
    r = c.pwctl("logs", job_id, "-f")
    assert r.returncode == 0
    assert r.stdout == "".join(f"line {i}\n" for i in range(5))
    assert f"job {job_id} failed (exit code 3)" in r.stderr
    assert c.pwctl("wait", job_id).returncode == 3


def test_cancel_a_sleeping_driver(module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster
    job_id = submit_detached(c, script(tmp_path, "sleeper.py", SLEEPER))
    wait_output(c, job_id, "started")
    running = describe(c, job_id)
    assert running["state"] == "running" and running["pid"]
    r = c.pwctl("cancel", job_id)  # no terminal, no -y: refuse
    assert r.returncode == 2 and "-y" in r.stderr
    assert c.pwctl("wait", job_id, "--timeout", "0.3").returncode == 124  # still running: as timeout(1)
    r = c.pwctl("cancel", job_id[:8], "-y")
    assert r.returncode == 0, r.stderr
    assert f"job {job_id} cancelled" in r.stderr
    job = describe(c, job_id)
    assert job["state"] == "cancelled" and job["exit_code"] is None and job["ended_at"]
    wait_for(lambda: pid_gone(running["pid"]), 10, "the cancelled driver to exit")
    assert c.pwctl("wait", job_id).returncode == 1
    r = c.pwctl("cancel", job_id, "-y")  # already ended: nothing to do
    assert r.returncode == 0 and "already ended (cancelled)" in r.stderr


def test_ctrl_c_detaches_an_attached_submit(module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster
    path = script(tmp_path, "sleeper.py", SLEEPER)
    proc = popen_interruptible([sys.executable, "-m", "pwctl.cli.main", "submit", str(path)], env=c.env(),
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "started\n"  # the job's output, streamed
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err  # interrupted, as shells report SIGINT
    job_id = err.split()[1]
    assert f"pwctl logs {job_id} -f" in err and f"pwctl cancel {job_id}" in err
    assert describe(c, job_id)["state"] == "running"  # detached, not cancelled
    assert c.pwctl("cancel", job_id, "-y").returncode == 0


def test_seed_program_job_owns_its_slices_and_releases_them(module_cluster: LocalCluster) -> None:
    c = module_cluster
    r = c.pwctl("submit", str(SEED), "--name", "seed")
    assert r.returncode == 0, r.stderr
    assert "(array([3., 5.]), array([2., 4.]))" in r.stdout
    job_id = r.stderr.split()[1]
    owner = f"job:{job_id}"
    leftovers = [s for s in c.pwctl_json("slice", "list")["items"] if s["owner"] == owner]
    assert leftovers == []
    job = describe(c, job_id)
    assert job["state"] == "succeeded" and job["exit_code"] == 0
    assert len(job["slices"]) == 3 and job["programs"] == 1 and job["runs"] >= 1
    assert job["pending_reason"] == ""


def test_working_dir_is_uploaded_and_validation(module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster
    wd = tmp_path / "proj"
    (wd / "pkg").mkdir(parents=True)
    (wd / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    (wd / "data.txt").write_text("payload\n")
    (wd / "main.py").write_text("import pkg\nprint(pkg.VALUE, open('data.txt').read().strip())\n")
    r = c.pwctl("submit", str(wd / "main.py"), "--working-dir", str(wd))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "42 payload\n"
    empty = script(tmp_path, "empty.py", "")
    r = c.pwctl("submit", str(empty))
    assert r.returncode == 2 and "empty" in r.stderr
    r = c.pwctl("submit", str(wd / "main.py"), "--weight", "0")
    assert r.returncode == 2 and "weight" in r.stderr
    # past the controller's range: refused before the upload (it was by the controller, after it),
    # worded as a session's (pwctl/limits.py share_problem); it said "it must be a number > 0" of 1e7
    for weight in ("1e7", "inf", "nan"):
        r = c.pwctl("submit", str(wd / "main.py"), "--weight", weight)
        assert (r.returncode, r.stderr) == (2, f"error: job weight {float(weight):g} is out of range: use a number "
                                               "in (0, 1e+06]\n"), (weight, r.returncode, r.stderr)


def test_jobs_list_and_describe_json(module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster
    job_id = submit_detached(c, script(tmp_path, "quick.py", "print('hi')\n"))
    assert c.pwctl("wait", job_id).returncode == 0
    doc = c.pwctl_json("jobs", "list")
    assert doc["apiVersion"] == "pathways/v1" and doc["kind"] == "JobList"
    mine = [j for j in doc["items"] if j["id"] == job_id]
    assert len(mine) == 1
    item = mine[0]
    for key in ("id", "name", "state", "exit_code", "reason", "submitted_at", "started_at", "ended_at",
                "slices", "programs", "runs", "pending_reason", "priority", "weight"):
        assert key in item
    assert item["state"] == "succeeded" and item["exit_code"] == 0 and item["name"] == "quick"
    succeeded = c.pwctl_json("jobs", "list", "--state", "succeeded", "--all")["items"]
    assert job_id in {j["id"] for j in succeeded} and {j["state"] for j in succeeded} == {"succeeded"}
    assert describe(c, job_id)["id"] == job_id
    table = c.pwctl("jobs", "list")
    assert table.returncode == 0 and job_id in table.stdout
    assert c.pwctl("jobs", "describe", "job-nope").returncode == 3
    assert c.pwctl("jobs", "list", "--state", "bogus").returncode == 2
    assert c.pwctl("logs", "job-nope").returncode == 3


def test_a_job_adopted_after_a_controller_restart_can_be_cancelled(make_cluster: Any, tmp_path: Path) -> None:
    c: LocalCluster = make_cluster(start=False)  # a controller alone: the driver makes no `pw` call
    c.start_controller()
    sleeper = script(tmp_path, "sleeper.py", SLEEPER)
    job_id = submit_detached(c, sleeper)
    wait_output(c, job_id, "started")
    pid = describe(c, job_id)["pid"]
    c.restart_controller(kill=True)  # the driver outlives the controller: the new one adopts it
    job = describe(c, job_id)
    assert job["state"] == "running" and job["pid"] == pid
    r = c.pwctl("cancel", job_id, "-y")  # through its supervisor
    assert r.returncode == 0, r.stderr
    job = describe(c, job_id)
    assert job["state"] == "cancelled" and job["exit_code"] is None
    wait_for(lambda: pid_gone(pid), 10, "the cancelled driver to exit")
    assert "started" in c.pwctl("logs", job_id).stdout  # logs persist
    assert c.pwctl("wait", job_id).returncode == 1
    listed = json.loads(c.pwctl("jobs", "list", "--all", "-o", "json").stdout)["items"]
    assert job_id in {j["id"] for j in listed}


TOKEN_CHECK = """\
import os, pathlib, runpy, sys
token = os.environ.get("PWCTL_TOKEN")
expected = (pathlib.Path(os.environ["PATHWAYS_HOME"]) / "token").read_text().strip()
print("token from the controller:", token == expected, flush=True)
if sys.argv[1:] == ["without"]:  # no token anywhere: every call is refused
    del os.environ["PWCTL_TOKEN"]
    os.environ["PATHWAYS_HOME"] = os.path.join(os.getcwd(), "elsewhere")
runpy.run_path(sys.argv[0].replace("token_check.py", "seed_program.py"), run_name="__main__")
"""


def test_a_job_gets_the_token(module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster
    assert c.token
    wd = tmp_path / "proj"
    wd.mkdir()
    (wd / "token_check.py").write_text(TOKEN_CHECK)
    (wd / "seed_program.py").write_text(SEED.read_text())
    r = c.pwctl("submit", str(wd / "token_check.py"), "--working-dir", str(wd), env=c.env(PWCTL_TOKEN=c.token))
    assert r.returncode == 0, r.stderr
    assert "token from the controller: True" in r.stdout
    assert "(array([3., 5.]), array([2., 4.]))" in r.stdout

    r = c.pwctl("submit", str(wd / "token_check.py"), "--working-dir", str(wd), "--", "without",
                env=c.env(PWCTL_TOKEN=c.token))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "rejected the call: missing or wrong token" in r.stdout
