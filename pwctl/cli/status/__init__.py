"""`pwctl status [--watch]` (and `pwctl trace`, in trace.py).

`status` draws one update of the cluster (screen.py); `--watch` keeps drawing the controller's
Watch stream (server-pushed, no polling) in a full-screen live view sized to the terminal, or,
with `-o json` or when stdout is not a terminal, writes one `ClusterStatus` JSON document per
line per update. On a large cluster the screen summarises ("... and 1,930 more hosts") and
`-o json` pages its devices with `--limit` and `--page-token`, as `device list` does.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .. import common
from ..common import ServerOpt, check_int32, client, hint, stdout
from .trace import parse_since, trace

if TYPE_CHECKING:
    from rich.console import Console

    from schemas.views import ClusterStatusView

    from .screen import bar, render

__all__ = ["bar", "parse_since", "register", "render", "status", "trace"]


def __getattr__(name: str) -> Any:
    """`bar` and `render` (screen.py, which imports Rich and the views) load when first asked for."""
    if name in ("bar", "render"):
        from . import screen

        return getattr(screen, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

SCREEN_DEVICES = 1024  # devices one screen update asks for (it shows them grouped, then "and N more hosts")
SCREEN_QUEUE = 24  # queue entries per island one screen update asks for (the counts cover every gang)


class StatusFormat(StrEnum):
    table = "table"
    json = "json"


StatusOutputOpt = Annotated[
    StatusFormat, typer.Option("--output", "-o", help="Output format", case_sensitive=False)
]


def status(
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Keep updating: a live view fed by the server.")
                     ] = False,
    interval: Annotated[float | None, typer.Option("--interval", "-n", min=0.1, max=3600, show_default=False,
                                                   help="Seconds between updates with --watch (default 1; at "
                                                        "most 3600).")
                        ] = None,
    limit: Annotated[int, typer.Option("--limit", "-l", min=0, help="-o json: devices per document (0: all); "
                                       "the next page with --page-token")] = 0,
    page_token: Annotated[str, typer.Option("--page-token", show_default=False,
                                            help="-o json: the devices after the page that printed this token")
                          ] = "",
    server: ServerOpt = None,
    output: StatusOutputOpt = StatusFormat.table,
) -> None:
    """The cluster at a glance: the cluster line, gangs held back by a host, islands (utilization,
    queues), what each device runs now, jobs and the longest waits. With --watch, a live view that
    fits the terminal; piped or with -o json, one JSON document (kind ClusterStatus) per line per
    update, with everything the screen shows. Ctrl-C stops watching."""
    check_int32("--limit", limit)
    if interval is not None and not watch:
        raise typer.BadParameter("only with --watch (without it, status shows one snapshot)",
                                 param_hint="--interval")
    as_json = output == StatusFormat.json or (watch and not sys.stdout.isatty())
    if (limit or page_token) and not as_json:
        raise typer.BadParameter("only with -o json (the screen shows what fits and says how much more there is)",
                                 param_hint="--limit" if limit else "--page-token")
    query: dict[str, Any] = {"device_limit": limit, "page_token": page_token} if as_json else \
        {"device_limit": SCREEN_DEVICES, "queue_limit": SCREEN_QUEUE}
    with client(server) as c:
        if not watch:
            answer = c.status(**query)
            from schemas.views import ClusterStatusView, dump  # pydantic: once the controller answered

            view = ClusterStatusView.of(answer)
            if as_json:
                sys.stdout.write(dump(view) + "\n")
                _page_hint(view)
            else:
                from .screen import render  # Rich

                console = stdout()
                console.print(render(view, console.width, None, c.address), crop=True)
            return
        try:
            updates = _views(c.watch(interval or 1.0, **query))
            if as_json:
                _json_lines(updates)
            else:
                _live(updates, c.address)
            hint("the controller ended the watch: it is shutting down")
        except KeyboardInterrupt:
            pass
        except BrokenPipeError:  # `pwctl status --watch | head`: the reader left; say nothing
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _views(statuses: Iterator[Any]) -> Iterator[ClusterStatusView]:
    """The views of a Watch stream's updates, the views' module (pydantic) loaded once the first
    arrived: a controller that is not there fails the command before it is."""
    first = next(statuses, None)
    if first is None:
        return
    from schemas.views import ClusterStatusView

    yield ClusterStatusView.of(first)
    for s in statuses:
        yield ClusterStatusView.of(s)


def _page_hint(view: ClusterStatusView) -> None:
    if view.next_page_token:
        hint(f"{len(view.devices):,} of {view.devices_total:,} devices; the next ones: "
             f"--page-token {view.next_page_token}")


def _json_lines(updates: Iterator[ClusterStatusView]) -> None:
    for view in updates:
        sys.stdout.write(view.model_dump_json(by_alias=True) + "\n")
        sys.stdout.flush()


def _live(updates: Iterator[ClusterStatusView], address: str) -> None:
    """A full-screen view, redrawn for each update at the terminal's size of the moment."""
    first = next(updates, None)
    if first is None:
        return
    from rich.live import Live

    from .screen import render

    console = common.stdout()

    def draw(view: ClusterStatusView) -> object:
        width, height = console.size
        return render(view, width, height - 1, address)

    live = Live(draw(first), console=console, auto_refresh=False, screen=True, transient=False)  # type: ignore[arg-type]
    with synchronized(console):
        live.start(refresh=True)
    try:
        for view in updates:
            frame = draw(view)
            with synchronized(console):
                live.update(frame, refresh=True)  # type: ignore[arg-type]
    finally:
        live.stop()


# DEC private mode 2026, "synchronized output": a terminal that knows it shows what comes between
# the two as one frame (no half-drawn screen while a frame is written); one that does not ignores
# an unknown private mode.
BEGIN_SYNC, END_SYNC = "\x1b[?2026h", "\x1b[?2026l"


@contextlib.contextmanager
def synchronized(console: Console) -> Iterator[None]:
    """Writes one frame as one update on terminals that support synchronized output."""
    if not console.is_terminal:
        yield
        return
    console.file.write(BEGIN_SYNC)
    try:
        yield  # Rich writes the frame to console.file when its print returns
    finally:
        console.file.write(END_SYNC)
        console.file.flush()


def register(root: typer.Typer) -> None:
    root.command("status")(status)
    root.command("trace")(trace)
