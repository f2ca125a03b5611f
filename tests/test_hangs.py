"""Hangs made visible: the scheduler's stalls (event by event, no network), then a real cluster
with a frozen worker (SIGSTOP) as `status`, `host list`, `jobs describe` and the job's log show it
before and after the hang timeout fails the run."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, LocalCluster, wait_for

from server.controller.hangs import stall_after
from server.scheduler import GangScheduler, NodeFinished, NodeSpec, NodeStarted, RunSpec, Submit, Tick

HANG_SCRIPT = REPO / "tests" / "clients" / "hang.py"


def spec(rid: int, hosts: list[str], job: str | None = "job-1") -> RunSpec:
    nodes = tuple(NodeSpec(i, h, "a", (0,), (i - 1,) if i else (), f"n{i}") for i, h in enumerate(hosts))
    return RunSpec(rid, f"p-{rid}", "c1", job, nodes, 0, 1.0, False)


def test_stall_threshold_is_a_quarter_of_the_hang_timeout_at_most_5_s() -> None:
    assert stall_after(8.0) == 2.0
    assert stall_after(60.0) == 5.0
    assert stall_after(None) == 5.0


def test_a_head_that_never_started_is_a_stall_naming_host_run_and_job() -> None:
    s = GangScheduler(hang_timeout_s=20.0)
    s.handle(Submit(spec(1, ["h0", "h1"]), now=0.0))
    assert s.stalls(now=2.0, after_s=3.0) == []
    stalls = s.stalls(now=4.0, after_s=3.0)
    # h0's head (node 0) has not started; h1's head waits on it (a dep), so it is not stuck
    assert [(x.host, x.run_id, x.node_index, x.job, x.started) for x in stalls] == [("h0", 1, 0, "job-1", False)]
    assert stalls[0].for_s == pytest.approx(4.0)
    assert stalls[0].message == "node 0 of program p-1: host h0 has not started it for 4.0 s"
    # node 0 finished: now node 1 on h1 is the head whose clock starts at its dep's end
    s.handle(NodeFinished(1, 0, True, "", 0.1, now=5.0))
    assert [x.host for x in s.stalls(now=7.0, after_s=3.0)] == []
    assert [(x.host, x.node_index) for x in s.stalls(now=8.5, after_s=3.0)] == [("h1", 1)]


def test_a_started_node_counts_as_stalled_only_past_half_the_hang_timeout() -> None:
    s = GangScheduler(hang_timeout_s=20.0)
    s.handle(Submit(spec(1, ["h0"]), now=0.0))
    s.handle(NodeStarted(1, 0, now=1.0))
    assert s.stalls(now=10.0, after_s=3.0) == []  # a long computation is normal
    (x,) = s.stalls(now=12.0, after_s=3.0)
    assert x.started and "started it and it has not finished for 11.0 s" in x.message


def test_hang_detection_counts_and_carries_the_job() -> None:
    s = GangScheduler(hang_timeout_s=5.0)
    s.handle(Submit(spec(1, ["h0"], job="job-7"), now=0.0))
    actions = s.handle(Tick(now=6.0))
    assert actions[0].job == "job-7"  # type: ignore[union-attr]
    assert s.stats.hangs_detected == 1 and s.stats.runs_failed == 1
    assert s.stalls(now=7.0, after_s=1.0) == []  # the failed run holds nothing back any more


# ------------------------------------------------------------------------------------ a real cluster


def queue_stall(c: LocalCluster) -> dict[str, Any] | None:
    doc = c.pwctl_json("status")
    for q in doc["queues"]:
        for e in q["entries"]:
            if e["stalled_host"]:
                return dict(e)
    return None


def host_states(c: LocalCluster) -> dict[str, str]:
    doc = c.pwctl_json("host", "list")
    return {str(h["name"]): str(h["state"]) for h in doc["items"]}


# The hang timeout of the frozen-worker test, and the stall threshold it implies (a quarter, at most
# 5 s). Between the two, the test runs five `pwctl` processes (a status poll or two, then `host list`,
# the status table and `jobs describe`), each 0.4-1 s of Python start-up on an idle machine and 3-5 s
# on a 2-core machine at load 5-10: at 14 s the hang fired before the last of them ran now and then.
HANG_TIMEOUT_S = 30.0
STALL_AFTER_S = stall_after(HANG_TIMEOUT_S)


@pytest.mark.timeout(240)
@pytest.mark.cluster(islands=2, devices=2, controller_args=["--hang-timeout", f"{HANG_TIMEOUT_S:g}"],
                     heartbeat_timeout=90)
def test_a_frozen_worker_shows_in_status_host_list_jobs_and_the_log(cluster: LocalCluster, tmp_path: Path) -> None:
    workdir = tmp_path / "w"
    workdir.mkdir()
    r = cluster.pwctl("submit", str(HANG_SCRIPT), "-d", "--", str(workdir))
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    wait_for(lambda: (workdir / "ready").exists(), 90, "the job's program warmed up")
    cluster.stop_worker("w-b")
    try:
        (workdir / "go").write_text("go")
        # within the hang timeout: the gang, the host that holds it back, and for how long
        entry = wait_for(lambda: queue_stall(cluster), HANG_TIMEOUT_S, "status to show the stuck gang", interval=0.3)
        # the other views at once (three processes side by side: on a loaded machine they get three
        # shares of the cores, where one after the other they would wait for theirs three times)
        with ThreadPoolExecutor(3) as pool:
            hosts_f = pool.submit(host_states, cluster)
            table_f = pool.submit(lambda: cluster.pwctl("status").stdout)
            job_f = pool.submit(lambda: cluster.pwctl_json("jobs", "describe", job)["item"])
            hosts, table, described = hosts_f.result(), table_f.result(), job_f.result()
        # all four views were taken before the hang timeout failed the run (the file is written
        # once the program heard of it, after the controller failed the run)
        assert not (workdir / "failed").exists(), "seen only after the hang timeout"
        assert entry["stalled_host"] == "w-b" and entry["state"] == "running" and entry["job"] == job
        assert entry["stalled_s"] >= STALL_AFTER_S
        assert "host w-b has not started it" in entry["reason"] and "node 0 of program stalls" in entry["reason"]
        assert hosts["w-b"] == "stalled" and hosts["w-a"] == "ready", hosts
        assert "has not" in table and "stalls: host" in table, table  # WAITING FOR says it (a cell may wrap)
        assert "held back by host w-b" in described["held_back"], described
        assert not described["last_hang"], described
        wait_for(lambda: (workdir / "failed").exists(), HANG_TIMEOUT_S + 30, "the hang timeout to fail the run")
        doc = cluster.pwctl_json("jobs", "describe", job)["item"]
        assert doc["last_hang"].startswith("hang detected: node 0 of program stalls: host w-b"), doc
        assert queue_stall(cluster) is None
        log = cluster.pwctl("logs", job)
        assert log.returncode == 0 and "[pathways controller] hang detected: node 0 of program stalls" in log.stdout
    finally:
        cluster.cont_worker("w-b")
    wait_for(lambda: host_states(cluster)["w-b"] == "ready", 20, "w-b ready again")
    (workdir / "go2").write_text("go")
    final = cluster.pwctl("wait", job, timeout=90)
    assert final.returncode == 0, final.stderr
    out = json.loads(cluster.pwctl("logs", job).stdout.strip().splitlines()[-1])
    assert "hang detected" in out["hung"] and out["after"] == [6.0, 6.0]
