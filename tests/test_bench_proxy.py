"""Smoke test of the proxy benchmark suite (bench/proxy.py) in a tiny mode: a real cluster (one
island of 4 CPU devices), the suite's unmodified JAX programs through the IFRT proxy and on plain
JAX, a 1 MiB transfer and a one-layer model. Checks the rows' fields and the suite's correctness
checks (results, loss curve), never timings."""

from __future__ import annotations

import os

import pytest

from bench.cluster import BenchCluster
from bench.proxy import SLICE, bench_proxy
from bench.rows import Ctx

pytestmark = pytest.mark.timeout(300)

TINY = {"vocab": 64, "d": 32, "layers": 1, "heads": 2, "ff": 64, "seq": 16, "batch": 4, "lr": 1e-3}


def test_proxy_suite_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith(("JAX_", "PWCTL_", "PATHWAYS_"))]:
        monkeypatch.delenv(k)
    with BenchCluster(islands=("a",), devices=4) as cluster:
        cluster.start()
        rows = list(bench_proxy(Ctx(cluster=cluster, quick=True), transfer_mib=1, cfg=TINY))
        from pwctl.client import Client

        with Client(server=cluster.address, token=cluster.token, timeout=10) as c:
            assert SLICE not in [s.name for s in c.slices()]  # the suite's slice is gone
    variants = [r["variant"] for r in rows]
    assert variants == ["x+1 pipelined", "x+1 op-by-op", "transformer step", "proxy transformer step",
                        "upload 1 MiB", "download 1 MiB"]
    for r in rows:
        assert "error" not in r, r
        assert r["bench"] == "proxy"
        for key in ("variant", "metric", "unit", "pathways", "jax", "ratio", "paired", "target", "meets", "notes"):
            assert key in r
    for r in rows[:3] + rows[4:]:
        assert r["pathways"] > 0 and r["jax"] > 0
        assert isinstance(r["meets"], bool) if r["target"] else r["meets"] is None
    assert "pathways slice bench-proxy x4" in rows[0]["notes"]  # the proxy side ran on the cluster
    assert rows[0]["notes"].startswith("load average ")
    assert rows[3]["meets"] is True  # the loss curve through the proxy matches plain JAX's
