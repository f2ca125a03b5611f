"""The chaos run's fault schedule is named by its seed (bench/chaos/schedule.py): pure, no cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from bench.chaos.__main__ import FULL
from bench.chaos.schedule import describe, phase_rng, schedule

pytestmark = pytest.mark.timeout(60)

ISLANDS = ("a", "b")


def full(seed: int) -> list[dict]:
    return describe(schedule(seed, ISLANDS, FULL["kills"], FULL["controller_kills"], FULL["freezes"],
                             FULL["controller_freezes"], heartbeat_timeout=2.0))


def test_one_seed_names_one_schedule_and_another_seed_another() -> None:
    first = full(29)
    phase_rng(29, "fuzz").random()  # what the fuzz phase draws is no part of it
    assert full(29) == first
    assert full(30) != first and full(7) != first
    kills = [s for s in first if s["fault"] == "kill"]
    frozen = [s for s in first if s["fault"] == "freeze"]
    assert len(kills) == FULL["kills"] and sum(s["target"] == "controller" for s in kills) == FULL["controller_kills"]
    assert len(frozen) == FULL["freezes"]
    assert sum(s["target"] == "controller" for s in frozen) == FULL["controller_freezes"]
    assert all(0.3 <= s["pause_s"] <= 1.5 for s in first)
    assert all(s["seconds"] > 0 for s in frozen) and all(s["seconds"] == 0 for s in kills)
    assert all((0.0 <= s["down_s"] <= 1.0) if s["target"] != "controller" else s["down_s"] == 0 for s in kills)


def test_the_phases_draw_from_streams_of_their_own() -> None:
    assert phase_rng(29, "fuzz").random() != phase_rng(29, "faults").random()
    assert phase_rng(29, "fuzz").random() == phase_rng(29, "fuzz").random()


def test_the_schedule_is_the_same_in_another_process() -> None:
    """Not derived from `hash` (salted per process): a seed names one schedule across runs."""
    code = ("import json; from tests.test_chaos_schedule import full; print(json.dumps(full(29)))")
    outs = []
    for salt in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": salt, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
        r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=50)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(json.loads(r.stdout))
    assert outs[0] == outs[1] == full(29)
