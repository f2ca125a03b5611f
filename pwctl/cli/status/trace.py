"""`pwctl trace (JOB|PROGRAM)`: a job's or program's gang-scheduled timeline as a Chrome trace."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ...errors import InvalidArgument, NotFound
from ..common import ServerOpt, check_int32, client, hint

if TYPE_CHECKING:
    from schemas.pathways.v1 import controller_pb2 as cpb

    from ...client import Client


def trace(
    target: Annotated[str, typer.Argument(
        help="A job id, or a program id or name (a unique prefix is enough).", show_default=False)],
    out: Annotated[Path, typer.Option("--output", "-o", help="Where to write the trace ('-': stdout).")
                   ] = Path("trace.json"),
    since: Annotated[str, typer.Option(
        "--since", help="Only node runs that ended since then: a duration ago (90s, 10m, 2h, 1d) or a UTC "
        "ISO-8601 time.", show_default=False)] = "",
    last: Annotated[int | None, typer.Option("--last", min=1, help="Only the last N node runs.",
                                             show_default=False)] = None,
    server: ServerOpt = None,
) -> None:
    """Write the gang-scheduled timeline of a job or program as a Chrome trace (open it in
    https://ui.perfetto.dev or chrome://tracing): one track per device, one slice per node run.
    A long job's trace is a window: the newest 200,000 node runs unless --last/--since say."""
    check_int32("--last", last)
    since_ns = parse_since(since) if since else 0
    if str(out) != "-" and not out.parent.is_dir():  # before the controller builds the trace
        raise InvalidArgument(f"cannot write {out}: no directory {out.parent}")
    with client(server) as c:
        try:
            resp, what = c.trace_window(job=target, since_unix_ns=since_ns, last=last or 0), "job"
        except NotFound:
            try:
                resp, what = c.trace_window(program=target, since_unix_ns=since_ns, last=last or 0), "program"
            except NotFound:
                resp, what = _no_runs_kept(c, target), "job"
        if what == "job":  # the hint names the job, not the prefix it was given by
            with contextlib.suppress(NotFound):
                target = c.get_job(target).id
    text = resp.chrome_trace_json
    doc = json.loads(text)
    other = doc.get("otherData", {})
    if str(out) == "-":
        sys.stdout.write(text + "\n")
        where = "stdout"
    else:
        try:
            out.write_text(text)
        except OSError as e:
            raise InvalidArgument(f"cannot write {out}: {e.strerror or e}") from None
        where = str(out)
    hosts = sum(1 for e in doc["traceEvents"] if e.get("ph") == "M" and e.get("name") == "process_name")
    hint(f"wrote {where}: {other.get('node_runs', '?')} node runs of {what} {target} on "
         f"{other.get('devices', '?')} device(s) of {hosts} host(s); open it at https://ui.perfetto.dev "
         "or chrome://tracing")
    if resp.node_runs < resp.node_runs_total:
        hint(f"the window holds {resp.node_runs} of the {resp.node_runs_total} node runs kept; "
             "--since and --last choose another")


def _no_runs_kept(c: Client, target: str) -> cpb.TraceResponse:
    """The controller holds no node runs for `target`: an empty trace for a listed job that ran
    none (yet), else NotFound saying why (a job whose node runs were dropped, or nothing by that name)."""
    from schemas.pathways.v1 import controller_pb2 as cpb

    try:
        job = c.get_job(target)
    except NotFound:
        raise NotFound(f"no job or program {target!r} has node runs recorded (`pwctl jobs list`; a program's id "
                       "or name)") from None
    if job.runs:
        raise NotFound(f"job {job.id} ran {job.runs:,} program run(s), but none of its node runs are kept any more: "
                       "the controller keeps the newest up to `pwctl server start --trace-retention` (default "
                       "512MiB), the oldest go first")
    hint(f"job {job.id} has run no computations on the cluster (yet): its trace is empty")
    doc = {"traceEvents": [], "displayTimeUnit": "ms", "otherData": {"job": job.id, "node_runs": 0, "devices": 0}}
    return cpb.TraceResponse(chrome_trace_json=json.dumps(doc))


def parse_since(text: str) -> int:
    """`--since`: a duration ago ('90s', '10m', '2h', '1d', '1h30m') or an ISO-8601 time (UTC unless
    it says otherwise) -> Unix ns. Raises typer.BadParameter."""
    t = text.strip()
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?", t)
    if t and parts is not None and any(parts.groups()):
        d, h, m, s = (float(g) if g else 0.0 for g in parts.groups())
        ago = time.time_ns() - int((((d * 24 + h) * 60 + m) * 60 + s) * 1e9)
        if ago < 0:
            raise typer.BadParameter(f"{text!r} ago is before 1970", param_hint="--since")
        return ago
    try:
        at = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise typer.BadParameter(f"{text!r} is neither a duration (90s, 10m, 2h, 1d) nor an ISO-8601 time",
                                 param_hint="--since") from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    if not 0 <= at.timestamp() < 2**63 / 1e9:
        raise typer.BadParameter(f"{text!r} is out of range (1970 to 2262)", param_hint="--since")
    return int(at.timestamp() * 1e9)


