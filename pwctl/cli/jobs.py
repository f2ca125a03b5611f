"""`pwctl submit | logs | cancel | wait` and `pwctl jobs list | describe`: driver scripts the server runs.

Attached `submit` and `wait` exit with the job's own exit code (1 when it was cancelled, killed by
a signal, or failed without one); `wait --timeout` exits 124 when the time is up; Ctrl-C on an
attached job detaches, says how to follow and cancel it, and exits 130.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TextIO

import typer

from ..errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_TIMEOUT, InvalidArgument, PathwaysError
from ..limits import MAX_PRIORITY, MAX_WEIGHT, share_problem
from .common import (
    Format,
    OutputOpt,
    ServerOpt,
    age,
    check_int32,
    client,
    confirm_or_exit,
    emit_item,
    emit_list,
    hint,
    stdout,
)
from .workdir import zip_with_progress

if TYPE_CHECKING:
    from schemas.pathways.v1 import controller_pb2 as cpb
    from schemas.views import JobView

    from ..client import Client

DRIVER_SUFFIXES = (".py", ".sh")  # the server's too: Python and bash


def ended(state: int) -> bool:
    """Whether a job in `state` (a JobState) has ended: succeeded, failed or cancelled."""
    from schemas.pathways.v1 import controller_pb2 as cpb

    return state in (cpb.JOB_STATE_SUCCEEDED, cpb.JOB_STATE_FAILED, cpb.JOB_STATE_CANCELLED)

app = typer.Typer(help="Jobs: driver scripts the server runs for you (`pwctl submit`).", no_args_is_help=True)



def _complete_job_ids(incomplete: str) -> list[str]:
    """Shell completion from the server; silent (no candidates) when it is unreachable."""
    try:
        from ..client import Client

        with Client(timeout=1.0) as c:
            return [j.id for j in c.jobs(all=True) if j.id.startswith(incomplete)]
    except Exception:
        return []


JobIdArg = Annotated[str, typer.Argument(help="Job id (a unique prefix is enough)",
                                         autocompletion=_complete_job_ids)]


# ---------------------------------------------------------------- helpers
def _with_file(zipped: bytes, name: str, data: bytes) -> bytes:
    """A working-directory zip that also holds `name` (replaced if it was there)."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as out:
        if zipped:
            with zipfile.ZipFile(io.BytesIO(zipped)) as zin:
                for info in zin.infolist():
                    if info.filename != name:
                        out.writestr(info, zin.read(info))
        out.writestr(name, data)
    return buf.getvalue()


def _entrypoint(script: Path, working_dir: Path | None) -> str:
    """The script's path inside the working dir when it lies there, else its file name."""
    if working_dir is not None:
        try:
            return script.resolve().relative_to(working_dir.resolve()).as_posix()
        except ValueError:
            pass
    return script.name


def state_name(job: cpb.Job) -> str:
    from schemas.pathways.v1 import controller_pb2 as cpb

    return cpb.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()


def job_exit_code(job: cpb.Job) -> int:
    """What attached submit and wait exit with: the driver's code; 1 when it has none."""
    from schemas.pathways.v1 import controller_pb2 as cpb

    if job.state == cpb.JOB_STATE_SUCCEEDED:
        return 0
    if job.state == cpb.JOB_STATE_FAILED and job.has_exit_code and 0 < job.exit_code < 256:
        return job.exit_code
    return EXIT_FAILED


def report_end(job: cpb.Job) -> int:
    """Says on stderr how the job ended (when not succeeded); returns the exit code to use."""
    from schemas.pathways.v1 import controller_pb2 as cpb

    code = job_exit_code(job)
    if job.state == cpb.JOB_STATE_CANCELLED:
        hint(f"job {job.id} was cancelled")
    elif job.state == cpb.JOB_STATE_FAILED:
        hint(f"job {job.id} failed: {job.reason or 'unknown reason'}")
    return code


def stream_output(c: Client, job_id: str, out: TextIO, follow: bool, tail: int = 0) -> cpb.Job | None:
    """Writes the job's output to `out`; returns the job from the stream's last message."""
    final: cpb.Job | None = None
    for chunk in c.logs(job_id, follow=follow, tail=tail):
        if chunk.data:
            out.write(chunk.data)
            out.flush()
        if chunk.HasField("job"):
            final = chunk.job
    return final


def _detach_hint(job_id: str) -> None:
    hint(f"\ndetached from job {job_id}; it keeps running.\n"
         f"  follow its output: pwctl logs {job_id} -f\n"
         f"  cancel it:         pwctl cancel {job_id}")


# ---------------------------------------------------------------- submit
def submit(
    script: Annotated[Path, typer.Argument(help="The driver script to run on the server (.py: with Python, "
                                                ".sh: with bash)")],
    args: Annotated[list[str] | None, typer.Argument(help="Arguments for the script: put them after --",
                                                     show_default=False)] = None,
    name: Annotated[str, typer.Option("--name", help="Job name (default: the script's name)")] = "",
    priority: Annotated[int, typer.Option("--priority", help="Scheduling priority of its programs "
                                                             f"(higher first, -{MAX_PRIORITY}..{MAX_PRIORITY})")] = 0,
    weight: Annotated[float, typer.Option("--weight", help="Proportional-share weight, a number in "
                                                           f"(0, {MAX_WEIGHT:g}]")] = 1.0,
    working_dir: Annotated[Path | None, typer.Option(
        "--working-dir", show_default=False,
        help="Directory uploaded with the script (at most 50 MiB zipped); the driver runs in it",
    )] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Print the job id and return at once")]
    = False,
    server: ServerOpt = None,
    output: Annotated[Format | None, typer.Option(
        "--output", "-o", case_sensitive=False, show_default=False,
        help="json: print the job document on stdout (attached: when it ended; its output goes to stderr)")
    ] = None,
    proxy: Annotated[bool, typer.Option(
        "--proxy", help="Run an unmodified JAX script with JAX_PLATFORMS=proxy: its JAX computes on the "
                        "cluster (slice: --slice, else a fresh one of --devices devices)")] = False,
    slice_name: Annotated[str, typer.Option(
        "--slice", help="With --proxy: the named slice the script computes on (default: $PATHWAYS_SLICE)")] = "",
    devices: Annotated[int, typer.Option(
        "--devices", help="With --proxy and no slice: the size of the fresh slice (default: $PATHWAYS_DEVICES, "
                          "else every free device of the island with the most)", show_default=False)] = 0,
) -> None:
    """Run a driver script on the server as a job; attached, stream its output and exit with its code.

    Example: pwctl submit train.py --working-dir . -- --steps 100
    """
    from schemas.pathways.v1 import controller_pb2 as cpb
    from schemas.views import JobView

    from .. import proxy_plugin

    if weight <= 0:
        raise InvalidArgument(f"--weight must be > 0, not {weight:g}")
    if abs(priority) > MAX_PRIORITY:  # the controller's range (pwctl/limits.py), said before the upload
        raise InvalidArgument(f"--priority {priority} is out of range: use -{MAX_PRIORITY}..{MAX_PRIORITY}")
    if not weight <= MAX_WEIGHT:  # likewise (NaN included), in the controller's words
        raise InvalidArgument(share_problem("job", priority, weight))
    try:
        data = script.read_bytes()
    except OSError as e:
        raise InvalidArgument(f"cannot read {script}: {e.strerror or e}") from None
    if not data.strip():
        raise InvalidArgument(f"{script} is empty")
    if script.suffix not in DRIVER_SUFFIXES:
        raise InvalidArgument(f"{script}: pwctl submit runs .py scripts with Python and .sh scripts with bash; "
                              f"wrap anything else in a .sh script (e.g. `exec ./{script.name} \"$@\"`)")
    if (slice_name or devices) and not proxy:
        raise InvalidArgument("--slice and --devices choose the slice of a --proxy job (a `pw` driver picks "
                              "its own slices)")
    if devices < 0:
        raise InvalidArgument(f"--devices must be > 0, not {devices}")
    zipped = zip_with_progress(working_dir) if working_dir is not None else b""
    entry = _entrypoint(script, working_dir)
    if proxy:
        if script.suffix != ".py":
            raise InvalidArgument(f"{script}: --proxy runs Python scripts")
        zipped = _with_file(zipped, entry, data)  # the script beside the driver that runs it
        environ = dict(os.environ)
        if slice_name:
            environ["PATHWAYS_SLICE"] = slice_name
        if devices:
            environ["PATHWAYS_DEVICES"] = str(devices)
            if not slice_name:
                environ.pop("PATHWAYS_SLICE", None)
        entry, data = proxy_plugin.JOB_DRIVER, proxy_plugin.job_driver(entry, environ)
        name = name or script.name
    req = cpb.SubmitJobRequest(name=name, entrypoint=entry, script=data,
                               args=list(args or []), working_dir_zip=zipped, priority=priority,
                               weight=weight)
    with client(server, timeout=120.0) as c:
        job = c.submit_job(req)
        as_json = output == Format.json
        if detach:
            if as_json:
                emit_item(Format.json, "Job", JobView.of(job), lambda v: None)
            else:
                sys.stdout.write(job.id + "\n")
            hint(f"job {job.id} submitted; follow it with `pwctl logs {job.id} -f`")
            return
        hint(f"job {job.id} submitted; watch it with `pwctl status --watch`")
        try:
            final = stream_output(c, job.id, sys.stderr if as_json else sys.stdout, follow=True)
        except KeyboardInterrupt:
            _detach_hint(job.id)
            raise typer.Exit(EXIT_INTERRUPTED) from None
    if final is None or not ended(final.state):
        raise PathwaysError(f"lost the output stream of job {job.id}; it may still be running: "
                            f"`pwctl logs {job.id} -f`")
    if as_json:
        emit_item(Format.json, "Job", JobView.of(final), lambda v: None)
    raise typer.Exit(report_end(final))


# ---------------------------------------------------------------- logs / cancel / wait
def logs(
    job_id: JobIdArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing output until the job ends")]
    = False,
    tail: Annotated[int, typer.Option("--tail", "-n", help="Only the last N lines (0: all)", min=0)] = 0,
    server: ServerOpt = None,
) -> None:
    """Print a job's output (stdout and stderr of its driver)."""
    from schemas.pathways.v1 import controller_pb2 as cpb

    check_int32("--tail", tail)

    with client(server) as c:
        job = c.get_job(job_id)
        try:
            final = stream_output(c, job.id, sys.stdout, follow=follow, tail=tail)
        except KeyboardInterrupt:
            raise typer.Exit(0) from None
    if follow and final is not None and ended(final.state):
        code = f" (exit code {final.exit_code})" if final.has_exit_code else ""
        reason = f": {final.reason}" if final.reason and final.state != cpb.JOB_STATE_SUCCEEDED else ""
        hint(f"job {final.id} {state_name(final)}{code}{reason}")


def cancel(
    job_ids: Annotated[list[str], typer.Argument(help="Job ids (unique prefixes are enough)",
                                                 autocompletion=_complete_job_ids)],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
    server: ServerOpt = None,
) -> None:
    """Cancel jobs: SIGTERM to the driver, SIGKILL after 5 s. Asks first unless -y."""
    with client(server) as c:
        # resolve every id first, so a typo cancels nothing and the prompt shows full ids
        jobs = list({j.id: j for j in (c.get_job(i) for i in job_ids)}.values())
        live = [j for j in jobs if not ended(j.state)]
        for j in jobs:
            if ended(j.state):
                hint(f"job {j.id} already ended ({state_name(j)})")
        if not live:
            return
        ids = ", ".join(j.id for j in live)
        if not yes:
            confirm_or_exit(f"cancel job{'s' if len(live) > 1 else ''} {ids}?",
                            f"refusing to cancel {ids} without confirmation: stdin is not a terminal; "
                            "pass -y to cancel", "nothing cancelled")
        failed: PathwaysError | None = None
        for j in live:
            try:
                done = c.cancel_job(j.id)
            except PathwaysError as e:
                sys.stderr.write(f"error: {e}\n")
                failed = failed or e
                continue
            hint(f"job {done.id} {state_name(done)}" if ended(done.state)
                 else f"job {done.id} is being cancelled")
    if failed is not None:
        raise typer.Exit(failed.exit_code)


def wait(
    job_id: JobIdArg,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Give up after S seconds (exit 124)",
                                                  show_default=False)] = None,
    server: ServerOpt = None,
) -> None:
    """Wait until a job ends; exit with its exit code (1 when cancelled or killed, 124 when --timeout
    expired first, 130 on Ctrl-C: the job goes on either way)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    interval = 0.1
    job_name = job_id
    try:
        with client(server) as c:
            job = c.get_job(job_id)
            job_name = job.id
            while not ended(job.state):
                if deadline is not None and time.monotonic() >= deadline:
                    hint(f"job {job.id} still {state_name(job)} after {timeout:g} s")
                    raise typer.Exit(EXIT_TIMEOUT)
                pause = interval if deadline is None else min(interval, max(0.0, deadline - time.monotonic()))
                time.sleep(pause)
                interval = min(1.0, interval * 1.5)
                job = c.get_job(job.id)
    except KeyboardInterrupt:
        hint(f"\nstopped waiting; job {job_name} goes on (`pwctl wait {job_name}` to wait again)")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    raise typer.Exit(report_end(job))


# ---------------------------------------------------------------- jobs list / describe
def _exit(v: JobView) -> str:
    return "-" if v.exit_code is None else str(v.exit_code)


def _duration(v: JobView) -> str:
    from datetime import UTC, datetime

    if not v.started_at:
        return "-"
    start = datetime.fromisoformat(v.started_at.replace("Z", "+00:00"))
    end = datetime.fromisoformat(v.ended_at.replace("Z", "+00:00")) if v.ended_at else datetime.now(UTC)
    s = max(0.0, (end - start).total_seconds())
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


@app.command("list")
def list_(
    state: Annotated[str, typer.Option(
        "--state", help="Only jobs in this state: pending, running, succeeded, failed, cancelled")] = "",
    all_: Annotated[bool, typer.Option("--all", "-a", help="Every job (default: active, last 20 ended)")]
    = False,
    server: ServerOpt = None,
    output: OutputOpt = Format.table,
) -> None:
    """List jobs: state, exit code, age, duration, reason."""
    with client(server) as c:
        found = c.jobs(state=state, all=all_)
    from schemas.views import JobView  # pydantic: once the controller answered

    items = [JobView.of(j) for j in found]
    emit_list(output, "JobList", items, ["id", "name", "state", "exit", "submitted", "duration", "reason"],
              lambda v: [v.id, v.name, v.state, _exit(v), age(v.submitted_at), _duration(v),
                         v.reason or v.pending_reason or "-"],
              ["programs", "runs", "slices", "priority", "weight", "pid"],
              lambda v: [str(v.programs), str(v.runs), ",".join(v.slices) or "-", str(v.priority),
                         f"{v.weight:g}", str(v.pid or "-")],
              name=lambda v: v.id)


def render(v: JobView) -> None:
    out = stdout()
    command = " ".join([v.entrypoint, *v.args])
    reason = f" ({v.reason})" if v.reason and v.reason != v.state else ""  # not "cancelled (cancelled)"
    rows = [("id", v.id), ("name", v.name), ("state", v.state + reason),
            ("exit code", _exit(v)), ("command", command), ("priority", str(v.priority)),
            ("weight", f"{v.weight:g}"), ("pid", str(v.pid or "-")),
            ("submitted", v.submitted_at or "-"), ("started", v.started_at or "-"),
            ("ended", v.ended_at or "-"), ("duration", _duration(v)),
            ("slices", ", ".join(v.slices) or "-"), ("programs", str(v.programs)), ("runs", str(v.runs))]
    if v.pending_reason:
        rows.append(("waiting", v.pending_reason))
    if v.held_back:
        rows.append(("held back", v.held_back))
    if v.last_hang:
        rows.append(("last hang", v.last_hang))
    for key, value in rows:
        out.print(f"{key + ':':<12}{value}", highlight=False, markup=False)


@app.command("describe")
def describe(job_id: JobIdArg, server: ServerOpt = None, output: OutputOpt = Format.table) -> None:
    """Show a job: state, times, exit code, slices, programs, runs, why it waits."""
    with client(server) as c:
        found = c.get_job(job_id)
    from schemas.views import JobView  # pydantic: once the controller answered

    view = JobView.of(found)
    if output == Format.name:
        sys.stdout.write(view.id + "\n")
    else:
        emit_item(output, "Job", view, render)


for _cmd, _fn in (("logs", logs), ("cancel", cancel), ("wait", wait)):
    app.command(_cmd, help=f"Same as `pwctl {_cmd}`.")(_fn)


def register(root: typer.Typer) -> None:
    root.command("submit")(submit)
    root.command("logs")(logs)
    root.command("cancel")(cancel)
    root.command("wait")(wait)
    root.add_typer(app, name="jobs")
    root.add_typer(app, name="job", hidden=True)
