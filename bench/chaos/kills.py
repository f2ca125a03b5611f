"""The kill part: a workload (workload.py) runs while workers and the controller are killed
with SIGKILL at random moments, then started again (same port, database and data directory).

Per kill it measures, from the moment of the kill:
- `error_s`: for the first call the kill failed (one ending with an error between the kill and
  the recovery), the time from the kill (or from the call's start, if later) to that error; a
  kill no call noticed has none;
- `ready_s`: until the controller answered again and every worker was ready;
- `recovery_s`: until a call that started after that succeeded (the cluster serves again);
- `stuck`: a call still running `STUCK_S` after the kill (must never happen);
- `consistent`: after a controller kill, its islands, hosts and named slices are as before.
Every result is checked against NumPy (`wrong` must stay 0).
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bench.cluster import REPO

from .cluster import ChaosCluster

STUCK_S = 15.0
RECOVERY_LIMIT_S = 60.0


@dataclass
class Workload:
    proc: subprocess.Popen[str]
    calls: list[dict[str, Any]] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    last_line: float = field(default_factory=time.time)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            self.last_line = time.time()
            if "ready" in line:
                self.ready.set()
            else:
                self.calls.append(line)


class KillRun:
    def __init__(self, cluster: ChaosCluster, rng: random.Random, kills: int, controller_kills: int) -> None:
        self.cluster = cluster
        self.rng = rng
        targets = ["controller"] * controller_kills + [
            self.rng.choice(cluster.islands) for _ in range(max(0, kills - controller_kills))]
        self.rng.shuffle(targets)
        self.targets = targets
        self.workloads: list[Workload] = []
        self.records: list[dict[str, Any]] = []
        self.stuck = 0

    # ---- the workload ----
    def _workload(self) -> Workload:
        proc = subprocess.Popen([sys.executable, "-m", "bench.chaos.workload"], env=self.cluster.env(), cwd=REPO,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        w = Workload(proc)
        threading.Thread(target=w.read, daemon=True).start()
        self.workloads.append(w)
        return w

    def _current(self) -> Workload:
        w = self.workloads[-1] if self.workloads else None
        if w is None or w.proc.poll() is not None:
            w = self._workload()
        return w

    def _calls(self) -> list[dict[str, Any]]:
        return [c for w in self.workloads for c in w.calls]

    # ---- one kill ----
    def _kill(self, target: str) -> dict[str, Any]:
        c = self.cluster
        at = time.time()
        if target == "controller":
            c.kill(c.controller)
            c.start_controller()
        else:
            c.kill(c.workers[target])
            time.sleep(self.rng.uniform(0.0, 1.0))  # down for a moment: calls meet the loss
            c.start_worker(target)
        rec: dict[str, Any] = {"target": target if target == "controller" else f"worker {target}",
                               "ready_s": None, "error_s": None, "recovery_s": None, "stuck": False}
        c.wait_ready(RECOVERY_LIMIT_S)
        ready_at = time.time()
        rec["ready_s"] = round(ready_at - at, 3)
        if target == "controller":
            rec["consistent"] = c.snapshot() == self.baseline
        deadline = ready_at + RECOVERY_LIMIT_S
        while time.time() < deadline:
            w = self._current()
            if any(x["ok"] and x["start"] >= ready_at for x in w.calls):
                break
            self._check_stuck(w, at, rec)
            time.sleep(0.05)
        calls = self._calls()
        ok_after = [x["end"] for x in calls if x["ok"] and x["start"] >= ready_at]
        if ok_after:
            rec["recovery_s"] = round(min(ok_after) - at, 3)
        until = min(ok_after) if ok_after else deadline
        failed = sorted((x for x in calls if not x["ok"] and at <= x["end"] <= until), key=lambda x: x["end"])
        if failed:  # the first call the kill failed: how long until its caller had a clear error
            rec["error_s"] = round(failed[0]["end"] - max(at, failed[0]["start"]), 3)
            rec["error"] = failed[0].get("error", "")[:200]
        return rec

    def _check_stuck(self, w: Workload, at: float, rec: dict[str, Any]) -> None:
        """A workload silent for STUCK_S after the kill holds a call that waits too long."""
        if w.proc.poll() is None and w.ready.is_set() and time.time() - max(w.last_line, at) > STUCK_S:
            rec["stuck"] = True
            self.stuck += 1
            w.proc.kill()

    # ---- the run ----
    def run(self) -> dict[str, Any]:
        c = self.cluster
        with c.client() as cl:
            from schemas.pathways.v1 import controller_pb2 as cpb
            cl.create_slice(cpb.SliceSpec(name="chaos-named", devices=1))
        self.baseline = c.snapshot()
        w = self._current()
        if not w.ready.wait(90):
            raise RuntimeError("the workload did not start")
        start = time.time()
        for target in self.targets:
            time.sleep(self.rng.uniform(0.3, 1.5))  # calls flow, then the kill comes at a random moment
            self._current()
            self.records.append(self._kill(target))
        for w in self.workloads:
            if w.proc.poll() is None:
                w.proc.terminate()
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
        return self.summary(time.time() - start)

    def summary(self, seconds: float) -> dict[str, Any]:
        calls = self._calls()
        errors = [r["error_s"] for r in self.records if r["error_s"] is not None]
        recov = [r["recovery_s"] for r in self.records if r["recovery_s"] is not None]
        return {
            "seconds": round(seconds, 1),
            "kills": len(self.records),
            "controller_kills": sum(1 for r in self.records if r["target"] == "controller"),
            "calls": len(calls),
            "calls_ok": sum(1 for x in calls if x["ok"]),
            "calls_failed": sum(1 for x in calls if not x["ok"]),
            "wrong_results": sum(1 for x in calls if x.get("wrong")),
            "stuck_calls": self.stuck,
            "not_recovered": sum(1 for r in self.records if r["recovery_s"] is None),
            "inconsistent_after_restart": sum(1 for r in self.records if r.get("consistent") is False),
            "time_to_error_s": _dist(errors),
            "recovery_s": _dist(recov),
            "per_kill": self.records,
        }


def _dist(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    v = sorted(values)
    return {"n": len(v), "p50": round(statistics.median(v), 3), "p95": round(v[min(len(v) - 1, int(0.95 * len(v)))], 3),
            "max": round(v[-1], 3)}
