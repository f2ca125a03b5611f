"""`pwctl status [--watch]` and `pwctl trace (JOB|PROGRAM)`.

`status` renders one snapshot of the cluster; `--watch` keeps rendering the controller's
Watch stream (server-pushed, no polling) in a Rich live view, or, with `-o json` or when
stdout is not a terminal, writes one `ClusterStatus` JSON document per line per update.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from schemas.views import ClusterStatusView, dump

from ..errors import NotFound
from .common import ServerOpt, age, client, hint, stdout

BAR_WIDTH = 12
QUEUE_ROWS = 12  # per island in the table; -o json has every entry


class StatusFormat(StrEnum):
    table = "table"
    json = "json"


StatusOutputOpt = Annotated[
    StatusFormat, typer.Option("--output", "-o", help="Output format", case_sensitive=False)
]


def status(
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Keep updating: a live view fed by the server.")
                     ] = False,
    interval: Annotated[float | None, typer.Option("--interval", "-n", min=0.1, show_default=False,
                                                   help="Seconds between updates with --watch (default 1).")
                        ] = None,
    server: ServerOpt = None,
    output: StatusOutputOpt = StatusFormat.table,
) -> None:
    """The cluster at a glance: devices (utilization, running node), slices, island queues, jobs,
    computations per second. With --watch, a live view; piped or with -o json, one JSON
    document (kind ClusterStatus) per line per update. Ctrl-C stops watching."""
    if interval is not None and not watch:
        raise typer.BadParameter("only with --watch (without it, status shows one snapshot)",
                                 param_hint="--interval")
    with client(server) as c:
        if not watch:
            view = ClusterStatusView.of(c.status())
            if output == StatusFormat.json:
                sys.stdout.write(dump(view) + "\n")
            else:
                stdout().print(render(view))
            return
        try:
            updates = (ClusterStatusView.of(s) for s in c.watch(interval or 1.0))
            if output == StatusFormat.json or not sys.stdout.isatty():
                _json_lines(updates)
            else:
                _live(updates)
            hint("the controller ended the watch: it is shutting down")
        except KeyboardInterrupt:
            pass
        except BrokenPipeError:  # `pwctl status --watch | head`: the reader left; say nothing
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _json_lines(updates: Iterator[ClusterStatusView]) -> None:
    for view in updates:
        sys.stdout.write(view.model_dump_json(by_alias=True) + "\n")
        sys.stdout.flush()


def _live(updates: Iterator[ClusterStatusView]) -> None:
    console = stdout()
    first = next(updates, None)
    if first is None:
        return
    with Live(render(first), console=console, auto_refresh=False, screen=False) as live:
        for view in updates:
            live.update(render(view), refresh=True)


# ---- rendering ----


def bar(fraction: float, width: int = BAR_WIDTH) -> Text:
    """A utilization bar with its percentage: '██████░░░░░░  50%'."""
    fraction = min(1.0, max(0.0, fraction))
    full = round(fraction * width)
    style = "green" if fraction < 0.5 else "yellow" if fraction < 0.9 else "red"
    text = Text("█" * full, style=style)
    text.append("░" * (width - full), style="dim")
    text.append(f" {fraction * 100:3.0f}%")
    return text


def _table(title: str, *columns: str) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold", box=None, header_style="bold",
              pad_edge=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    return t


def render(s: ClusterStatusView) -> RenderableType:
    parts: list[RenderableType] = []
    ready = sum(1 for d in s.devices if d.state == "available")
    head = Text(f"cluster at {s.at}: {len(s.islands)} island(s), {ready}/{len(s.devices)} devices up, ")
    head.append(f"{s.computations_per_s:g} computations/s", style="bold")
    head.append(f" ({s.computations_total} since start)")
    parts.append(head)

    devices = _table("devices", "ISLAND", "HOST", "DEVICE", "STATE", "UTILIZATION", "RUNNING")
    for d in s.devices:
        devices.add_row(d.island, d.host, f"{d.device_id} (local {d.local_index})", d.state,
                        bar(d.utilization), d.running or "-")
    parts += [Text(""), devices if s.devices else Text("devices: none (no worker has registered)")]

    if s.slices:
        slices = _table("slices", "SLICE", "STATE", "DEVICES", "MESH", "ISLAND", "OWNER", "PROGRAMS")
        for sl in s.slices:
            islands = ",".join(sorted({d.island for d in sl.devices})) or "-"
            mesh = "x".join(map(str, sl.spec.mesh)) or str(len(sl.devices))
            slices.add_row(sl.name, sl.state, ",".join(str(d.device_id) for d in sl.devices), mesh, islands,
                           sl.owner or "-", str(sl.programs))
        parts += [Text(""), slices]
    else:
        parts += [Text(""), Text("slices: none")]

    for q in s.queues:
        running = sum(1 for e in q.entries if e.state == "running")
        waiting = len(q.entries) - running
        title = f"queue of island {q.island} ({q.policy}): {running} running, {waiting} waiting"
        if not q.entries:
            parts += [Text(""), Text(title, style="bold")]
            continue
        queue = _table(title, "STATE", "RUN", "PROGRAM", "CLIENT", "JOB", "PRIORITY", "WEIGHT", "WAITING FOR")
        entries = sorted(q.entries, key=lambda e: not e.stalled_host)  # gangs held back by a host first
        for e in entries[:QUEUE_ROWS]:
            queue.add_row(e.state, str(e.run_id), e.program, e.client, e.job or "-", str(e.priority),
                          f"{e.weight:g}", e.reason or "-", style="red" if e.stalled_host else None)
        if len(q.entries) > QUEUE_ROWS:
            more = entries[QUEUE_ROWS:]
            counts = {st: sum(1 for e in more if e.state == st) for st in ("running", "waiting")}
            queue.add_row("...", f"and {' and '.join(f'{n} more {st}' for st, n in counts.items() if n)}"
                          " (all of them with -o json)")
        parts += [Text(""), queue]

    if s.jobs:
        jobs = _table("jobs (running and recent)", "JOB", "NAME", "STATE", "SUBMITTED", "EXIT", "REASON")
        for j in s.jobs:
            jobs.add_row(j.id, j.name or "-", j.state, age(j.submitted_at),
                         "-" if j.exit_code is None else str(j.exit_code), j.reason or "-")
        parts += [Text(""), jobs]
    return Group(*parts)


# ---- traces ----


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
    since_ns = parse_since(since) if since else 0
    with client(server) as c:
        try:
            resp, what = c.trace_window(job=target, since_unix_ns=since_ns, last=last or 0), "job"
        except NotFound:
            try:
                resp, what = c.trace_window(program=target, since_unix_ns=since_ns, last=last or 0), "program"
            except NotFound:
                raise NotFound(f"no node runs recorded for a job or program {target!r} (the controller keeps "
                               "the most recent ones, see --trace-retention; `pwctl jobs list`)") from None
    text = resp.chrome_trace_json
    doc = json.loads(text)
    other = doc.get("otherData", {})
    if str(out) == "-":
        sys.stdout.write(text + "\n")
        where = "stdout"
    else:
        out.write_text(text)
        where = str(out)
    hosts = sum(1 for e in doc["traceEvents"] if e.get("ph") == "M" and e.get("name") == "process_name")
    hint(f"wrote {where}: {other.get('node_runs', '?')} node runs of {what} {target} on "
         f"{other.get('devices', '?')} device(s) of {hosts} host(s); open it at https://ui.perfetto.dev "
         "or chrome://tracing")
    if resp.node_runs < resp.node_runs_total:
        hint(f"the window holds {resp.node_runs} of the {resp.node_runs_total} node runs kept; "
             "--since and --last choose another")


def parse_since(text: str) -> int:
    """`--since`: a duration ago ('90s', '10m', '2h', '1d', '1h30m') or an ISO-8601 time (UTC unless
    it says otherwise) -> Unix ns. Raises typer.BadParameter."""
    t = text.strip()
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?", t)
    if t and parts is not None and any(parts.groups()):
        d, h, m, s = (float(g) if g else 0.0 for g in parts.groups())
        return time.time_ns() - int((((d * 24 + h) * 60 + m) * 60 + s) * 1e9)
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


def register(root: typer.Typer) -> None:
    root.command("status")(status)
    root.command("trace")(trace)
