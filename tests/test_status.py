"""Live status and traces.

Unit tests feed synthetic NodeEvents to the Observer (no network): utilization math, the
running node per device, computations per second, ring bounds, the trace builder and its
filters. End-to-end tests run a small pw program from a subprocess client against a real
local cluster, then drive `pwctl status`, `pwctl status --watch` and `pwctl trace` as a user.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import REPO, LocalCluster, wait_for
from together import pwctls, together

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.views import ClusterStatusView
from server.controller.errors import InvalidArgument, NotFound
from server.controller.observe import BucketWindow, NodeRun, Observer, TraceBuilder, _Ring, chrome_trace

S = 1_000_000_000  # ns


# ------------------------------------------------------------------ unit: a fake controller


@dataclass
class FakeHost:
    name: str
    island: str
    device_ids: list[int]
    state: str = "ready"


@dataclass
class FakeCluster:
    hosts: dict[str, FakeHost] = field(default_factory=dict)
    islands: dict[str, Any] = field(default_factory=dict)

    def island_protos(self) -> list[Any]:
        return []


def fake_core() -> Any:
    cluster = FakeCluster({"h0": FakeHost("h0", "a", [10, 11]), "h1": FakeHost("h1", "b", [20, 21])})
    return SimpleNamespace(cluster=cluster)


def fake_run(run_id: int, program: str, program_id: str, job: str = "", nodes: int = 2) -> Any:
    session = SimpleNamespace(client_id="c-1", job_id=job, owner=f"job:{job}" if job else "client:c-1")
    return SimpleNamespace(
        run_id=run_id,
        session=session,
        program=SimpleNamespace(name=program, program_id=program_id),
        plan=SimpleNamespace(segments=[SimpleNamespace(spec=SimpleNamespace(label=f"{program}/{i} f{i}"), size=1)
                                       for i in range(nodes)]),
    )


def started(run: Any, node: int, start: int, devices: list[int]) -> tuple[cpb.NodeEvent, Any]:
    ev = cpb.NodeEvent(run_id=run.run_id, segment=node, seq=node, start_ns=start, local_devices=devices)
    return ev, run


def finished(run: Any, node: int, start: int, end: int, devices: list[int], ok: bool = True,
             error: str = "") -> tuple[cpb.NodeEvent, Any]:
    return cpb.NodeEvent(run_id=run.run_id, segment=node, seq=node, start_ns=start, end_ns=end, ok=ok,
                         error=error, local_devices=devices), run


def thread_names(doc: dict[str, Any]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}


def feed(obs: Observer, host: str, *events: tuple[cpb.NodeEvent, Any]) -> None:
    for ev, run in events:
        obs.on_node_event(host, ev, run)


def test_bucket_window_spreads_spans_and_forgets_old_ones() -> None:
    w = BucketWindow(window_s=1.0, bucket_s=0.1)
    t0 = 100 * S
    w.add_span(t0, t0 + S // 4)  # 0.25 s busy over three buckets
    assert w.total(t0 + S // 2) == pytest.approx(S / 4)
    assert w.total(t0 + 3 * S) == 0  # fell out of the window
    w.add_span(t0 + 3 * S - 10 * S, t0 + 3 * S)  # longer than the window: only the window counts
    assert w.total(t0 + 3 * S) <= w.span_ns(t0 + 3 * S)
    w.add_point(t0 + 3 * S)
    w.add_point(t0)  # too old to count, and must not clobber a newer bucket
    assert w.total(t0 + 3 * S) == pytest.approx(w.span_ns(t0 + 3 * S) + 1, rel=0.2)


def test_utilization_running_node_and_rate() -> None:
    obs = Observer(fake_core().cluster, ring_size=100)
    run = fake_run(1, "step", "p-aaa")
    now = 1_000 * S
    # device 0 busy for 2 of the last 5 s (two 1 s nodes); device 1 idle
    feed(obs, "h0",
         started(run, 0, now - 4 * S, [0]), finished(run, 0, now - 4 * S, now - 3 * S, [0]),
         started(run, 1, now - 2 * S, [0]), finished(run, 1, now - 2 * S, now - 1 * S, [0]))
    assert obs.utilization("h0", 0, now) == pytest.approx(2 / 5, abs=0.03)
    assert obs.utilization("h0", 1, now) == 0.0
    assert obs.computations_total == 2
    assert obs.devices[("h0", 0)].running() is None

    # a pipelined launch: node 1 of run 2 was launched while node 0 still ran; its busy time
    # starts where node 0 ended, so the device is never counted busy twice
    run2 = fake_run(2, "step", "p-aaa")
    t = now + 10 * S
    feed(obs, "h0", started(run2, 0, t, [0, 1]), started(run2, 1, t, [0, 1]))
    assert obs.devices[("h0", 0)].running().label == "step/0 f0"  # type: ignore[union-attr]
    assert obs.utilization("h0", 0, t + S) == pytest.approx(1 / 5, abs=0.03)  # running node counts
    feed(obs, "h0", finished(run2, 0, t, t + S, [0, 1]))
    assert obs.devices[("h0", 0)].running().label == "step/1 f1"  # type: ignore[union-attr]
    feed(obs, "h0", finished(run2, 1, t, t + 2 * S, [0, 1]))
    assert obs.devices[("h0", 1)].running() is None
    assert obs.utilization("h0", 0, t + 2 * S) == pytest.approx(2 / 5, abs=0.03)
    assert obs.utilization("h0", 1, t + 2 * S) == pytest.approx(2 / 5, abs=0.03)
    recs = obs.records()
    assert [(r.start_ns, r.end_ns) for r in recs[-2:]] == [(t, t + S), (t + S, t + 2 * S)]  # clipped
    assert obs.utilization("h0", 0, t + 100 * S) == 0.0

    # computations per second: 30 finished nodes in the last 3 s
    obs2 = Observer(fake_core().cluster, ring_size=100)
    base = 5_000 * S
    for i in range(30):
        end = base + i * (S // 10)
        feed(obs2, "h1", finished(fake_run(100 + i, "p", "p-b"), 0, end - 1000, end, [0]))
    assert obs2.computations_per_s(base + 3 * S) == pytest.approx(10.0, rel=0.15)
    assert obs2.computations_per_s(base + 100 * S) == 0.0

    # a lost host runs nothing any more
    feed(obs, "h1", started(run, 0, t, [1]))
    obs.host_lost(SimpleNamespace(name="h1"), "gone")
    assert obs.devices[("h1", 1)].running() is None


def test_ring_is_bounded_and_selection_follows_it() -> None:
    obs = Observer(fake_core().cluster, ring_size=10)
    t = 10 * S
    for i in range(25):
        old = i < 12
        run = fake_run(i, "old" if old else "new", "p-old" if old else "p-new", job="j-1" if i < 5 else "")
        feed(obs, "h0", finished(run, 0, t + i * 1000, t + i * 1000 + 500, [0]))
    recs = obs.records()
    assert len(recs) == 10 and [r.run_id for r in recs] == list(range(15, 25))
    assert all(r.program_id == "p-new" and r.job == "" for r in recs)
    assert [r.run_id for r in obs.select(program="p-new")] == list(range(15, 25))
    with pytest.raises(NotFound, match="only the last 10 node runs"):
        obs.select(job="j-1")
    with pytest.raises(NotFound):
        obs.select(program="old")
    assert len(obs.select(program="new")) == 10


def test_ring_gives_back_every_field() -> None:
    ring = _Ring(3)
    for k in range(5):  # wraps around
        ring.append((f"h{k}", "isl", (0, k), f"p-{k}", f"prog{k}", f"job{k}", f"c{k}", f"label{k}", f"err{k}"),
                    (1 << 50 | k, k + 1, k + 2, k + 3, 10**18 + k, 2 * 10**18 + k, k % 2))
    assert [ring.record(s) for s in ring.slots()][-1] == NodeRun(
        host="h4", island="isl", devices=(0, 4), run_id=1 << 50 | 4, segment=5, size=6, seq=7, program_id="p-4",
        program="prog4", job="job4", client="c4", label="label4", start_ns=10**18 + 4, end_ns=2 * 10**18 + 4,
        ok=False, error="err4")
    assert [ring.record(s).run_id & 0xFF for s in ring.slots()] == [2, 3, 4]
    assert ring.shared_devices((0, 1)) is ring.shared_devices(tuple([0, 1]))


def test_trace_builder_and_filters() -> None:
    core = fake_core()
    obs = Observer(core.cluster, ring_size=1000)
    t = 50 * S
    a = fake_run(1, "train_step", "p-1111", job="job-7")
    b = fake_run(2, "train_step", "p-1111", job="job-7")
    c = fake_run(3, "evaluate", "p-2222")
    d = fake_run(4, "train_step", "p-3333")  # the same name, another signature
    feed(obs, "h0", finished(a, 0, t, t + 1000_000, [0, 1]), finished(a, 1, t, t + 3000_000, [0, 1]))
    feed(obs, "h1", finished(b, 0, t, t + 2000_000, [0]), finished(c, 0, t, t + 500_000, [1], ok=False,
                                                                    error="boom"))
    feed(obs, "h1", finished(d, 0, t + 5000_000, t + 6000_000, [0]))

    doc = json.loads(obs.trace(job="job-7"))
    assert doc["displayTimeUnit"] == "ms"
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 5  # two 2-device nodes on h0, one on h1
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert sorted(procs.values()) == ["a/h0", "b/h1"]
    threads = thread_names(doc)
    h0 = next(p for p, n in procs.items() if n == "a/h0")
    assert threads[(h0, 0)] == "device 0 (id 10)" and threads[(h0, 1)] == "device 1 (id 11)"
    first = min(xs, key=lambda e: (e["ts"], e["dur"]))
    assert first["ts"] == 0 and first["dur"] == 1000.0 and first["name"] == "train_step/0 f0"
    assert first["args"] == {"run_id": 1, "segment": 0, "nodes": 1, "program": "train_step", "program_id": "p-1111",
                             "job": "job-7", "client": "c-1", "seq": 0, "ok": True}
    # node 1 of run 1 was launched with node 0: on the device it starts when node 0 ended
    second = next(e for e in xs if e["args"]["run_id"] == 1 and e["args"]["segment"] == 1 and e["tid"] == 0)
    assert (second["ts"], second["dur"]) == (1000.0, 2000.0)

    assert len(json.loads(obs.trace(job="job"))["traceEvents"]) > 0  # unique prefix
    by_name = [e for e in json.loads(obs.trace(program="train_step"))["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["program_id"] for e in by_name} == {"p-1111", "p-3333"}  # every signature
    by_id = [e for e in json.loads(obs.trace(program="p-3"))["traceEvents"] if e["ph"] == "X"]
    assert [e["args"]["run_id"] for e in by_id] == [4]
    failed = [e for e in json.loads(obs.trace(program="eval"))["traceEvents"] if e["ph"] == "X"]
    assert failed[0]["args"]["ok"] is False and failed[0]["args"]["error"] == "boom"
    assert failed[0]["cat"] == "node,failed"
    both = [e for e in json.loads(obs.trace(job="job-7", program="p-1111"))["traceEvents"] if e["ph"] == "X"]
    assert len(both) == 5
    assert len([e for e in json.loads(obs.trace())["traceEvents"] if e["ph"] == "X"]) == 7

    with pytest.raises(NotFound, match="no events recorded for job 'nope'"):
        obs.trace(job="nope")
    with pytest.raises(NotFound, match="program 'nope'"):
        obs.trace(program="nope")
    with pytest.raises(NotFound):
        obs.trace(job="job-7", program="evaluate")  # both exist, nothing in common
    with pytest.raises(InvalidArgument, match="several programs"):
        obs.trace(program="p-")
    assert chrome_trace([])["traceEvents"] == []

    # the chunked encoder the servicer uses gives the same document, for every chunk size
    recs = obs.select()
    ids = {("h0", 0): 10, ("h0", 1): 11, ("h1", 0): 20, ("h1", 1): 21}
    for chunk in (1, 2, 1000):
        assert json.loads(asyncio.run(TraceBuilder(recs, ids).encode(chunk))) == chrome_trace(recs, ids)
    assert json.loads(asyncio.run(obs.trace_async(job="job-7"))) == json.loads(obs.trace(job="job-7"))
    assert json.loads(asyncio.run(TraceBuilder([]).encode()))["traceEvents"] == []


def test_events_of_unknown_runs_are_kept() -> None:
    obs = Observer(fake_core().cluster, ring_size=10)
    obs.on_node_event("h0", cpb.NodeEvent(run_id=9, segment=3, start_ns=S, end_ns=2 * S, ok=False,
                                          error="dropped", local_devices=[0]), None)
    (rec,) = obs.records()
    assert rec.label == "run 9 segment 3" and rec.program_id == "" and rec.job == "" and rec.island == "a"


# ------------------------------------------------------------------ end to end

CLIENT = textwrap.dedent("""
    import numpy as np
    import pwctl as pw

    s = pw.make_virtual_device_set().add_slice(2)

    def double(x):
        return x * 2.0

    def add_one(x):
        return x + 1.0

    f = pw.pmap(double, s.devices)
    g = pw.pmap(add_one, s.devices)

    @pw.program
    def step(x):
        return g(f(x))

    x = np.ones((2, 16), np.float32)
    for _ in range({standalone}):
        y = f(x)
    y.result()
    for _ in range({programs}):
        z = step(x)
    assert float(np.asarray(z.result())[0, 0]) == 3.0
    print("done", flush=True)
""")


def run_client(c: LocalCluster, standalone: int = 300, programs: int = 5) -> None:
    code = CLIENT.format(standalone=standalone, programs=programs)
    r = subprocess.run([sys.executable, "-c", code], env=c.env(), cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "done" in r.stdout, r.stdout + r.stderr


@pytest.fixture(scope="module")
def busy(module_cluster: LocalCluster) -> LocalCluster:
    """The module's cluster after the client ran: 300 standalone calls + 5 programs x 2 nodes."""
    run_client(module_cluster)

    def all_reported() -> bool:  # workers report node events in batches, off the hot path
        with module_cluster.client() as c:
            return c.status().computations_total >= 310

    wait_for(all_reported, 30, "the workers to report every node run")
    return module_cluster




BUSY_CLIENT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import numpy as np
    import pwctl as pw

    stop = Path(sys.argv[1])
    f = pw.pmap(lambda x: x * 2.0, pw.make_virtual_device_set().add_slice(2).devices)
    x = np.ones((2, 16), np.float32)
    while not stop.exists():  # computes until the test has seen the rate
        for _ in range(50):
            y = f(x)
        y.result()
    print("done", flush=True)
""")


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_rate_follows_activity(busy: LocalCluster, tmp_path: Path) -> None:
    """While a client computes, status reports a positive rate; once nothing ran for the rate's
    window it reports 0 (also in `pwctl status -o json`)."""
    stop = tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, "-c", BUSY_CLIENT, str(stop)], env=busy.env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with busy.client() as c:
            wait_for(lambda: c.status().computations_per_s > 0, 60, "a positive rate while computing")
            stop.write_text("stop")
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0 and "done" in out, err[-3000:]
            wait_for(lambda: c.status().computations_per_s == 0.0, 30, "the rate to fall to 0 when idle")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert busy.pwctl_json("status")["computations_per_s"] == 0.0


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_status_json_snapshot(busy: LocalCluster) -> None:
    # the document and the screen piped at 80 columns: two reads, run at once (tests/together.py)
    doc, r = together(lambda: busy.pwctl_json("status"), lambda: busy.pwctl("status", COLUMNS="80"))
    assert doc["apiVersion"] == "pathways/v1" and doc["kind"] == "ClusterStatus"
    assert doc["at"].endswith("Z")
    assert sorted(i["name"] for i in doc["islands"]) == ["a", "b"]
    assert len(doc["devices"]) == 4
    for d in doc["devices"]:
        assert {"device_id", "island", "host", "local_index", "state", "utilization", "running"} <= set(d)
        assert 0.0 <= d["utilization"] <= 1.0 and d["state"] == "available"
    assert doc["computations_total"] >= 310  # 300 standalone + 5 programs x 2 nodes
    assert isinstance(doc["computations_per_s"], float)  # its value: test_rate_follows_activity
    assert sorted(q["island"] for q in doc["queues"]) == ["a", "b"]
    assert all(q["policy"] and isinstance(q["entries"], list) for q in doc["queues"])
    assert isinstance(doc["slices"], list) and isinstance(doc["jobs"], list)
    ClusterStatusView.model_validate(doc)  # the documented shape

    assert sorted(i["name"] for i in doc["island_status"]) == ["a", "b"]
    assert doc["hosts_total"] == 2 and doc["devices_total"] == 4 and doc["next_page_token"] == ""
    assert all({"running", "waiting", "stalled", "longest_wait_s"} <= set(q) for q in doc["queues"])

    # piped at 80 columns: every line fits, every device row is one line
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), r.stdout
    assert lines[0].startswith(busy.address) and "computations/s" in r.stdout and "UTIL" in r.stdout
    header = next(i for i, line in enumerate(lines) if line.startswith("HOST "))
    rows = lines[header + 1: header + 3]
    assert all(re.match(r"w-[ab] +\d", row) for row in rows), r.stdout


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_status_json_pages_devices(busy: LocalCluster) -> None:
    """`status -o json --limit N` is one page of devices (island summaries still count all of them);
    `--page-token` continues; the pages together are every device once, in order."""
    seen: list[tuple[str, str, int]] = []
    token = ""
    for _ in range(5):
        r = busy.pwctl("status", "-o", "json", "--limit", "3", *(["--page-token", token] if token else []))
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert len(doc["devices"]) <= 3 and doc["devices_total"] == 4
        assert sum(i["devices"] for i in doc["island_status"]) == 4
        seen += [(d["island"], d["host"], d["local_index"]) for d in doc["devices"]]
        token = doc["next_page_token"]
        if not token:
            break
        assert "--page-token" in r.stderr  # says how to get the rest
    assert seen == sorted(seen) and len(set(seen)) == 4
    bad, table = pwctls(busy, ["status", "-o", "json", "--page-token", "not-a-token"], ["status", "--limit", "2"])
    assert bad.returncode == 2 and "invalid page token" in bad.stderr, bad.stderr
    assert table.returncode == 2 and "only with -o json" in table.stderr


def read_lines(proc: subprocess.Popen[str], n: int, deadline_s: float) -> Iterator[str]:
    deadline = time.monotonic() + deadline_s
    assert proc.stdout is not None
    got = 0
    while got < n and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return
        got += 1
        yield line


@pytest.mark.cluster
@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [["-o", "json"], []], ids=["json", "piped"])
def test_watch_streams_json_lines(busy: LocalCluster, flags: list[str]) -> None:
    args = [sys.executable, "-m", "pwctl.cli.main", "status", "--watch", "--interval", "0.2", *flags]
    proc = subprocess.Popen(args, env=busy.env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        lines = list(read_lines(proc, 3, 60))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert len(lines) >= 2, proc.stderr.read() if proc.stderr else ""
    docs = [json.loads(line) for line in lines]
    assert all(d["kind"] == "ClusterStatus" and len(d["devices"]) == 4 for d in docs)
    assert docs[0]["at"] < docs[-1]["at"]


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_trace_of_a_program(busy: LocalCluster, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    # the program's trace and the standalone calls' (below): two reads, run at once (tests/together.py)
    r, standalone = pwctls(busy, ["trace", "step", "-o", str(out)],
                           ["trace", "double", "-o", str(tmp_path / "double.json")])
    assert r.returncode == 0, r.stderr
    assert "node runs" in r.stderr and "perfetto" in r.stderr.lower()
    doc = json.loads(out.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    # 5 runs x 2 devices (pmap over a 2-device slice): a run's 2 nodes share their devices, so they
    # run as one segment (one fused computation) and show as one span naming both
    assert len(xs) == 10
    assert {e["name"] for e in xs} == {"step/0-1 (double, add_one)"}
    assert all(e["args"]["nodes"] == 2 for e in xs)
    assert all(e["dur"] >= 0 and e["args"]["program"] == "step" and e["args"]["ok"] for e in xs)
    names = thread_names(doc)
    assert len(names) == 2 and all(n.startswith("device ") for n in names.values())
    assert {(e["pid"], e["tid"]) for e in xs} == set(names)
    # every device's timeline is a sequence: no two node runs overlap on one device
    for key in names:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs if (e["pid"], e["tid"]) == key)
        assert all(a[1] <= b[0] + 1e-3 for a, b in itertools.pairwise(spans))

    # by program id (a unique prefix of it), to stdout
    pid = xs[0]["args"]["program_id"]
    r = busy.pwctl("trace", pid[:10], "-o", "-")
    assert r.returncode == 0, r.stderr
    assert len([e for e in json.loads(r.stdout)["traceEvents"] if e["ph"] == "X"]) == 10

    # the standalone calls are one-node programs named after their function
    assert standalone.returncode == 0, standalone.stderr
    ds = [e for e in json.loads((tmp_path / "double.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(ds) == 600  # 300 calls x 2 devices


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_trace_of_an_unknown_id_exits_3(busy: LocalCluster, tmp_path: Path) -> None:
    out = tmp_path / "nothing.json"
    r = busy.pwctl("trace", "no-such-thing", "-o", str(out))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "no job or program 'no-such-thing' has node runs recorded" in r.stderr
    assert not out.exists()


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_trace_and_status_of_a_job(busy: LocalCluster, tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(CLIENT.format(standalone=20, programs=3))
    r = busy.pwctl("submit", str(script), "-d")
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().splitlines()[-1]
    r = busy.pwctl("wait", job, timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr

    doc = busy.pwctl_json("status")
    assert job in {j["id"] for j in doc["jobs"]}

    # workers report node events in batches, off the hot path: the last may trail the job's end
    out = tmp_path / "job.json"

    def complete() -> list[dict[str, Any]] | None:
        r = busy.pwctl("trace", job, "-o", str(out))
        assert r.returncode == 0, r.stderr
        assert f"of job {job}" in r.stderr
        xs = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
        return xs if len(xs) == (20 + 3) * 2 else None  # a program's 2 nodes are one segment

    xs = wait_for(complete, 30, "every node run of the job in its trace", interval=0.5)
    assert {e["args"]["job"] for e in xs} == {job}
    assert {e["args"]["program"] for e in xs} == {"double", "step"}


# ------------------------------------------------------------------ the screen, drawn offline


def synthetic_status(hosts: int = 2048, per_host: int = 8, page: int = 1024, jobs: int = 30, stuck: int = 3,
                     waiting: int = 50) -> ClusterStatusView:
    """A big cluster's update as the screen asks for it: one page of devices, counts over all."""
    islands = 16
    devices = []
    for k in range(page):
        h, local = divmod(k, per_host)
        busy = h % 3 == 0 and local < 4
        devices.append(cpb.DeviceStatus(
            device_id=k, island=f"isl-{h % islands:02d}", host=f"host-{h:05d}", local_index=local,
            state=1, utilization=0.75 if busy else 0.0, running="train/0-3 (step, a_very_long_function_name)"
            if busy else "", job="job-1a2b3c" if busy else "", idle_s=0.0 if busy else -1.0, host_state="ready"))
    queues = []
    for i in range(islands):
        q = cpb.IslandQueue(island=f"isl-{i:02d}", policy="fifo", running=4, waiting=waiting // islands)
        for n in range(2):
            q.entries.add(program="train", client="c-1", job="job-1a2b3c", state="waiting", run_id=i * 100 + n,
                          waiting_s=1.5 * (i + n), reason="no room in the island's window")
        if i < stuck:
            q.entries.add(program="evaluate", client="c-2", job="job-9f8e7d", state="running", run_id=9000 + i,
                          stalled_host=f"host-{i:05d}", stalled_s=6.0 + i,
                          reason=f"node 0 of program evaluate: host host-{i:05d} has not started it for {6 + i}.0 s")
            q.stalled = 1
        queues.append(q)
    m = cpb.ClusterStatus(
        at="2026-11-25T14:00:00.000Z", devices=devices, queues=queues, computations_per_s=12345.6,
        computations_total=10**9, hosts_total=hosts, devices_total=hosts * per_host, next_page_token="tok",
        jobs_running=jobs // 2)
    for i in range(islands):
        m.islands.add(name=f"isl-{i:02d}", hosts=hosts // islands, devices=hosts * per_host // islands,
                      available_devices=hosts * per_host // islands)
        m.island_status.add(name=f"isl-{i:02d}", hosts=hosts // islands, hosts_ready=hosts // islands,
                            hosts_stalled=1 if i < stuck else 0, devices=hosts * per_host // islands,
                            devices_available=hosts * per_host // islands, devices_busy=40, utilization=0.3)
    for j in range(jobs):
        m.jobs.add(id=f"job-{j:06x}", name=f"train-{j}", state=cpb.JOB_STATE_RUNNING if j < jobs // 2
                   else cpb.JOB_STATE_SUCCEEDED, submitted_at="2026-11-25T13:00:00Z")
    m.slices.add(name="train", state=cpb.SLICE_STATE_READY, programs=3, owner="job:job-1a2b3c")
    return ClusterStatusView.of(m)


def screen_lines(view: ClusterStatusView, width: int, height: int | None) -> list[str]:
    import io

    from rich.console import Console

    from pwctl.cli.status import render

    out = io.StringIO()
    console = Console(file=out, width=width, height=height or 1000, no_color=True, color_system=None)
    console.print(render(view, width, height, "10.0.0.5:7070"), crop=True)
    return out.getvalue().rstrip("\n").split("\n")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("width", "height"), [(80, 24), (160, 45), (60, 12), (200, 60)])
def test_screen_of_a_big_cluster_fits_and_summarises(width: int, height: int) -> None:
    lines = screen_lines(synthetic_status(), width, height)
    assert len(lines) <= height and all(len(line) <= width for line in lines), "\n".join(lines)
    text = "\n".join(lines)
    assert lines[0].startswith("10.0.0.5:7070 14:00:00Z") and "16 islands" in lines[0]
    assert "hosts 2,048/2,048 ready, 3 stalled" in text and "12,346 computations/s" in text
    # the stuck gangs come first, the longest held first, each with its host and for how long
    first_stuck = next(i for i, line in enumerate(lines) if line.startswith("STUCK"))
    assert first_stuck <= 4 and lines[first_stuck].startswith("STUCK for 8.0s: host host-00002 holds back"), text
    assert not any(line.startswith(("ISLAND", "HOST", "JOB", "...")) for line in lines[:first_stuck]), text
    # the devices not shown are summarised
    assert re.search(r"\.\.\. and [\d,]+ more hosts", text) or "devices: 16,384 on 2,048 hosts" in text, text
    if height >= 24:
        assert re.search(r"\.\.\. and [\d,]+ more hosts", text), text
        assert "HOST" in text and "JOB " in text  # devices and jobs get rows even at 80x24
        devices = [line for line in lines if line.startswith("host-")]
        assert devices and all(re.match(r"host-\d{5} +\d", line) for line in devices)
    if height >= 45:
        assert "WAITING " in text and "SLICE " in text  # there is room for the queues' longest waits


@pytest.mark.timeout(30)
def test_watch_writes_each_frame_as_one_synchronized_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """A terminal that supports synchronized output (DEC mode 2026) never shows a half-drawn frame:
    every frame `--watch` draws lies between a begin and an end of it, and nothing is drawn outside."""
    import io

    from rich.console import Console

    from pwctl.cli import common, status

    out = io.StringIO()
    console = Console(file=out, width=160, height=45, force_terminal=True, color_system="standard")
    monkeypatch.setattr(common, "stdout", lambda: console)
    views = [synthetic_status() for _ in range(3)]
    status._live(iter(views), "10.0.0.5:7070")
    raw = out.getvalue()
    frames = raw.split(status.BEGIN_SYNC)
    # Live's set-up before the first frame (the alternate screen), then one per update; each
    # part holds exactly one end, and what follows the end is at most Live's tear-down
    assert len(frames) == 1 + len(views), len(frames)
    assert status.END_SYNC not in frames[0]
    for part in frames[1:]:
        inside, end, after = part.partition(status.END_SYNC)
        assert end and "16 islands" in inside and "computations/s" in inside
        assert "islands" not in after


def test_screen_layout_gives_every_section_a_share_first() -> None:
    from pwctl.cli.status.layout import Section, allocate

    secs = [Section("a", 50, first=4), Section("b", 3, first=3), Section("c", 0, first=2)]
    left = allocate(secs, 12)
    assert [s.shown for s in secs] == [6, 3, 0] and left == 0  # a: header 6 more; b: header 3
    assert sum(s.cost() for s in secs) == 12
    allocate(secs, None)
    assert [s.shown for s in secs] == [50, 3, 0]
    allocate(secs, 3)  # too small for rows: one summary line per section
    assert [s.shown for s in secs] == [0, 0, 0] and sum(s.cost() for s in secs) == 2


@pytest.mark.timeout(30)
def test_one_shot_screen_without_a_height_shows_the_whole_update() -> None:
    view = synthetic_status(hosts=4, per_host=2, page=8, jobs=2, stuck=1, waiting=16)
    lines = screen_lines(view, 80, None)
    text = "\n".join(lines)
    assert all(len(line) <= 80 for line in lines)
    assert "more hosts" not in text and "... and" not in text.replace("... and 0", "")
    assert sum(1 for line in lines if line.startswith("host-")) >= 2 and "SLICE " in text


# ------------------------------------------------------------------ the status update, built offline


@dataclass
class IndexedCluster(FakeCluster):
    """FakeCluster with the per-island index the status update pages through."""

    def host_names(self, island: str) -> list[str]:
        return sorted(h.name for h in self.hosts.values() if h.island == island)

    def hosts_of(self, island: str) -> list[FakeHost]:
        return [h for h in self.hosts.values() if h.island == island]


def indexed_cluster() -> IndexedCluster:
    hosts = {"h0": FakeHost("h0", "a", [10, 11]), "h1": FakeHost("h1", "b", [20, 21])}
    return IndexedCluster(hosts, {"a": None, "b": None})


@pytest.mark.timeout(30)
def test_a_busy_device_names_what_it_runs_and_its_job() -> None:
    """RUNNING is never empty while utilization is above 0: a device shows the node on it or,
    between nodes, the last one, with how long ago it ended; idle for the whole window, nothing."""
    from server.controller.status_view import StatusQuery

    obs = Observer(indexed_cluster(), ring_size=100)
    run = fake_run(1, "step", "p-aaa", job="job-42")
    now = time.time_ns()
    feed(obs, "h0", finished(run, 0, now - S // 2, now - S // 4, [0]))  # ended 0.25 s ago
    feed(obs, "h1", finished(run, 1, now - 20 * S, now - 19 * S, [1]))  # long before the window
    feed(obs, "h0", started(run, 1, now - S // 10, [1]))  # on device 1 now
    snap = obs.snapshot()
    devices = {(d.host, d.local_index): d for d in snap.devices}
    d0, d1 = devices[("h0", 0)], devices[("h0", 1)]
    assert d0.utilization > 0 and d0.running == "step/0 f0" and d0.job == "job-42" and 0 < d0.idle_s < 5
    assert d1.running == "step/1 f1" and d1.idle_s == 0.0 and d1.job == "job-42"
    old = devices[("h1", 1)]
    assert old.utilization == 0 and old.running == "" and old.idle_s > 15
    assert devices[("h1", 0)].idle_s == -1.0 and devices[("h1", 0)].running == ""  # never ran anything
    for d in snap.devices:
        assert d.running or d.utilization == 0, d
        assert d.host_state == "ready"
    assert snap.hosts_total == 2

    # one page at a time, in (island, host, local index) order
    first = obs.snapshot(StatusQuery(device_limit=3))
    assert [(d.host, d.local_index) for d in first.devices] == [("h0", 0), ("h0", 1), ("h1", 0)]
    rest = obs.snapshot(StatusQuery(device_limit=3, page_token=first.next_page_token))
    assert [(d.host, d.local_index) for d in rest.devices] == [("h1", 1)] and rest.next_page_token == ""


@pytest.mark.timeout(30)
def test_queues_count_every_gang_and_keep_the_longest_waits() -> None:
    from server.controller.status_view import StatusQuery
    from server.scheduler import GangScheduler, NodeSpec, RunSpec, Submit

    sched = GangScheduler(max_inflight_nodes=1, debug=False)
    t0 = time.monotonic()
    for rid in range(1, 5):  # one admitted (the window holds one node), three waiting
        node = NodeSpec(0, "h0", "a", (0,), (), "n0")
        sched.handle(Submit(RunSpec(rid, f"p{rid}", f"c{rid}", f"job-{rid}", (node,)), now=t0 - 10 + rid))
    obs = Observer(indexed_cluster(), ring_size=10, scheduler=sched)
    full = {q.island: q for q in obs.snapshot().queues}
    a = full["a"]
    assert (a.running, a.waiting, a.stalled) == (1, 3, 0) and len(a.entries) == 4
    assert a.longest_wait_s == pytest.approx(8.0, abs=1.0)  # run 2, submitted ~8 s ago
    assert full["b"].running == full["b"].waiting == 0 and not full["b"].entries
    limited = {q.island: q for q in obs.snapshot(StatusQuery(queue_limit=2)).queues}["a"]
    assert (limited.running, limited.waiting) == (1, 3)  # the counts still cover every gang
    assert [e.run_id for e in limited.entries] == [2, 3]  # the longest waiting first
    assert all(e.state == "waiting" and e.waiting_s > 0 for e in limited.entries)
    with pytest.raises(InvalidArgument, match="invalid page token"):
        StatusQuery.of(cpb.WatchRequest(page_token="garbage"))


@pytest.mark.timeout(30)
def test_waiting_gangs_of_one_client_share_a_row_without_run_ids() -> None:
    """A client's pipelined runs wait behind each other: the longest waits are one row per
    program, job and reason, with how many runs it stands for (12 rows of the same thing pushed
    everything else off the screen), and no 64-bit run id pads the reasons."""
    m = cpb.ClusterStatus(at="2026-11-25T14:00:00.000Z", hosts_total=1, devices_total=2, jobs_running=2)
    m.island_status.add(name="a", hosts=1, hosts_ready=1, devices=2, devices_available=2)
    q = m.queues.add(island="a", policy="fifo", running=1, waiting=14)
    q.entries.add(program="step", client="c-1", job="job-1", state="waiting", run_id=2**62 + 1, waiting_s=3.0,
                  reason="window full: 2 nodes in flight on island a")
    for n in range(12):
        q.entries.add(program="step", client="c-1", job="job-1", state="waiting", run_id=2**62 + 2 + n,
                      waiting_s=2.9 - n / 10, reason="behind an earlier run of the same client")
    q.entries.add(program="eval", client="c-2", job="job-2", state="waiting", run_id=2**62 + 99, waiting_s=1.0,
                  reason="behind an earlier run of step (job-1)")
    lines = screen_lines(ClusterStatusView.of(m), 120, 30)
    header = next(i for i, line in enumerate(lines) if line.startswith("WAITING "))
    assert lines[header].split() == ["WAITING", "ISLAND", "PROGRAM", "JOB", "RUNS", "PRIORITY", "WHY"]
    rows = [line.rstrip().split(None, 6) for line in lines[header + 1:]]
    assert rows == [["3.0s", "a", "step", "job-1", "1", "0", "window full: 2 nodes in flight on island a"],
                    ["2.9s", "a", "step", "job-1", "12", "0", "behind an earlier run of the same client"],
                    ["1.0s", "a", "eval", "job-2", "1", "0", "behind an earlier run of step (job-1)"]], lines
    assert not any(str(2**62)[:6] in line for line in lines)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("width", "height"), [(80, 24), (160, 45)])
def test_the_json_document_carries_everything_the_screen_shows(width: int, height: int) -> None:
    """The screen is drawn from the ClusterStatus document alone: the same screen comes back from
    what `status -o json` printed."""
    from schemas.views import dump

    view = synthetic_status(hosts=64, per_host=4, page=256, jobs=6, stuck=2, waiting=32)
    again = ClusterStatusView.model_validate_json(dump(view))
    assert again == view
    assert screen_lines(again, width, height) == screen_lines(view, width, height)
