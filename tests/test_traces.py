"""Traces that last: node runs written to segment files beyond the observer's ring, read back
per job and program, windowed (`since`, `last`), bounded by the retention, and still there after
a controller restart (a real cluster)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, LocalCluster, wait_for
from test_status import FakeCluster, FakeHost, fake_run
from together import pwctls

from pwctl.units import parse_size
from schemas.pathways.v1 import controller_pb2 as cpb
from server.controller.errors import NotFound
from server.controller.observe import Observer
from server.controller.trace_store import TraceStore

S = 1_000_000_000


class Feeder:
    """Finished node runs, one per run, 1 ms apart, on device 0 of h0."""

    def __init__(self, obs: Observer) -> None:
        self.obs = obs
        self.run_id = 0
        self.t = 1000 * S

    def runs(self, n: int, program: str, job: str) -> list[int]:
        ends = []
        for _ in range(n):
            self.run_id += 1
            ev = cpb.NodeEvent(run_id=self.run_id, segment=0, seq=self.run_id, start_ns=self.t,
                               end_ns=self.t + S // 1000, ok=True, local_devices=[0])
            self.obs.on_node_event("h0", ev, fake_run(self.run_id, program, f"id-{program}", job, nodes=1))
            self.t += S // 1000
            ends.append(self.t)
        return ends


def observer(directory: Path, ring: int = 50, retention: int = 2**30) -> Observer:
    cluster = FakeCluster({"h0": FakeHost("h0", "a", [10, 11])})
    return Observer(cluster, ring_size=ring, store=TraceStore(directory, retention))  # type: ignore[arg-type]


def test_a_jobs_trace_outlasts_the_ring_and_is_windowed(tmp_path: Path) -> None:
    obs = observer(tmp_path)
    feed = Feeder(obs)
    ends_a = feed.runs(30, "pa", "job-a")
    obs.flush()
    for _ in range(5):  # 200 node runs of another job: the ring (50) holds none of job-a's any more
        feed.runs(40, "pb", "job-b")
        obs.flush()
    feed.runs(10, "pb", "job-b")  # still only in the ring
    assert {r.job for r in obs.records()} == {"job-b"}
    a = obs.select(job="job-a")
    assert [r.run_id for r in a] == list(range(1, 31)) and a[0].program == "pa" and a[0].devices == (0,)
    assert len(obs.select(job="job-b")) == 210  # the ring's unwritten 10 and the store's 200, each once
    assert len(obs.select(program="pb")) == 210
    assert [r.run_id for r in obs.select(job="job-a", last=5)] == [26, 27, 28, 29, 30]
    assert [r.run_id for r in obs.select(job="job-a", since_ns=ends_a[-4])] == [27, 28, 29, 30]
    doc = json.loads(obs.trace(job="job-a", last=7))
    assert len([e for e in doc["traceEvents"] if e["ph"] == "X"]) == 7


def test_the_store_outlives_the_controller_and_keeps_to_its_retention(tmp_path: Path) -> None:
    obs = observer(tmp_path)
    feed = Feeder(obs)
    feed.runs(20, "pa", "job-a")
    obs.flush()
    one = obs.store.nbytes if obs.store is not None else 0
    # a new controller on the same data directory
    again = observer(tmp_path)
    assert [r.run_id for r in again.select(job="job-a")] == list(range(1, 21))
    assert len(again.select(program="pa")) == 20
    # a retention of about three segments: the oldest go first
    small = observer(tmp_path, retention=3 * one + one // 2)
    feed = Feeder(small)
    feed.run_id = 100
    for _ in range(4):
        feed.runs(20, "pb", "job-b")
        small.flush()
    assert small.store is not None and len(small.store.segments) == 3 and small.store.nbytes <= 3.5 * one
    assert len(list(tmp_path.glob("*.trace"))) == 3
    with pytest.raises(NotFound, match="job 'job-a'"):
        small.select(job="job-a")
    assert len(small.select(job="job-b")) == 60


def test_unreadable_segments_are_dropped_and_sizes_parse(tmp_path: Path) -> None:
    (tmp_path / "000000000001.trace").write_text("not json\n")
    store = TraceStore(tmp_path)
    assert store.segments == [] and not (tmp_path / "000000000001.trace").exists()
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("2GB") == 2 * 10**9 and parse_size("0") == 0
    with pytest.raises(ValueError, match="invalid size 'lots'"):
        parse_size("lots")


CLIENT = textwrap.dedent("""
    import numpy as np
    import pwctl as pw

    s = pw.make_virtual_device_set().add_slice(2, island="a")
    f = pw.pmap(lambda x: x * 2.0, s.devices)

    @pw.program
    def lasting(x):
        return f(x)

    x = np.ones((2, 4), np.float32)
    for _ in range(12):
        z = lasting(x)
    z.result()
    print("done", flush=True)
""")


def get_trace(c: LocalCluster, **kw: Any) -> cpb.TraceResponse:
    with c.client() as client:
        return client.trace_window(**kw)


@pytest.mark.cluster(islands=1, devices=2)
def test_a_programs_trace_is_there_after_a_controller_restart(cluster: LocalCluster, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", CLIENT], env=cluster.env(), cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "done" in r.stdout, r.stdout + r.stderr
    wait_for(lambda: list((cluster.home / "traces").glob("*.trace")), 30, "a trace segment written")
    wait_for(lambda: get_trace(cluster, program="lasting").node_runs_total >= 12, 30, "every run kept")
    cluster.restart_controller()
    resp = get_trace(cluster, program="lasting", last=3)
    assert resp.node_runs == 3 and resp.node_runs_total >= 12
    events = [e for e in json.loads(resp.chrome_trace_json)["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["program"] for e in events} == {"lasting"} and len({e["args"]["run_id"] for e in events}) == 3
    # the CLI: --last N gives N, and says what the window left out; --since a window in time (the
    # reads, each to a file of its own, run at once: tests/together.py)
    last, hour, future = (tmp_path / f"{name}.json" for name in ("last", "hour", "future"))
    r, r_hour, r_future, r_bad = pwctls(
        cluster, ["trace", "lasting", "--last", "4", "-o", str(last)],
        ["trace", "lasting", "--since", "1h", "-o", str(hour)],
        ["trace", "lasting", "--since", "2200-01-01T00:00:00Z", "-o", str(future)],
        ["trace", "lasting", "--since", "yesterday"])
    assert r.returncode == 0, r.stderr
    assert json.loads(last.read_text())["otherData"]["node_runs"] == 4
    assert f"the window holds 4 of the {resp.node_runs_total} node runs kept" in r.stderr
    r = r_hour
    assert r.returncode == 0 and json.loads(hour.read_text())["otherData"]["node_runs"] == resp.node_runs_total
    r = r_future
    assert r.returncode == 0 and json.loads(future.read_text())["otherData"]["node_runs"] == 0
    r = r_bad
    assert r.returncode == 2 and "neither a duration" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.cluster(islands=1, devices=2, controller_args=["--trace-retention", "1B"])
def test_trace_of_any_listed_job_says_what_there_is(cluster: LocalCluster, tmp_path: Path) -> None:
    """`pwctl trace JOB` for a job that ran no computation is an empty trace (exit 0); for one whose
    node runs the retention dropped (here 1 byte: every segment goes once written) the error says
    so, rather than "no node runs recorded ... `pwctl jobs list`" as for a job that does not exist."""
    quiet = tmp_path / "quiet.py"
    quiet.write_text("print('no computation')\n")
    busy = tmp_path / "busy.py"
    busy.write_text(CLIENT)
    # two independent jobs, submitted (and waited for) at once: tests/together.py
    assert [r.returncode for r in pwctls(cluster, ["submit", str(quiet)], ["submit", str(busy)])] == [0, 0]
    jobs = {j["name"]: j for j in cluster.pwctl_json("jobs", "list", "--all")["items"]}
    out = tmp_path / "t.json"
    r = cluster.pwctl("trace", jobs["quiet"]["id"], "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert f"job {jobs['quiet']['id']} has run no computations on the cluster (yet): its trace is empty" in r.stderr
    assert json.loads(out.read_text())["traceEvents"] == []
    job = jobs["busy"]["id"]
    assert jobs["busy"]["runs"] >= 12
    wait_for(lambda: cluster.pwctl("trace", job, "-o", str(out)).returncode == 3, 30, "its segments to go")
    r = cluster.pwctl("trace", job, "-o", str(out))
    assert r.stderr.strip() == (f"error: job {job} ran {jobs['busy']['runs']:,} program run(s), but none of its node "
                                "runs are kept any more: the controller keeps the newest up to `pwctl server start "
                                "--trace-retention` (default 512MiB), the oldest go first")
    r = cluster.pwctl("trace", "job-nothing")
    assert r.returncode == 3 and "no job or program 'job-nothing' has node runs recorded" in r.stderr
