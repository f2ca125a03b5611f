"""`pwctl up` and `pwctl down`: a whole local cluster in one command."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .. import local, paths
from ..client import Client
from ..errors import ConnectionFailed
from ..transport import NO_RETRY
from .common import confirm_or_exit, hint
from .jobs import TERMINAL

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


def down(
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Cancel running jobs without asking")] = False,
) -> None:
    """Stop the processes `pwctl up` started (by pid; nothing else), cancelling its running jobs first.

    Jobs outlive a controller restart (each runs under its own supervisor), so stopping the cluster
    cancels them explicitly: after a confirmation, which -y skips."""
    address = local.recorded_address()
    if address is not None:
        _cancel_running_jobs(address, yes)
    result = local.down()
    if result is None:
        hint("no cluster started by `pwctl up` here")
        return
    what = [f"{len(result.stopped_workers)} worker(s)"]
    if result.controller_pid:
        what.append(f"the controller (pid {result.controller_pid})")
    sys.stdout.write(f"stopped {' and '.join(what)}\n")


def _cancel_running_jobs(address: str, yes: bool) -> None:
    """Cancels the jobs still running on the controller at `address` (none if it does not answer)."""
    try:
        with Client(address, timeout=15.0, retry=NO_RETRY) as c:  # a cancel waits up to ~8 s
            live = [j for j in c.jobs() if j.state not in TERMINAL]
            if not live:
                return
            ids = ", ".join(j.id for j in live)
            if not yes:
                confirm_or_exit(f"cancel running job(s) {ids} and stop the cluster?",
                                f"jobs {ids} are still running; pass -y to cancel them and stop the cluster",
                                "nothing stopped")
            for j in live:
                c.cancel_job(j.id)
            hint(f"cancelled {ids}")
    except ConnectionFailed:
        hint(f"the controller at {address} does not answer; stopping its processes without cancelling jobs")


def register(root: typer.Typer) -> None:
    root.command("up")(up)
    root.command("down")(down)
