"""What the controller keeps per job (jobs.py's `JobManager`), and the job states by name.

Every job is kept, finished ones too; the database row (db/models.py `JobRow`) is its durable
copy, written at each transition, and the runtime-only fields (its supervisor, the programs its
sessions registered here, a cancel asked for, the event its log followers wait on) start afresh
when a controller adopts a running job.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime

from schemas.pathways.v1 import controller_pb2 as cpb

from .job_process import Supervisor

STATE_NAMES = {
    cpb.JOB_STATE_PENDING: "pending",
    cpb.JOB_STATE_RUNNING: "running",
    cpb.JOB_STATE_SUCCEEDED: "succeeded",
    cpb.JOB_STATE_FAILED: "failed",
    cpb.JOB_STATE_CANCELLED: "cancelled",
}
STATES = {v: k for k, v in STATE_NAMES.items()}
ACTIVE = {cpb.JOB_STATE_PENDING, cpb.JOB_STATE_RUNNING}


@dataclass(eq=False)
class JobRecord:
    """A job as the controller keeps it in memory (every job, also finished ones)."""

    id: str
    name: str
    entrypoint: str
    args: list[str]
    priority: int
    weight: float
    state: cpb.JobState.ValueType
    submitted_at: datetime
    started_at: datetime | None = None
    ended_at: datetime | None = None
    pid: int = 0
    exit_code: int | None = None
    reason: str = ""
    slices: set[str] = field(default_factory=set)
    programs: int = 0
    runs: int = 0
    # runtime only
    program_ids: set[str] = field(default_factory=set)  # registered by this controller's sessions
    sup: Supervisor | None = None
    cancel_requested: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def owner(self) -> str:
        return f"job:{self.id}"

    @property
    def active(self) -> bool:
        return self.state in ACTIVE
