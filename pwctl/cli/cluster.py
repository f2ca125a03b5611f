"""`pwctl up` and `pwctl down`: a whole local cluster in one command."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .. import local, paths
from .common import hint

IslandsOpt = Annotated[int, typer.Option("--islands", min=1, help="Islands, one worker each")]
DevicesOpt = Annotated[int, typer.Option("--devices", min=1, help="Virtual CPU devices per island")]
ListenOpt = Annotated[str, typer.Option("--listen", help="Controller address, HOST:PORT")]
DbOpt = Annotated[str | None, typer.Option("--db", show_default=False,
                                           help="Database URL (default: SQLite in the data directory)")]


def up(
    islands: IslandsOpt = 2,
    devices: DevicesOpt = 4,
    listen: ListenOpt = paths.DEFAULT_ADDRESS,
    db: DbOpt = None,
) -> None:
    """Start a local cluster (controller + one worker per island) and wait until it is ready."""
    hint(f"starting {islands} island(s) x {devices} device(s) ...")
    result = local.up(islands=islands, devices=devices, listen=listen, db=db)
    total = islands * devices
    sys.stdout.write(
        f"cluster up at {result.address}: {islands} island(s) ({', '.join(result.islands)}), "
        f"{devices} device(s) each, {total} in all\n"
    )
    if not result.started_workers and not result.controller_started:
        hint("(it was already up)")
    hint("next: `pwctl island list`, `pwctl device list`; stop with `pwctl down`")


def down() -> None:
    """Stop the processes `pwctl up` started (by pid; nothing else)."""
    result = local.down()
    if result is None:
        hint("no cluster started by `pwctl up` here")
        return
    what = [f"{len(result.stopped_workers)} worker(s)"]
    if result.controller_pid:
        what.append(f"the controller (pid {result.controller_pid})")
    sys.stdout.write(f"stopped {' and '.join(what)}\n")


def register(root: typer.Typer) -> None:
    root.command("up")(up)
    root.command("down")(down)
