"""`pwctl device ...` and `pwctl host ...`"""

from __future__ import annotations

from typing import Annotated

import typer

from schemas.views import DeviceView, HostView

from .common import Format, OutputOpt, ServerOpt, age, client, emit_list

app = typer.Typer(help="Physical devices (accelerators or virtual CPU devices).", no_args_is_help=True)
hosts_app = typer.Typer(help="Hosts: one worker process each.", no_args_is_help=True)

IslandOpt = Annotated[str, typer.Option("--island", "-i", help="Only this island")]


@app.command("list")
def list_(island: IslandOpt = "", server: ServerOpt = None, output: OutputOpt = Format.table) -> None:
    """List devices: island, host, id, kind, state, last heartbeat."""
    with client(server) as c:
        items = [DeviceView.of(d) for d in c.devices(island)]
    emit_list(output, "DeviceList", items, ["island", "host", "device", "kind", "state", "slices", "heartbeat"],
              lambda d: [d.island, d.host, str(d.id), d.kind, d.state, str(d.slices), age(d.last_heartbeat)],
              ["local", "last heartbeat"], lambda d: [str(d.local_index), d.last_heartbeat],
              name=lambda d: str(d.id))


@hosts_app.command("list")
def hosts_list(island: IslandOpt = "", server: ServerOpt = None, output: OutputOpt = Format.table) -> None:
    """List hosts (workers): island, address, state, devices, last heartbeat."""
    with client(server) as c:
        items = [HostView.of(h) for h in c.hosts(island)]
    emit_list(output, "HostList", items, ["host", "island", "address", "state", "devices", "heartbeat"],
              lambda h: [h.name, h.island, h.address, h.state, f"{h.devices} {h.device_kind}",
                         age(h.last_heartbeat)],
              ["pid", "last heartbeat"], lambda h: [str(h.pid), h.last_heartbeat])


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="device")
    root.add_typer(hosts_app, name="host")
