"""Hangs made visible: which gangs are held back now, by which host, and for how long.

The gang scheduler fails a run whose host's head node has not started (or not finished) within
the hang timeout ("hang detected"). Before that, this reporter shows what is stuck where people
look (`status`, `host list`, `jobs describe`), from the scheduler's `stalls` and the hosts'
heartbeats, computed when asked (nothing on the dispatch path). A host is *stalled* while its
heartbeats are late (more than `HEARTBEAT_LATE` intervals) or it holds back a gang for longer
than the stall threshold; when a hang is detected, the message also goes to the job's log.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from schemas.pathways.v1 import controller_pb2 as cpb

from ..scheduler import GangScheduler, HangDetected, Stall
from .cluster import READY, HostInfo

log = logging.getLogger(__name__)

HEARTBEAT_LATE = 3.0  # heartbeat intervals without one before a ready host counts as stalled
MAX_STALL_AFTER_S = 5.0
JOB_HANGS_KEPT = 1024  # jobs whose last hang message is remembered (~0.3 KiB each)


def stall_after(hang_timeout_s: float | None) -> float:
    """The stall threshold: a quarter of the hang timeout, at most 5 s."""
    return min(MAX_STALL_AFTER_S, hang_timeout_s / 4) if hang_timeout_s else MAX_STALL_AFTER_S


class HangReporter:
    """Collaborators: the scheduler (its stalls), the hosts (their heartbeats) and the path of a
    job's log. Every method runs on the controller's event loop."""

    def __init__(self, scheduler: GangScheduler, hosts: dict[str, HostInfo], heartbeat_interval: float,
                 job_log: Callable[[str], Path]) -> None:
        self.scheduler = scheduler
        self.hosts = hosts
        self.heartbeat_interval = heartbeat_interval
        self.job_log = job_log
        self.after_s = stall_after(scheduler.hang_timeout_s)
        self.job_hangs: OrderedDict[str, str] = OrderedDict()  # job id -> its last hang message

    def stalls(self) -> list[Stall]:
        return self.scheduler.stalls(time.monotonic(), self.after_s)

    def stalled_hosts(self, stalls: list[Stall] | None = None) -> dict[str, str]:
        """Host name -> why it is stalled, for the ready hosts that are."""
        now = time.monotonic()
        late = HEARTBEAT_LATE * self.heartbeat_interval
        out: dict[str, str] = {}
        for h in self.hosts.values():
            if h.state == READY and now - h.last_seen > late:
                out[h.name] = f"no heartbeat for {now - h.last_seen:.1f} s"
        for s in self.stalls() if stalls is None else stalls:
            host = self.hosts.get(s.host)
            if host is not None and host.state == READY:
                out.setdefault(s.host, s.message)
        return out

    def job_stalls(self) -> dict[str, str]:
        """Job id -> what holds back one of its runs now."""
        out: dict[str, str] = {}
        for s in self.stalls():
            if s.job:
                out.setdefault(s.job, f"held back by host {s.host}: {s.message}")
        return out

    def annotate_jobs(self, jobs: list[cpb.Job]) -> list[cpb.Job]:
        """`jobs` with what holds back their runs now and their last hang message."""
        held = self.job_stalls() if any(j.state == cpb.JOB_STATE_RUNNING for j in jobs) else {}
        for j in jobs:
            j.held_back = held.get(j.id, "")
            j.last_hang = self.job_hangs.get(j.id, "")
        return jobs

    def hang_detected(self, a: HangDetected) -> None:
        """Dispatcher listener: the message goes to the server log, and the job's log and record."""
        log.error("hang detected: %s", a.message)
        if not a.job:
            return
        message = f"hang detected: {a.message} (run {a.run_id} failed)"
        self.job_hangs[a.job] = message
        self.job_hangs.move_to_end(a.job)
        while len(self.job_hangs) > JOB_HANGS_KEPT:
            self.job_hangs.popitem(last=False)
        try:  # one line, rarely: the driver appends to the same file (O_APPEND keeps lines whole)
            with open(self.job_log(a.job), "a", encoding="utf-8") as f:
                f.write(f"[pathways controller] {message}\n")
        except OSError as e:
            log.warning("cannot write the hang message to job %s's log: %s", a.job, e)
