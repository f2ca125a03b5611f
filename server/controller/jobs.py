"""Jobs: driver scripts the controller runs as managed subprocesses (`pwctl submit`).

A job is a user's Python script (plus an optional working directory) that the controller
starts with `PWCTL_SERVER`/`PWCTL_JOB_ID` set, so every slice, buffer and program the driver
makes belongs to the owner `job:<id>` and goes when the job ends. Its stdout and stderr go to
`<jobs_dir>/<id>/output.log` (capped and rotated: job_files.py), which outlives the job.

States: pending -> running -> succeeded | failed | cancelled (pending -> failed/cancelled when the
driver never started). Every transition is written to the database at once (jobs are rare);
program registrations and run counters are kept in memory and flushed about once a second
from a background task, never per run.

Choices:
- Every driver runs under its own supervisor (jobsup.py), a process in its own session that does
  not depend on the controller: it is a child subreaper, so the job is its whole process tree
  (`setsid` grandchildren included), killed whole when the driver ends or on cancel (SIGTERM to
  the tree, SIGKILL after `KILL_AFTER_S`); it writes the output to the log and the driver's exit
  status to `exit.json`. The controller waits on it through a pidfd.
- A controller stop or crash ends no job: `load()` adopts every job whose supervisor still holds
  its lock (and reads the exit status of those that ended meanwhile); a job whose supervisor
  died without an exit status (the machine restarted) fails with that reason.
- Memory: no limit by default. JAX reserves large virtual address ranges, so RLIMIT_AS breaks
  it; `PATHWAYS_JOB_MEMORY_MB` sets RLIMIT_DATA (heap) per driver, where a driver over it sees a
  MemoryError. A driver the kernel's OOM killer ends (SIGKILL) fails with "killed by SIGKILL
  (out of memory?)".
"""

from __future__ import annotations

import asyncio
import builtins
import codecs
import contextlib
import logging
import secrets
import shutil
import signal
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Future
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpc import aio
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from schemas.pathways.v1 import controller_pb2 as cpb

from .. import paths
from ..db.models import JobRow, ProgramRow, str_list, utcnow
from ..db.writer import Write
from ..timeutil import iso
from .client_session import ClientSession
from .errors import InvalidArgument, NotFound
from .job_files import (
    DEFAULT_LOG_MAX_MB,
    LogReader,
    extract_zip,
    validate_submit,
)
from .job_process import (
    Supervisor,
    SupervisorError,
    adopt,
    driver_command,
    driver_env,
    end_leftovers,
    exit_reason,
    kill_group,
    pid_is_job,
    read_exit,
    read_usage,
    start_supervisor,
)
from .job_record import STATE_NAMES, STATES, JobRecord
from .job_stats import ProgramStats
from .programs import ProgramRecord

if TYPE_CHECKING:
    from pwctl.tls import TlsConfig

    from ..scheduler import GangScheduler
    from .dispatch import RunState

log = logging.getLogger(__name__)

KILL_AFTER_S = 5.0  # a cancelled tree gets SIGKILL after this (its supervisor sends it)
RECENT_FINISHED = 20
FLUSH_INTERVAL_S = 1.0
LOG_POLL_S = 0.1

def _now() -> datetime:
    return utcnow()


class JobManager:
    """Runs, watches, cancels and remembers jobs; every method runs on the controller's loop.

    Collaborators: the database (`db` to read at start, `write` for the one writer), `spawn`
    for background tasks, the scheduler (why a job's runs wait), `owned_slices` (an owner's
    slices), `release_owner` (frees what a job owned when it ends), `address` (the controller's
    bound address, for drivers), the token (and TLS settings) drivers present and `job_secret`, a job's secret (its
    driver proves with it that it is the job's, server/credentials.py). Listens to registrations
    (`program_registered`) and finished runs (`run_finished`).
    """

    def __init__(self, db: sessionmaker[Session], write: Write, *,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
                 scheduler: GangScheduler, owned_slices: Callable[[str], builtins.list[cpb.Slice]],
                 release_owner: Callable[[str], None], address: Callable[[], str],
                 token: str | None = None, log_max_mb: int = DEFAULT_LOG_MAX_MB,
                 job_secret: Callable[[str], str] = lambda _job_id: "", tls: TlsConfig | None = None) -> None:
        self._db = db
        self._writer = write
        self._spawn = spawn
        self._scheduler = scheduler
        self._owned_slices = owned_slices
        self._release_owner = release_owner
        self._address = address
        self._token = token
        self._tls = tls  # drivers trust the controller's CA (and, with mutual TLS, present its certificate)
        self._job_secret = job_secret
        self._log_max_bytes = log_max_mb * 2**20
        self.jobs: dict[str, JobRecord] = {}
        self.stats = ProgramStats(write)
        self._flush_task: asyncio.Task[Any] | None = None

    # ---------------------------------------------------------------- lifecycle
    def load(self) -> None:
        """Reads every job; adopts the running jobs whose supervisors live on."""
        with self._db() as s:
            rows = list(s.scalars(select(JobRow).order_by(JobRow.submitted_at)))
            counts = {
                owner: (int(n), int(runs or 0))
                for owner, n, runs in s.execute(
                    select(ProgramRow.owner, func.count(ProgramRow.id), func.sum(ProgramRow.runs))
                    .where(ProgramRow.owner.like("job:%"))
                    .group_by(ProgramRow.owner)
                )
            }
        orphans = []
        for row in rows:
            rec = JobRecord(
                id=row.id, name=row.name, entrypoint=row.entrypoint, args=str_list(row.args),
                priority=row.priority, weight=row.weight, state=STATES.get(row.state, cpb.JOB_STATE_FAILED),
                submitted_at=row.submitted_at, started_at=row.started_at, ended_at=row.ended_at,
                pid=row.pid, exit_code=row.exit_code, reason=row.reason, slices=set(str_list(row.slices)),
            )
            rec.programs, rec.runs = counts.get(rec.owner, (0, 0))
            self.jobs[rec.id] = rec
            if rec.active:
                orphans.append(rec)
            else:
                rec.done.set()
        adopted = 0
        for rec in orphans:
            sup = adopt(paths.jobs_dir() / rec.id)
            if sup is None:
                self._finish(rec)  # it ended while no controller watched
                continue
            adopted += 1
            rec.sup, rec.pid = sup, sup.driver_pid
            if rec.state == cpb.JOB_STATE_PENDING:
                rec.state, rec.started_at = cpb.JOB_STATE_RUNNING, rec.started_at or _now()
                self._save(rec)
            self._spawn(self._watch(rec))
        if adopted:
            log.info("adopted %d running job(s) from the previous controller", adopted)
        self._flush_task = self._spawn(self._flusher())

    async def stop(self) -> None:
        """Flushes counters; running jobs go on under their supervisors (the next controller
        adopts them)."""
        running = self.count()
        if running:
            log.info("leaving %d running job(s) to their supervisors", running)
        if self._flush_task is not None:
            self._flush_task.cancel()
        self.stats.flush()  # the writer drains it when the controller closes it

    # ---------------------------------------------------------------- queries
    def count(self) -> int:
        """Jobs pending or running now."""
        return sum(1 for r in self.jobs.values() if r.active)

    def resolve(self, ref: str) -> JobRecord:
        """The job `ref` names: its id, a unique prefix of it (with or without 'job-'), or its name."""
        ref = ref.strip()
        if not ref:
            raise InvalidArgument("give a job id (see `pwctl jobs list`)")
        rec = self.jobs.get(ref)
        if rec is not None:
            return rec
        matches = [r for r in self.jobs.values()
                   if r.id.startswith(ref) or r.id.removeprefix("job-").startswith(ref)]
        if not matches:
            matches = [r for r in self.jobs.values() if r.name == ref]
        if len(matches) == 1:
            return matches[0]
        if matches:
            several = ", ".join(r.id for r in matches[:8]) + (", ..." if len(matches) > 8 else "")
            raise InvalidArgument(f"{ref!r} matches several jobs ({several}); give more of the id")
        raise NotFound(f"no job matches {ref!r} (see `pwctl jobs list --all`)")

    def get(self, ref: str) -> cpb.Job:
        return self.proto(self.resolve(ref), self._wait_reasons())

    def list(self, state: str = "", all: bool = False) -> list[cpb.Job]:
        """Pending and running jobs plus the last finished ones; `all` everything; `state` filters."""
        recs = sorted(self.jobs.values(), key=lambda r: r.submitted_at)
        if state:
            want = STATES.get(state.strip().lower().removeprefix("job_state_"))
            if want is None:
                raise InvalidArgument(f"unknown job state {state!r}: use one of {', '.join(STATES)}")
            recs = [r for r in recs if r.state == want]
        elif not all:
            finished = [r for r in recs if not r.active]
            keep = {id(r) for r in finished[-RECENT_FINISHED:]}
            recs = [r for r in recs if r.active or id(r) in keep]
        reasons = self._wait_reasons()
        return [self.proto(r, reasons) for r in recs]

    def _wait_reasons(self) -> dict[str, str]:
        """job id -> why its first waiting run waits (from the gang schedulers)."""
        if not any(r.state == cpb.JOB_STATE_RUNNING for r in self.jobs.values()):
            return {}
        reasons: dict[str, str] = {}
        for island in self._scheduler.snapshot().islands:
            for run in island.waiting:
                if run.job and run.wait_reason and run.job not in reasons:
                    reasons[run.job] = f"{island.island}: {run.wait_reason}"
        return reasons

    def _slices_of(self, rec: JobRecord) -> set[str]:
        names = set(rec.slices)
        if rec.active:
            names.update(s.name for s in self._owned_slices(rec.owner))
        return names

    def proto(self, rec: JobRecord, reasons: dict[str, str] | None = None) -> cpb.Job:
        pending = ""
        if rec.state == cpb.JOB_STATE_PENDING:
            pending = "starting the driver"
        elif rec.state == cpb.JOB_STATE_RUNNING and reasons:
            pending = reasons.get(rec.id, "")
        return cpb.Job(
            id=rec.id, name=rec.name, state=rec.state, entrypoint=rec.entrypoint, args=rec.args,
            exit_code=rec.exit_code or 0, has_exit_code=rec.exit_code is not None, reason=rec.reason,
            submitted_at=iso(rec.submitted_at), started_at=iso(rec.started_at), ended_at=iso(rec.ended_at),
            priority=rec.priority, weight=rec.weight, slices=sorted(self._slices_of(rec)),
            programs=rec.programs, runs=rec.runs, pending_reason=pending, pid=rec.pid,
        )

    # ---------------------------------------------------------------- submit
    def _new_id(self) -> str:
        while True:
            job_id = f"job-{secrets.token_hex(3)}"
            if job_id not in self.jobs and not (paths.jobs_dir() / job_id).exists():
                return job_id

    async def submit(self, req: cpb.SubmitJobRequest) -> cpb.Job:
        entry, weight = validate_submit(req)
        job_id = self._new_id()
        rec = JobRecord(
            id=job_id, name=req.name or entry.stem, entrypoint=str(entry), args=list(req.args),
            priority=req.priority, weight=weight, state=cpb.JOB_STATE_PENDING, submitted_at=_now(),
        )
        job_dir = paths.jobs_dir() / job_id
        job_dir.mkdir(parents=True)
        try:
            if req.working_dir_zip:
                await asyncio.to_thread(extract_zip, req.working_dir_zip, job_dir)
            script = job_dir.joinpath(*entry.parts)
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_bytes(req.script)
        except BaseException:
            shutil.rmtree(job_dir, ignore_errors=True)
            raise
        self.jobs[job_id] = rec
        self._save(rec)
        log.info("job %s submitted: %s %s", job_id, rec.entrypoint, " ".join(rec.args))
        await self._start(rec, job_dir)
        # the reply promises a durable job: wait (without blocking the loop) for its last write
        await asyncio.wrap_future(self._save(rec))
        return self.proto(rec)

    async def _start(self, rec: JobRecord, job_dir: Path) -> None:
        if rec.cancel_requested:
            self._end(rec, cpb.JOB_STATE_CANCELLED, "cancelled before it started", None)
            return
        try:
            sup = await start_supervisor(
                job_dir, driver_command(rec.entrypoint, rec.args),
                driver_env(rec.id, rec.priority, rec.weight, self._address(), self._token, paths.data_dir(),
                           self._job_secret(rec.id), self._tls),
                self._log_max_bytes, KILL_AFTER_S)
        except (OSError, SupervisorError) as e:
            self._end(rec, cpb.JOB_STATE_FAILED, f"the driver could not start: {e}", None)
            return
        rec.sup = sup
        rec.pid = sup.driver_pid
        rec.state = cpb.JOB_STATE_RUNNING
        rec.started_at = _now()
        self._save(rec)
        log.info("job %s running (driver pid %d, supervisor pid %d)", rec.id, sup.driver_pid, sup.pid)
        self._spawn(self._watch(rec))
        if rec.cancel_requested:  # cancelled while the process was starting
            self._terminate(rec)

    async def _watch(self, rec: JobRecord) -> None:
        assert rec.sup is not None
        await rec.sup.wait()
        self._finish(rec)

    def _finish(self, rec: JobRecord) -> None:
        """The job's supervisor is gone: the job ends as its recorded exit status says."""
        job_dir = paths.jobs_dir() / rec.id
        status = read_exit(job_dir)
        if status is None:
            # its supervisor was killed, maybe not the tree: end what is left (the cgroup holds
            # even `setsid` descendants; without one, the driver's group, if the pid is still it)
            left = end_leftovers(job_dir, rec.pid if rec.pid and pid_is_job(rec.pid, rec.id) else 0)
            if left:
                log.warning("job %s: its supervisor died; killed the %d process(es) left in its cgroup", rec.id, left)
            reason = ("its supervisor died and recorded no exit status (did the machine restart?)"
                      if (job_dir / "sup.json").exists() else "the controller stopped before the driver started")
            self._end(rec, cpb.JOB_STATE_FAILED, reason, None)
            return
        rc, cancelled, ended_at = status
        if usage := read_usage(job_dir):
            peak = usage.get("memory_peak_bytes")
            log.info("job %s: its process tree used %.2f s of CPU%s", rec.id, usage.get("cpu_s", 0.0),
                     f", at most {peak / 2**20:.0f} MiB" if peak else "")
        if cancelled or rec.cancel_requested:
            self._end(rec, cpb.JOB_STATE_CANCELLED, "cancelled", rc if rc >= 0 else None, ended_at)
        elif rc == 0:
            self._end(rec, cpb.JOB_STATE_SUCCEEDED, "", 0, ended_at)
        else:
            self._end(rec, cpb.JOB_STATE_FAILED, exit_reason(rc), rc if rc >= 0 else None, ended_at)

    def _end(self, rec: JobRecord, state: cpb.JobState.ValueType, reason: str, exit_code: int | None,
             ended_at: datetime | None = None) -> None:
        """Final transition: persist, release everything the job owned, wake log followers."""
        if rec.done.is_set():
            return
        rec.slices = self._slices_of(rec)
        rec.state = state
        rec.reason = reason
        rec.exit_code = exit_code
        rec.ended_at = ended_at or _now()
        rec.sup = None
        rec.program_ids.clear()
        try:
            self._release_owner(rec.owner)
        except Exception:
            log.exception("releasing what job %s owned", rec.id)
        self._save(rec)
        rec.done.set()
        log.info("job %s %s%s", rec.id, STATE_NAMES[state], f": {reason}" if reason else "")

    # ---------------------------------------------------------------- cancel
    def _terminate(self, rec: JobRecord) -> None:
        if rec.sup is not None:
            rec.sup.signal(signal.SIGTERM)  # it terminates the tree, and kills it after KILL_AFTER_S
            self._spawn(self._kill_later(rec, rec.sup))

    async def _kill_later(self, rec: JobRecord, sup: Supervisor) -> None:
        try:
            await asyncio.wait_for(rec.done.wait(), KILL_AFTER_S + 5.0)
        except TimeoutError:  # the supervisor itself is stuck: end what can be found of the job
            log.warning("the supervisor of job %s did not end the job; killing it", rec.id)
            kill_group(rec.pid, signal.SIGKILL)
            sup.signal(signal.SIGKILL)

    async def cancel(self, ref: str) -> cpb.Job:
        """Cancels a pending or running job and waits (up to ~KILL_AFTER_S) until it ended.

        Cancelling a job that already ended changes nothing and returns it as it is."""
        rec = self.resolve(ref)
        if rec.active and not rec.cancel_requested:
            rec.cancel_requested = True
            log.info("cancelling job %s", rec.id)
            self._terminate(rec)
        if rec.active:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rec.done.wait(), KILL_AFTER_S + 3.0)
        return self.proto(rec, self._wait_reasons())

    # ---------------------------------------------------------------- logs
    async def stream_logs(
        self, request: cpb.StreamLogsRequest, context: aio.ServicerContext | None = None
    ) -> AsyncIterator[cpb.LogChunk]:
        """The job's output (or its last `tail` lines), then with `follow` new output as it comes;
        the last message carries the job (done=True once it ended: state and exit code)."""
        rec = self.resolve(request.id)
        reader = LogReader(paths.jobs_dir() / rec.id)
        try:
            notice = await asyncio.to_thread(reader.start, max(0, request.tail))
            if notice:
                yield cpb.LogChunk(data=notice)
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            while True:
                ended = rec.done.is_set()  # before reading: after the exit, the file is complete
                while data := reader.read():
                    text = decoder.decode(data)
                    if text:
                        yield cpb.LogChunk(data=text)
                if ended or not request.follow:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(rec.done.wait(), LOG_POLL_S)
        finally:
            reader.close()
        yield cpb.LogChunk(data=decoder.decode(b"", final=True), done=rec.done.is_set(), job=self.get(rec.id))

    # ---------------------------------------------------------------- programs and runs
    def program_registered(self, session: ClientSession, program: ProgramRecord) -> None:
        """Session listener: counts the registration, and the job's programs."""
        self.stats.registered(program, session.owner)
        rec = self.jobs.get(session.job_id) if session.job_id else None
        if rec is not None and rec.active and program.program_id not in rec.program_ids:
            rec.program_ids.add(program.program_id)
            rec.programs += 1
            rec.slices.update(program.slices)

    def run_finished(self, run: RunState, ok: bool, error: str) -> None:
        """Dispatcher listener: counts the run for its program and its job."""
        self.stats.run_finished(run.program, run.session.owner, ok, time.time())
        if run.session.job_id:
            rec = self.jobs.get(run.session.job_id)
            if rec is not None:
                rec.runs += 1

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            self.stats.flush()

    # ---------------------------------------------------------------- persistence
    def _save(self, rec: JobRecord) -> Future[Any]:
        """Queues the job's row as it is now (a snapshot: later changes are later writes)."""
        row = JobRow(
            id=rec.id, name=rec.name, state=STATE_NAMES[rec.state], entrypoint=rec.entrypoint,
            args=list(rec.args), priority=rec.priority, weight=rec.weight, pid=rec.pid,
            exit_code=rec.exit_code, reason=rec.reason, slices=sorted(rec.slices),
            submitted_at=rec.submitted_at, started_at=rec.started_at, ended_at=rec.ended_at,
        )
        return self._writer(lambda s: s.merge(row))
