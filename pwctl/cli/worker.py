"""`pwctl worker start|stop`"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .common import (
    ServerOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    TlsRequireOpt,
    TlsServerNameOpt,
    hint,
    server_tls,
)

app = typer.Typer(help="Workers: one process per host, owning its devices.", no_args_is_help=True)


IslandOpt = Annotated[str, typer.Option("--island", "-i", help="Island the worker's devices belong to")]
DevicesOpt = Annotated[str, typer.Option(
    "--devices", "-d", help="Number of virtual CPU devices, or 'all' for the real accelerators")]
NameOpt = Annotated[str | None, typer.Option("--name", show_default=False,
                                             help="Stable host name (default: <hostname>-<island>)")]
ListenOpt = Annotated[str, typer.Option("--listen", help="Address the worker serves on")]
ForegroundOpt = Annotated[bool, typer.Option("--foreground", help="Run in this terminal, log to stderr")]
WaitOpt = Annotated[bool, typer.Option("--wait/--no-wait", help="Wait until the worker is registered")]
NoTokenOpt = Annotated[bool, typer.Option(
    "--no-token", help="Check no cluster token (a private machine); callers still need the credentials "
                       "the controller issues")]


@app.command("start")
def start(
    island: IslandOpt,
    devices: DevicesOpt,
    server: ServerOpt = None,
    name: NameOpt = None,
    listen: ListenOpt = "127.0.0.1:0",
    foreground: ForegroundOpt = False,
    wait: WaitOpt = True,
    no_token: NoTokenOpt = False,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_server_name: TlsServerNameOpt = None,
    tls_require_client_cert: TlsRequireOpt = False,
) -> None:
    """Start a worker that registers with the controller and heartbeats (reconnecting on its own).

    With --tls-cert/--tls-key/--tls-ca it serves TLS only and reaches the controller and the other
    workers over TLS, presenting its certificate."""
    from .. import local, settings

    tls = server_tls(tls_cert, tls_key, tls_ca, tls_server_name, tls_require_client_cert)
    address = settings.resolve(server).address
    worker_name = name or local.default_worker_name(island)
    pid = local.start_worker(address, island, devices, worker_name, listen, detach=not foreground,
                             no_token=no_token, tls=tls)
    if wait:
        hint(f"waiting for worker {worker_name} to register with {address} ...")
        local.wait_workers_ready(address, {worker_name: pid}, timeout=60.0, tls=tls)
    sys.stdout.write(f"worker {worker_name} started (pid {pid}) on island {island}\n")
    hint(f"log: {local.worker_log_path(worker_name)}; stop with `pwctl worker stop {worker_name}`")


@app.command("stop")
def stop(name: Annotated[str, typer.Argument(help="Worker name, as given to `worker start --name`")]) -> None:
    """Stop a worker started from this machine (SIGTERM, SIGKILL after 5 s)."""
    from .. import local

    pid = local.stop_worker(name)
    sys.stdout.write(f"worker {name} stopped (pid {pid})\n")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="worker")
