"""`pwctl up` and `pwctl down`: a whole local cluster in one command."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from .. import paths
from ..errors import ConnectionFailed
from .common import (
    NoBulkLinksOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsClientCertOpt,
    TlsClientKeyOpt,
    TlsKeyOpt,
    TlsRequireOpt,
    TlsServerNameOpt,
    confirm_or_exit,
    hint,
    hint_local_clients,
    local_client_tls,
    server_tls,
)

MAX_LOCAL_ISLANDS = 64  # `pwctl up` starts a worker process per island on this machine
IslandsOpt = Annotated[int | None, typer.Option(
    "--islands", min=1, max=MAX_LOCAL_ISLANDS, show_default=False,
    help=f"Islands, one worker process each on this machine (default 2; 1 with --devices all; at most "
         f"{MAX_LOCAL_ISLANDS})")]
DevicesOpt = Annotated[str, typer.Option(
    "--devices", help="Virtual CPU devices per island, or 'all': every accelerator of this machine, one island")]
ListenOpt = Annotated[str | None, typer.Option(
    "--listen", show_default=False, help=f"Controller address, HOST:PORT (default: {paths.DEFAULT_ADDRESS})")]
DbOpt = Annotated[str | None, typer.Option("--db", show_default=False,
                                           help="Database URL (default: SQLite in the data directory)")]
NoTokenOpt = Annotated[bool, typer.Option(
    "--no-token", help="The controller and workers require no cluster token (a private machine)")]


def up(
    islands: IslandsOpt = None,
    devices: DevicesOpt = "4",
    listen: ListenOpt = None,
    db: DbOpt = None,
    no_token: NoTokenOpt = False,
    no_bulk_links: NoBulkLinksOpt = False,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_server_name: TlsServerNameOpt = None,
    tls_require_client_cert: TlsRequireOpt = False,
    tls_client_cert: TlsClientCertOpt = None,
    tls_client_key: TlsClientKeyOpt = None,
) -> None:
    """Start a local cluster (controller + one worker per island) and wait until it is ready.
    Run again, it starts only what is missing and says what runs (--db, --no-token and
    --no-bulk-links reach only the processes it starts).

    With --tls-cert/--tls-key/--tls-ca every process serves TLS only (the certificate must name the
    --listen address, e.g. IP:127.0.0.1) and clients here find the CA in the data directory; with
    --tls-require-client-cert also --tls-client-cert/--tls-client-key, their own certificate."""
    count = _devices(devices)
    tls = server_tls(tls_cert, tls_key, tls_ca, tls_server_name, tls_require_client_cert)
    client = local_client_tls(tls, tls_client_cert, tls_client_key)
    if count is None and islands not in (None, 1):
        raise typer.BadParameter("--devices all gives every accelerator of this machine to one worker, so one "
                                 "island: leave --islands out (more islands: `pwctl worker start` on other hosts)",
                                 param_hint="--islands")
    from .. import local

    n = islands or (2 if count is not None else 1)

    def starting(controller: bool, workers: list[str]) -> None:  # only when something starts
        if controller and len(workers) == n:
            hint(f"starting {n} island(s) x {devices if count is None else f'{count} device(s)'} ...")
            return
        what = ["the controller"] if controller else []
        if workers:
            each = "this machine's accelerators" if count is None else f"{count} device(s) each"
            what.append(f"worker(s) {', '.join(workers)} ({each})")
        hint(f"starting {' and '.join(what)} ...")

    result = local.up(islands=n, devices=devices if count is None else count, listen=listen or paths.DEFAULT_ADDRESS,
                      db=db, no_token=no_token, bulk_links=not no_bulk_links, tls=tls, client_tls=client,
                      starting=starting)
    sizes = _island_sizes(result.address, result.islands, result.token)
    already = not result.started_workers and not result.controller_started
    secure = " (TLS)" if result.tls else ""
    what = ", ".join(f"{i} ({sizes.get(i, '?')} device(s))" for i in result.islands)
    total = sum(v for v in sizes.values())
    if already:
        pids = ", ".join(f"{w} pid {p}" for w, p in sorted(result.worker_pids.items()))
        sys.stdout.write(f"already up at {result.address}{secure}: {len(result.islands)} island(s): {what}, "
                         f"{total} device(s) in all (workers {pids}); nothing started\n")
    else:
        sys.stdout.write(f"cluster up at {result.address}{secure}: {len(result.islands)} island(s): "
                         f"{what}, {total} device(s) in all\n")
    if listen and not result.controller_started and listen != result.address:
        hint(f"--listen {listen} not used: this data directory's controller runs at {result.address} (`pwctl down` "
             "first to start it elsewhere; another cluster: another PATHWAYS_HOME)")
    if result.foreign_controller is not None:
        hint(f"the controller (pid {result.foreign_controller}) was started by `pwctl server start`, not by `pwctl "
             "up`: `pwctl down` leaves it running (`pwctl server stop` stops it)")
    if result.controller_started:
        hint_local_clients(result.tls, client)
    hint("next: `pwctl status --watch`, `pwctl island list`; stop with `pwctl down`")
    theirs = os.environ.get("PWCTL_TOKEN")
    if result.token and theirs and theirs != result.token:
        hint(f"note: $PWCTL_TOKEN is not this cluster's token ({paths.token_path()}); pwctl calls made with it "
             "are refused: unset it to talk to this cluster")


def _devices(text: str) -> int | None:
    """`--devices`: a positive count, or None for 'all'. Raises BadParameter."""
    if text.strip().lower() == "all":
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise typer.BadParameter(f"{text!r} is neither a positive number nor 'all'", param_hint="--devices")
    return int(text)


def _island_sizes(address: str, names: list[str], token: str | None) -> dict[str, int]:
    """Island name -> devices, as the controller counts them ({} when it does not answer)."""
    from ..client import Client
    from ..transport import NO_RETRY

    try:
        with Client(address, token=token, timeout=10.0, retry=NO_RETRY) as c:
            return {i.name: i.devices for i in c.islands() if i.name in names}
    except ConnectionFailed:
        return {}


def down(
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Cancel running jobs without asking")] = False,
) -> None:
    """Stop the processes `pwctl up` started (by pid; nothing else), cancelling its running jobs first.

    Jobs outlive a controller restart (each runs under its own supervisor), so stopping the cluster
    cancels them explicitly: after a confirmation, which -y skips."""
    from .. import local

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
    if result.left_controller is not None:
        hint(f"left the controller (pid {result.left_controller}) running: `pwctl up` did not start it "
             "(`pwctl server stop` stops it)")
    if result.left_workers:
        names = ", ".join(f"{name} (pid {pid})" for name, pid in result.left_workers.items())
        hint(f"left worker(s) {names} running: `pwctl up` did not start them (`pwctl worker stop NAME` stops one)")


def _cancel_running_jobs(address: str, yes: bool) -> None:
    """Cancels the jobs still running on the controller at `address` (none if it does not answer)."""
    from ..client import Client
    from ..transport import NO_RETRY
    from .jobs import ended

    try:
        # the local cluster's own token, whatever $PWCTL_TOKEN says (it may name another cluster)
        with Client(address, token=paths.read_token(), timeout=15.0, retry=NO_RETRY) as c:  # a cancel: ~8 s
            live = [j for j in c.jobs() if not ended(j.state)]
            if not live:
                return
            ids = ", ".join(j.id for j in live)
            if not yes:
                confirm_or_exit(f"cancel running job(s) {ids} and stop the cluster?",
                                f"job {ids} is still running; pass -y to cancel it and stop the cluster"
                                if len(live) == 1 else
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
