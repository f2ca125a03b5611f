"""The Prometheus endpoint: scraped from a real controller before and after a program ran, the
bearer token check, the address flag, and the Grafana dashboard against the metrics served."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO, LocalCluster, wait_for
from prometheus_client.parser import text_string_to_metric_families
from together import pwctls

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
from server.credentials import KEY_FILE, PEER_HEADER, peer_credential

DASHBOARD = REPO / "deploy" / "grafana" / "pathways.json"
DOC = REPO / "docs" / "metrics.md"

CLIENT = textwrap.dedent("""
    import numpy as np
    import pwctl as pw

    s = pw.make_virtual_device_set().add_slice(2, island="a")
    f = pw.pmap(lambda x: x * 2.0, s.devices)
    g = pw.pmap(lambda x: x + 1.0, s.devices)

    @pw.program
    def step(x):
        return g(f(x))

    x = np.ones((2, 4), np.float32)
    for _ in range(20):
        z = step(x)
    assert float(np.asarray(z.result())[0, 0]) == 3.0
    print("done", flush=True)
""")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, token: str | None = None) -> Samples:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def status_of(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def metrics_url(c: LocalCluster) -> str:
    """Where `pwctl server info -o json` says the metrics are."""
    info = c.pwctl_json("server", "info")["item"]
    url = str(info["metrics_url"])
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics"), url
    return url


@pytest.fixture(scope="module")
def metrics_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """2 islands x 2 devices serving metrics on a free port, for the tests that only run programs
    and scrape (starting a cluster takes seconds); its logs are checked for broken invariants when
    the module ends."""
    with LocalCluster(tmp_path_factory.mktemp("metrics"), controller_args=["--metrics-listen", "127.0.0.1:0"]) as c:
        c.start([("a", 2), ("b", 2)])
        yield c


@pytest.mark.cluster  # (metrics_cluster's; the first test on it: nothing ran before)
def test_scraping_a_real_controller_before_and_after_a_program_ran(metrics_cluster: LocalCluster) -> None:
    cluster = metrics_cluster
    url = metrics_url(cluster)
    before = scrape(url, cluster.token)
    assert value(before, "pathways_hosts", island="a", state="ready") == 1
    assert value(before, "pathways_hosts", island="b", state="stalled") == 0
    assert value(before, "pathways_devices", island="b", state="available") == 2
    assert value(before, "pathways_runs_total", outcome="ok") == 0
    assert value(before, "pathways_run_latency_seconds_count") == 0
    assert value(before, "pathways_jobs", state="running") == 0
    info = next(k for k in before if k[0] == "pathways_info")
    assert dict(info[1])["dispatch"] == "parallel" and dict(info[1])["policy"] == "fifo"

    r = subprocess.run([sys.executable, "-c", CLIENT], env=cluster.env(), cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "done" in r.stdout, r.stdout + r.stderr

    def finished(s: Samples) -> float:
        return value(s, "pathways_runs_total", outcome="ok") + value(s, "pathways_runs_total", outcome="failed")

    def reported() -> Samples | None:  # workers report node events in batches, off the hot path
        s = scrape(url, cluster.token)
        return s if value(s, "pathways_computations_total") >= 40 and finished(s) >= 20 else None

    after = wait_for(reported, 30, "the computations and runs to be counted")
    # a client exiting right after its last fetch waits (up to 2 s) for its runs' reports; one it
    # stopped waiting for is cancelled with the session and counts as failed
    runs = finished(after)
    assert value(after, "pathways_runs_total", outcome="ok") >= 10
    assert value(after, "pathways_run_latency_seconds_count") == runs
    assert value(after, "pathways_admission_wait_seconds_count") == runs
    assert value(after, "pathways_run_latency_seconds_bucket", le="+Inf") == runs
    assert value(after, "pathways_run_latency_seconds_sum") > 0
    assert value(after, "pathways_queue_runs", island="a", state="waiting") == 0
    assert value(after, "pathways_hangs_detected_total") == 0
    assert value(after, "pathways_slices") == 0  # the client's slice went with it
    assert value(after, "pathways_uptime_seconds") > value(before, "pathways_uptime_seconds")

    # the dashboard asks only for what is served
    served = {name for name, _ in after}
    used = set(re.findall(r"\bpathways_[a-z_]+", json.dumps(json.loads(DASHBOARD.read_text()))))
    assert used and used <= served, sorted(used - served)
    # and the documentation's table names every family served
    families = {re.sub(r"_(bucket|sum|count|created)$", "", n) for n in served}
    documented = set(re.findall(r"`(pathways_[a-z_]+)`", DOC.read_text()))
    assert families <= documented, sorted(families - documented)
    assert status_of(url.replace("/metrics", "/nothing"), {"Authorization": f"Bearer {cluster.token}"}) == 404
    info_r, table_r = pwctls(cluster, ["server", "info", "-o", "json"], ["server", "info"])  # at once
    assert info_r.returncode == 0, info_r.stderr
    info = json.loads(info_r.stdout)["item"]
    assert info["policy"] == "fifo" and info["jobs"] == 0 and info["jobs_total"] == 0
    table = table_r.stdout
    assert url in table and "fifo" in table


@pytest.mark.cluster(islands=2, devices=1, controller_args=["--metrics-listen", "127.0.0.1:0"])
def test_a_workers_unfinished_gatherings_show_in_its_stats_and_in_the_metrics(cluster: LocalCluster) -> None:
    """A member of a multi-host slice sent its part of an array to worker a, whose other parts
    never come: the worker's Stats and the controller's metrics show the entry and its bytes."""
    url = metrics_url(cluster)
    before = scrape(url, cluster.token)
    for name in ("pathways_worker_gathering", "pathways_worker_gathering_bytes"):
        assert value(before, name, island="a") == 0 and value(before, name, island="b") == 0
    address = cluster.hosts()["w-a"].address
    key = bytes.fromhex((cluster.home / KEY_FILE).read_text().strip())
    peer = ((PEER_HEADER, peer_credential(key)),)  # (the channel carries the cluster token)
    part = np.arange(4, dtype=np.float32)  # [0, 4) of a (16,) array: three quarters never come
    chunk = wpb.TransferChunk(buffer_id=(9 << 40) + 1, last=True, part_start=[0], global_shape=[16],
                              array=pb.ArrayProto(dtype="float32", shape=[4], data=part.tobytes()))
    with cluster.channel(address) as ch:
        stub = wgrpc.WorkerStub(ch)
        assert stub.Transfer(iter([chunk]), metadata=peer, timeout=10).bytes == 0  # stored nothing yet
        st = stub.Stats(wpb.WorkerStatsRequest(), timeout=10)
    assert (st.gathering, st.gathering_bytes) == (1, 16 * 4), st

    def beat_reported() -> Samples | None:  # the worker's next heartbeat carries it
        s = scrape(url, cluster.token)
        return s if value(s, "pathways_worker_gathering", island="a") == 1 else None

    after = wait_for(beat_reported, 30, "the worker's heartbeat to report the gathering")
    assert value(after, "pathways_worker_gathering_bytes", island="a") == 16 * 4
    assert value(after, "pathways_worker_gathering", island="b") == 0
    assert value(after, "pathways_worker_gathering_bytes", island="b") == 0
    assert value(after, "pathways_worker_buffers", island="a") == 0  # an unfinished array is no buffer yet
    assert value(after, "pathways_worker_buffer_bytes", island="b") == 0


@pytest.mark.cluster  # (metrics_cluster's: scrapes change nothing)
def test_a_scrape_needs_the_token_as_a_bearer_token(metrics_cluster: LocalCluster) -> None:
    cluster = metrics_cluster
    url = metrics_url(cluster)
    token = cluster.token
    assert token
    assert status_of(url) == 401
    assert status_of(url, {"Authorization": "Bearer wrong"}) == 401
    assert status_of(url, {"Authorization": token}) == 401  # the scheme is part of it
    assert value(scrape(url, token), "pathways_hosts", island="a", state="ready") == 1
    assert "metrics scrape refused: missing bearer token" in cluster.controller_logs()
    assert "Traceback" not in cluster.controller_logs()


def test_metrics_flag_errors_are_one_line(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "server.controller", "--listen", "127.0.0.1:0",
            "--db", f"sqlite:///{tmp_path / 'db.sqlite'}"]
    r = subprocess.run([*base, "--metrics-listen", "nowhere"], capture_output=True, text=True, timeout=60,
                       cwd=REPO)
    assert r.returncode == 2 and "--metrics-listen: invalid address 'nowhere'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_metrics_off_shows_in_server_info(make_cluster: Any) -> None:
    c = make_cluster(islands=1, devices=1, controller_args=["--metrics-listen", "off"])
    info, table = pwctls(c, ["server", "info", "-o", "json"], ["server", "info"])  # two reads, at once
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["item"]["metrics_url"] == ""
    assert re.search(r"^metrics\s+off\s*$", table.stdout, re.M)
