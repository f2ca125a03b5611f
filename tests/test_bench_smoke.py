"""Smoke test of the benchmark package: one cheap benchmark (dispatch, inc1, OpByOp, a handful of
calls) against a real cluster, in a client subprocess. Checks the result row's fields, never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LocalCluster

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
