"""`pwctl island ...`"""

from __future__ import annotations

from typing import Annotated

import typer

from .common import Format, OutputOpt, ServerOpt, client, delete_each, emit_list

app = typer.Typer(help="Islands: devices joined by a fast interconnect.", no_args_is_help=True)


@app.command("list")
def list_(server: ServerOpt = None, output: OutputOpt = Format.table) -> None:
    """List islands with their hosts and devices."""
    with client(server) as c:
        found = c.islands()
    from schemas.views import IslandView  # pydantic: once the controller answered

    items = [IslandView.of(i) for i in found]
    emit_list(output, "IslandList", items, ["island", "hosts", "devices", "available"],
              lambda i: [i.name, str(i.hosts), str(i.devices), str(i.available_devices)],
              ["group", "created"], lambda i: [i.group or "-", i.created_at])


@app.command("delete")
def delete(
    names: Annotated[list[str], typer.Argument(help="Island names")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
    server: ServerOpt = None,
) -> None:
    """Delete empty islands (no hosts, no slice asking for them). Asks first unless -y."""
    delete_each("island", names, yes, lambda c, n: c.delete_island(n), server)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="island")
