"""`pwctl device ...` and `pwctl host ...`"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from .common import Format, OutputOpt, ServerOpt, age, client, delete_each, emit_list, hint

app = typer.Typer(help="Physical devices (accelerators or virtual CPU devices).", no_args_is_help=True)
hosts_app = typer.Typer(help="Hosts: one worker process each.", no_args_is_help=True)

IslandOpt = Annotated[str, typer.Option("--island", "-i", help="Only this island")]
LimitOpt = Annotated[int, typer.Option("--limit", "-l", min=0,
                                       help="At most this many, in (island, host) order (0: all)")]


class HostState(StrEnum):
    ready = "ready"
    lost = "lost"
    reconnecting = "reconnecting"


class DeviceState(StrEnum):
    available = "available"
    lost = "lost"
    reconnecting = "reconnecting"


HostStateOpt = Annotated[HostState | None, typer.Option("--state", help="Only hosts in this state",
                                                        case_sensitive=False, show_default=False)]
DeviceStateOpt = Annotated[DeviceState | None, typer.Option("--state", help="Only devices in this state",
                                                            case_sensitive=False, show_default=False)]


def _shown(kind: str, shown: int, total: int) -> None:
    if shown < total:
        hint(f"{shown} of {total} {kind} shown (--limit 0 for all)")


@app.command("list")
def list_(island: IslandOpt = "", state: DeviceStateOpt = None, limit: LimitOpt = 0, server: ServerOpt = None,
          output: OutputOpt = Format.table) -> None:
    """List devices: island, host, id, kind, state, last heartbeat."""
    from schemas.pathways.v1 import common_pb2 as pb

    code = pb.DeviceState.Value(f"DEVICE_STATE_{state.value.upper()}") if state else 0
    with client(server) as c:
        found, total = c.devices_page(island, code, limit)
    from schemas.views import DeviceView  # pydantic: once the controller answered

    items = [DeviceView.of(d) for d in found]
    emit_list(output, "DeviceList", items, ["island", "host", "device", "kind", "state", "slices", "heartbeat"],
              lambda d: [d.island, d.host, str(d.id), d.kind, d.state, str(d.slices), age(d.last_heartbeat)],
              ["local", "last heartbeat"], lambda d: [str(d.local_index), d.last_heartbeat],
              name=lambda d: str(d.id))
    _shown("devices", len(items), total)


@hosts_app.command("list")
def hosts_list(island: IslandOpt = "", state: HostStateOpt = None, limit: LimitOpt = 0, server: ServerOpt = None,
               output: OutputOpt = Format.table) -> None:
    """List hosts (workers): island, address, state, devices, last heartbeat."""
    from schemas.pathways.v1 import common_pb2 as pb

    code = pb.HostState.Value(f"HOST_STATE_{state.value.upper()}") if state else 0
    with client(server) as c:
        found, total = c.hosts_page(island, code, limit)
    from schemas.views import HostView  # pydantic: once the controller answered

    items = [HostView.of(h) for h in found]
    emit_list(output, "HostList", items, ["host", "island", "address", "state", "devices", "heartbeat"],
              lambda h: [h.name, h.island, h.address, h.state, f"{h.devices} {h.device_kind}",
                         age(h.last_heartbeat)],
              ["pid", "last heartbeat"], lambda h: [str(h.pid), h.last_heartbeat])
    _shown("hosts", len(items), total)


@hosts_app.command("delete")
def hosts_delete(
    names: Annotated[list[str], typer.Argument(help="Host names")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Delete a live host too: it is marked lost first (its slices move); "
                        "a worker still running registers again")] = False,
    server: ServerOpt = None,
) -> None:
    """Delete lost hosts and their devices (one whose credential is gone, say). Asks first unless -y."""
    delete_each("host", names, yes, lambda c, n: c.delete_host(n, force=force), server)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="device")
    root.add_typer(hosts_app, name="host")
