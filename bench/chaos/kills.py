"""The kill part: workloads (workload.py: a program across islands, a collective, an unmodified
JAX program through the IFRT proxy) and a job run while workers and the controller are killed
with SIGKILL at random moments, then started again (same port, database and data directory),
and frozen with SIGSTOP among the kills (freezes.py, which measures its own).

Per kill it measures, from the moment of the kill:
- `error_s`: for the first call the kill failed (one ending with an error between the kill and
  the recovery), the time from the kill (or from the call's start, if later) to that error; a
  kill no call noticed has none;
- `ready_s`: until the controller answered again and every worker was ready;
- `recovery_s`: until a call that started after that succeeded (the cluster serves again);
- `stuck`: a call still running `STUCK_S` after the kill (must never happen);
- `consistent`: after a controller kill, its islands, hosts and named slices are as before.
Every result is checked against NumPy (`wrong` must stay 0). A workload that exits (its session
ended, or a proxy program's call failed) is started again. The job (the `across` workload as a
job's driver) runs through every kill; at the end it is told to stop and must have succeeded, its
session having come back after each controller restart (`jobs`). Once every session ended, each
worker must hold no buffer (`buffers_left`). A phase given as `beside` (the proxy fuzz) runs
once every workload serves, before the first fault; their calls meanwhile are its report's
`workloads_beside`. The calls and the faults are written beside the logs
(calls.jsonl, faults.jsonl) for reading a run afterwards.
"""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench.cluster import REPO
from pwctl.errors import PathwaysError
from schemas.pathways.v1 import controller_pb2 as cpb

from .cluster import ChaosCluster
from .freezes import freeze
from .schedule import Step
from .workload import KINDS

STUCK_S = 15.0
RECOVERY_LIMIT_S = 60.0


# the job's driver: the `across` workload in job mode (workload.py)
JOB_DRIVER = """import os, runpy, sys
os.environ["CHAOS_JOB"] = "1"
sys.argv = ["workload", "across"]
runpy.run_module("bench.chaos.workload", run_name="__main__")
"""
JOB_END_S = 60.0


@dataclass
class Workload:
    kind: str
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
    def __init__(self, cluster: ChaosCluster, faults: list[Step], kinds: tuple[str, ...] = KINDS,
                 job: bool = True, beside: Callable[[], dict[str, Any]] | None = None) -> None:
        self.cluster = cluster
        self.beside = beside  # a phase run beside the workloads before the first fault (the proxy fuzz)
        self.beside_report: dict[str, Any] = {}
        self.kinds = kinds
        self.job = job
        self.job_id = ""
        self.faults = faults  # the kills and the freezes among them, in order (schedule.py)
        self.workloads: list[Workload] = []
        self.live: dict[str, Workload] = {}
        self.records: list[dict[str, Any]] = []
        self.stuck = 0
        self.settled: dict[str, bool] = {}
        self.jobs: dict[str, Any] = {}
        self.buffers_left: dict[str, int] = {}
        self.tombstones_left: dict[str, int] = {}

    # ---- the workload ----
    def _workload(self, kind: str) -> Workload:
        c = self.cluster
        env = c.env(JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=f"grpc://{c.address}", PATHWAYS_DEVICES="1") \
            if kind == "proxy" else c.env()
        # stderr (the client's log, and the stacks of a stuck one) is kept beside the cluster's logs
        with open(c.home / f"workload-{kind}-{len(self.workloads)}.log", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "bench.chaos.workload", kind], env=env, cwd=REPO,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True)
        w = Workload(kind, proc)
        threading.Thread(target=w.read, daemon=True).start()
        self.workloads.append(w)
        self.live[kind] = w
        return w

    def _current(self, kind: str = "across") -> Workload:
        """The running workload of `kind`, started again if it exited."""
        w = self.live.get(kind)
        if w is None or w.proc.poll() is not None:
            w = self._workload(kind)
        return w

    def _calls(self) -> list[dict[str, Any]]:
        return [c for w in self.workloads for c in w.calls]

    # ---- one kill ----
    def _kill(self, target: str, down_s: float) -> dict[str, Any]:
        c = self.cluster
        at = time.time()
        if target == "controller":
            c.kill(c.controller)
            c.start_controller()
        else:
            c.kill(c.workers[target])
            time.sleep(down_s)  # down for a moment: calls meet the loss
            c.start_worker(target)
        rec: dict[str, Any] = {"fault": "kill", "target": target if target == "controller" else f"worker {target}",
                               "at": at,
                               "ready_s": None, "error_s": None, "recovery_s": None, "stuck": False}
        c.wait_ready(RECOVERY_LIMIT_S)
        ready_at = time.time()
        rec["ready_s"] = round(ready_at - at, 3)
        if target == "controller":
            rec["consistent"] = c.snapshot() == self.baseline
        self.await_recovery(rec, at, since=ready_at, deadline=ready_at + RECOVERY_LIMIT_S, counted_from=at)
        return rec

    def await_recovery(self, rec: dict[str, Any], at: float, since: float, deadline: float,
                       counted_from: float) -> None:
        """After a fault at `at`: waits (until `deadline`) for a call across islands started at
        `since` or later to succeed, watching for stuck workloads meanwhile, then records in `rec`
        how long until that call succeeded (`recovery_s`, from `counted_from`) and until the
        first call the fault failed had its clear error (`error_s`, from the fault or the call's
        start, whichever came last)."""
        while time.time() < deadline:
            if any(x["ok"] and x["start"] >= since for x in self._current().calls):
                break
            for kind in self.kinds:
                self._check_stuck(self._current(kind), at, rec)
            time.sleep(0.05)
        calls = self._calls()
        ok_after = [x["end"] for x in calls if x["ok"] and x["start"] >= since and x.get("kind") == "across"]
        if ok_after:
            rec["recovery_s"] = round(min(ok_after) - counted_from, 3)
        until = min(ok_after) if ok_after else deadline
        failed = sorted((x for x in calls if not x["ok"] and at <= x["end"] <= until), key=lambda x: x["end"])
        if failed:
            rec["error_s"] = round(failed[0]["end"] - max(at, failed[0]["start"]), 3)
            rec["error"] = failed[0].get("error", "")[:200]

    def _check_stuck(self, w: Workload, at: float, rec: dict[str, Any]) -> None:
        """A workload silent for STUCK_S after the kill holds a call that waits too long."""
        if w.proc.poll() is None and w.ready.is_set() and time.time() - max(w.last_line, at) > STUCK_S:
            rec["stuck"] = True
            rec.setdefault("stuck_kinds", []).append(w.kind)
            self.stuck += 1
            w.proc.send_signal(signal.SIGUSR1)  # its threads' stacks go to its log (workload.py)
            self.cluster.dump_stacks()  # and the servers': where does the call wait?
            time.sleep(0.5)
            w.proc.kill()

    # ---- the run ----
    def run(self) -> dict[str, Any]:
        c = self.cluster
        with c.client() as cl:
            from schemas.pathways.v1 import controller_pb2 as cpb
            cl.create_slice(cpb.SliceSpec(name="chaos-named", devices=1))
        self.baseline = c.snapshot()
        started = [self._current(kind) for kind in self.kinds]  # all at once, the job too
        if self.job:
            with c.client(timeout=30) as cl:
                self.job_id = cl.submit_job(cpb.SubmitJobRequest(name="chaos-job", entrypoint="driver.py",
                                                                 script=JOB_DRIVER.encode())).id
        for w in started:
            if not w.ready.wait(90):
                raise RuntimeError(f"the {w.kind} workload did not start")
        if self.job:
            deadline = time.time() + 90
            while not any(x["ok"] for x in self._job_calls()):  # the kills start once it serves
                if time.time() > deadline:
                    raise RuntimeError(f"job {self.job_id} made no call in 90 s (see {c.home / 'jobs'})")
                time.sleep(0.2)
        if self.beside is not None:
            self.beside_report = self._run_beside(self.beside)
        start = time.time()
        for step in self.faults:
            time.sleep(step.pause_s)  # calls flow, then the fault comes at a random moment
            for kind in self.kinds:
                self._current(kind)
            self.records.append(self._kill(step.target, step.down_s) if step.fault == "kill"
                                else freeze(self, step.target, step.seconds, step.during, RECOVERY_LIMIT_S))
        self.settled = self._settle()
        self.jobs = self._end_job() if self.job else {}
        for w in self.workloads:
            if w.proc.poll() is None:
                w.proc.terminate()
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
        self.buffers_left = self._buffers_left()
        try:  # the ended sessions' tombstones went with them: those left are ownerless (bounded)
            self.tombstones_left = self.cluster.worker_buffers("tombstones")
        except (grpc.RpcError, PathwaysError) as e:
            self.tombstones_left = {"error": str(e)[:200]}  # type: ignore[dict-item]
        # every call and every fault beside the logs, for reading a run afterwards (--keep)
        with open(c.home / "calls.jsonl", "w") as out:
            for x in sorted(self._calls(), key=lambda x: x["start"]):
                out.write(json.dumps(x) + "\n")
        with open(c.home / "faults.jsonl", "w") as out:
            for r in self.records:
                out.write(json.dumps(r) + "\n")
        return self.summary(time.time() - start)

    def _run_beside(self, phase: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Runs `phase` while the workloads run; its report, with how their calls went meanwhile
        (`workloads_beside`: none may fail or be wrong) and whether each kind served a call
        started after it (within `RECOVERY_LIMIT_S`)."""
        since = time.time()
        report = phase()
        until = time.time()
        served = {kind: False for kind in self.kinds}
        while time.time() < until + RECOVERY_LIMIT_S and not all(served.values()):
            for kind in self.kinds:
                served[kind] = served[kind] or any(x["ok"] and x["start"] >= until for x in self._current(kind).calls)
            time.sleep(0.05)
        during = [x for x in self._calls() if x["end"] >= since and x["start"] <= until]
        report["workloads_beside"] = {
            kind: {"calls": sum(1 for x in during if x["kind"] == kind),
                   "failed": sum(1 for x in during if x["kind"] == kind and not x["ok"]),
                   "wrong_results": sum(1 for x in during if x["kind"] == kind and x.get("wrong")),
                   "served_after": served[kind],
                   "errors": sorted({x.get("error", "")[:200] for x in during if x["kind"] == kind and not x["ok"]})}
            for kind in self.kinds}
        return report

    def _settle(self) -> dict[str, bool]:
        """After the last kill: whether each kind served a call again (checking none is stuck),
        and the job too: it is stopped only once it served a call after the last kill or the
        recovery limit passed (its calls may fail for a while longer than the workloads' while
        the killed host's island re-forms, and stopping it then would read as not recovered)."""
        since = time.time()
        last_kill = self._last_fault(since)
        rec: dict[str, Any] = {}
        served = {kind: False for kind in self.kinds}
        if self.job:
            served["job"] = False
        next_job_read = 0.0
        while time.time() < since + RECOVERY_LIMIT_S and not all(served.values()):
            for kind in self.kinds:
                w = self._current(kind)
                served[kind] = served[kind] or any(x["ok"] and x["start"] >= since for x in w.calls)
                self._check_stuck(w, since, rec)
            if self.job and not served["job"] and time.time() >= next_job_read:
                next_job_read = time.time() + 0.2  # its output is a file: read it now and then
                served["job"] = any(x["ok"] and x["start"] >= last_kill for x in self._job_calls())
            time.sleep(0.05)
        return served

    def _buffers_left(self) -> dict[str, int]:
        """Every session ended (the workloads stopped, the job over): what each worker still
        holds, once it had `RECOVERY_LIMIT_S` to let go (it must be nothing: a buffer nobody owns
        stays for good)."""
        deadline = time.time() + RECOVERY_LIMIT_S
        while True:
            try:
                left = self.cluster.worker_buffers()
            except (grpc.RpcError, PathwaysError) as e:
                left = {"error": str(e)[:200]}  # type: ignore[dict-item]
            if not any(left.values()) or time.time() > deadline:
                return left
            time.sleep(0.5)

    def _last_fault(self, default: float) -> float:
        """When the last fault ended its hold: a kill's moment, a freeze's SIGCONT."""
        return max((r.get("thaw_at", r["at"]) for r in self.records), default=default)

    def _job_calls(self) -> list[dict[str, Any]]:
        """The job's calls so far, from its output (JSON lines, workload.py)."""
        calls = []
        for name in ("output.log.1", "output.log"):
            with contextlib.suppress(OSError):
                for raw in (self.cluster.home / "jobs" / self.job_id / name).read_text(errors="replace").splitlines():
                    with contextlib.suppress(ValueError):
                        line = json.loads(raw)
                        if isinstance(line, dict) and "start" in line:
                            calls.append(line)
        return calls

    def _end_job(self) -> dict[str, Any]:
        """Stops the job (a file in its directory), waits for its end, reads its calls."""
        c = self.cluster
        job_dir = c.home / "jobs" / self.job_id
        (job_dir / "stop").write_text("")
        deadline = time.time() + JOB_END_S
        job = None
        while time.time() < deadline:
            with c.client(timeout=10) as cl:
                job = cl.get_job(self.job_id)
            if job.state not in (cpb.JOB_STATE_PENDING, cpb.JOB_STATE_RUNNING):
                break
            time.sleep(0.2)
        calls = self._job_calls()
        last_kill = self._last_fault(0.0)
        first_kill = min((r["at"] for r in self.records), default=0.0)
        return {
            "state": cpb.JobState.Name(job.state) if job else "unknown",
            "reason": job.reason if job else "",
            "calls": len(calls),
            "calls_ok": sum(1 for x in calls if x["ok"]),
            "wrong_results": sum(1 for x in calls if x.get("wrong")),
            # waiting after a kill (the kills start once the job has served: its first call,
            # which traces and compiles, may take long on a loaded machine before any kill)
            "stuck_calls": sum(1 for x in calls if x["end"] - max(x["start"], first_kill) > STUCK_S),
            "served_after_last_kill": any(x["ok"] and x["start"] >= last_kill for x in calls),
        }

    def summary(self, seconds: float) -> dict[str, Any]:
        calls = self._calls()
        kinds = {kind: {"calls": sum(1 for x in calls if x.get("kind") == kind),
                        "calls_ok": sum(1 for x in calls if x.get("kind") == kind and x["ok"]),
                        "wrong_results": sum(1 for x in calls if x.get("kind") == kind and x.get("wrong")),
                        "programs_started": sum(1 for w in self.workloads if w.kind == kind),
                        "served_after_last_kill": self.settled.get(kind, False)} for kind in self.kinds}
        kills = [r for r in self.records if r["fault"] == "kill"]
        errors = [r["error_s"] for r in kills if r["error_s"] is not None]
        recov = [r["recovery_s"] for r in kills if r["recovery_s"] is not None]
        return {
            "seconds": round(seconds, 1),
            "kills": len(kills),
            "controller_kills": sum(1 for r in kills if r["target"] == "controller"),
            "calls": len(calls),
            "calls_ok": sum(1 for x in calls if x["ok"]),
            "calls_failed": sum(1 for x in calls if not x["ok"]),
            "wrong_results": sum(1 for x in calls if x.get("wrong")),
            "stuck_calls": self.stuck,
            "not_recovered": sum(1 for r in kills if r["recovery_s"] is None),
            "inconsistent_after_restart": sum(1 for r in kills if r.get("consistent") is False),
            "time_to_error_s": _dist(errors),
            "recovery_s": _dist(recov),
            "workloads": kinds,
            "job": self.jobs,
            "freezes": self._freeze_summary(),
            "buffers_left": self.buffers_left,
            "tombstones_left": self.tombstones_left,
            "per_kill": kills,
        }

    def _freeze_summary(self) -> dict[str, Any]:
        frozen = [r for r in self.records if r["fault"] == "freeze"]
        out: dict[str, Any] = {
            "freezes": len(frozen),
            "not_recovered": sum(1 for r in frozen if r["recovery_s"] is None),
            "inconsistent": sum(1 for r in frozen if not r["consistent"]),
            # a long freeze of a worker: declared lost while alive, then back in the same process
            # (unless the controller restarted halfway: the new one waits for it to reconnect)
            "long_worker_not_lost": sum(1 for r in frozen if r["long"] and r["target"] != "controller"
                                        and r["during"] != "controller" and r["lost_s"] is None),
            "not_rejoined": sum(1 for r in frozen if not r["rejoined"]),
            "others_lost": sum(1 for r in frozen if r["others_lost"]),
        }
        for name, pick in (("worker_not_long", lambda r: r["target"] != "controller" and not r["long"]),
                           ("worker_long", lambda r: r["target"] != "controller" and r["long"]),
                           ("controller_not_long", lambda r: r["target"] == "controller" and not r["long"]),
                           ("controller_long", lambda r: r["target"] == "controller" and r["long"])):
            some = [r for r in frozen if pick(r)]
            out[name] = {"n": len(some), "frozen_s": _dist([r["seconds"] for r in some]),
                         "lost_s": _dist([r["lost_s"] for r in some if r["lost_s"] is not None]),
                         "time_to_error_s": _dist([r["error_s"] for r in some if r["error_s"] is not None]),
                         "ready_s": _dist([r["ready_s"] for r in some if r["ready_s"] is not None]),
                         "recovery_s": _dist([r["recovery_s"] for r in some if r["recovery_s"] is not None])}
        out["per_freeze"] = frozen
        return out


def _dist(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    v = sorted(values)
    return {"n": len(v), "p50": round(statistics.median(v), 3), "p95": round(v[min(len(v) - 1, int(0.95 * len(v)))], 3),
            "max": round(v[-1], 3)}
