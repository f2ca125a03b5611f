"""Smoke test of the benchmark package: one cheap benchmark (dispatch, inc1, OpByOp, a handful of
calls) against a real cluster, in a client subprocess. Checks the result row's fields, never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import LocalCluster
from hosts import hosts  # noqa: F401  (the fixture)

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.cluster(islands=1, devices=1), pytest.mark.timeout(60)]

SNIPPET = """
import json
from bench import pwside, suites
v = pwside.dispatch("inc1", "opbyop", budget_s=0.05, count=8)
print(json.dumps(suites.row("dispatch", "inc1/opbyop", "computations/s", "1/s", v, 1.0, ">= 5,000/s", v >= 5000)))
"""


def test_dispatch_row_has_the_fields(module_cluster: LocalCluster) -> None:
    r = subprocess.run([sys.executable, "-c", SNIPPET], env=module_cluster.env(PYTHONPATH=str(REPO)), cwd=REPO,
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("bench", "variant", "metric", "unit", "pathways", "jax", "ratio", "paired", "target", "meets", "notes"):
        assert key in out
    assert out["bench"] == "dispatch" and out["pathways"] > 0 and isinstance(out["meets"], bool)


def test_paired_ratio_pairs_each_window_with_the_jax_window_beside_it() -> None:
    from bench import suites
    from bench.__main__ import COLUMNS, table_rows

    # the machine slowed down for the second pair and sped up during the third Pathways window:
    # the medians of the two sides (80 and 60) come from different pairs, the paired ratio does not
    pw, jx = [90.0, 45.0, 80.0], [100.0, 50.0, 60.0]
    assert suites.paired_ratio(pw, jx) == pytest.approx(0.9)
    assert suites.row("x", "y", "m", "1/s", 80.0, 60.0)["ratio"] == pytest.approx(80 / 60)
    assert suites.paired_ratio([1.0], [0.0]) is None  # no usable pair
    assert suites.paired_ratio([], []) is None
    r = suites.row("pipeline", "4 stages/parallel", "micro-batches/s", "1/s", 90.0, 100.0, paired=0.93)
    cells = dict(zip(COLUMNS, table_rows([r])[0], strict=True))
    assert cells["ratio"] == "0.90x" and cells["paired"] == "0.93x"
    assert dict(zip(COLUMNS, table_rows([suites.row("costs", "x", "m", "s", 1.0)])[0], strict=True))["paired"] == ""


def test_multihost_says_why_it_skips(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`python -m bench --only multihost` where namespaces cannot be made: one row with the reason."""
    from bench import netns
    from bench.__main__ import main

    monkeypatch.setattr(netns, "unavailable", lambda: "no namespaces in this test")
    assert main(["--only", "multihost", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "multihost-latest.jsonl").read_text().splitlines()]
    assert rows[0]["bench"] == "multihost" and rows[0]["notes"] == "skipped: no namespaces in this test"
    assert "error" not in rows[0] and "machine" in rows[-1]
    assert "skipped" in (tmp_path / "multihost-latest.md").read_text()


def test_multihost_sides_move_bytes_between_hosts(hosts: Any) -> None:  # noqa: F811
    """The suite's raw TCP pair and its gRPC stream pair (server/worker/transfer.py's chunks, several
    per array) between two namespace hosts: fields only, never timings."""
    from bench.multihost import Side, _stop
    from server.worker.transfer import TRANSFER_CHUNK

    h0, h1 = hosts(2)
    nbytes = 3 * TRANSFER_CHUNK + 4096  # four chunks, the last one short
    recv = Side(h1, "tcp_recv", {"ip": h1.ip, "nbytes": nbytes})
    sides = [recv]
    try:
        port = recv.read(30)["port"]
        sides.append(Side(h0, "tcp_send", {"ip": h1.ip, "port": port, "nbytes": nbytes}))
        assert recv.read(30) == {"ready": True}
        assert recv.ask("go", 30)["s"] > 0
        stream = Side(h1, "stream_recv", {"ip": h1.ip})
        sides.append(stream)
        port = stream.read(30)["port"]
        sides.append(send := Side(h0, "stream_send", {"address": f"{h1.ip}:{port}", "nbytes": nbytes,
                                                      "variants": [[TRANSFER_CHUNK, "current"]], "rounds": 1,
                                                      "reps": 1}))
        out = send.read(45)  # it checks that the receiver got every byte
        assert set(out) == {f"{TRANSFER_CHUNK} current"} and out[f"{TRANSFER_CHUNK} current"]["s"] > 0
        calls = [stream.read(10) for _ in range(2)]  # the warm-up and the timed call
        assert [c["messages"] for c in calls] == [4, 4]
    finally:
        _stop(*sides)


def test_the_pipeline_side_of_the_multihost_a_b_serves_windows(hosts: Any) -> None:  # noqa: F811
    """bench.pw_ab_multihost --mode pipeline's client (multihost_side `pipeline_pw`) on the suite's
    cluster (islands a and b on hosts A and B): ready after its warm-up, then a rate per window."""
    from bench.multihost import Cluster, Side, _stop

    cl = Cluster(hosts(3))
    side = Side(cl.hosts[0], "pipeline_pw", {"stages": 4, "micro_batches": 2, "passes": 2}, **cl.env())
    try:
        assert side.read(180) == {"ready": True}
        assert side.ask("go", 60)["per_s"] > 0
    finally:
        _stop(side)
    assert "by TCP link" in cl.worker_log(1, "wa")  # the hop crossed hosts
