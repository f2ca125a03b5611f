"""`pwctl slice ...`: virtual slices of devices (create, list, describe, delete)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import InvalidArgument
from .common import (
    Format,
    OutputOpt,
    ServerOpt,
    age,
    check_int32,
    client,
    delete_each,
    emit_item,
    emit_list,
    hint,
    print_table,
    stdout,
)

if TYPE_CHECKING:
    from schemas.views import SliceView

app = typer.Typer(
    help="Virtual slices: N devices (optionally a mesh, an island, a kind) mapped onto physical devices.",
    no_args_is_help=True,
)


def parse_mesh(text: str) -> list[int]:
    """'2x2' -> [2, 2]; raises InvalidArgument (exit 2) with a one-line message."""
    parts = text.lower().split("x")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise InvalidArgument(f"invalid --mesh {text!r}: expected positive sizes joined by 'x', like 2x2")
    return [int(p) for p in parts]


def _ids(ids: list[int]) -> str:
    return "[" + ", ".join(str(i) for i in ids) + "]"


def _mesh(v: SliceView) -> str:
    return "x".join(str(d) for d in v.spec.mesh) if v.spec.mesh else str(v.spec.devices)


def _request(v: SliceView) -> str:
    parts = [f"{v.spec.devices} devices", f"mesh {_mesh(v)}", f"island {v.spec.island or 'any'}",
             f"kind {v.spec.kind or 'any'}", "exclusive" if v.spec.exclusive else "shared"]
    return ", ".join(parts)


def render(v: SliceView) -> None:
    """Human view of one slice: request, state, virtual -> physical mapping, remap history."""
    from rich.table import Table

    out = stdout()
    rows = [("name", v.name), ("state", v.state + (f" ({v.reason})" if v.reason else "")),
            ("request", _request(v)), ("owner", v.owner or "-")]
    if v.state != "preview":
        rows += [("created", v.created_at or "-"), ("generation", str(v.generation))]
    for key, value in rows:
        out.print(f"{key + ':':<12}{value}", highlight=False, markup=False)
    table = Table(box=None, header_style="bold", pad_edge=False)
    for c in ("virtual", "device", "island", "host", "local", "kind", "address"):
        table.add_column(c.upper())
    for d in v.devices:
        table.add_row(str(d.index), str(d.device_id), d.island, d.host or "-",
                      str(d.local_index) if d.local_index >= 0 else "-", d.kind or "-", d.address or "-")
    out.print("devices:", highlight=False)
    print_table(out, table)
    if v.history:
        out.print("history:", highlight=False)
        for r in v.history:
            out.print(f"  {r.at or '-'}  {r.reason}", highlight=False, markup=False)
            change = f"    old {_ids(r.old_devices)} -> new {_ids(r.new_devices)}"
            out.print(change, highlight=False, markup=False)


NameArg = Annotated[str, typer.Argument(help="Slice name (default: the server picks slice-N)")]
DevicesOpt = Annotated[
    int | None,
    typer.Option("--devices", "-n", help="Number of devices (default: the mesh size)", show_default=False),
]
MeshOpt = Annotated[str, typer.Option("--mesh", "-m", help="Mesh shape, e.g. 2x2 (size = --devices)")]
IslandOpt = Annotated[str, typer.Option("--island", "-i", help="Place on this island only")]
KindOpt = Annotated[str, typer.Option("--kind", "-k", help="Device kind: cpu or gpu")]
ExclusiveOpt = Annotated[bool, typer.Option("--exclusive", help="Use devices no other slice uses")]
HostAxisOpt = Annotated[int | None, typer.Option(
    "--host-axis", help="Mesh axis that runs across hosts (the others stay inside a host): --mesh 2x4 --host-axis 0")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Show the placement and why; reserve nothing")]
OwnerOpt = Annotated[str, typer.Option("--owner", help="Only slices of this owner (client:<id>, job:<id>)")]


@app.command("create")
def create(
    name: NameArg = "",
    devices: DevicesOpt = None,
    mesh: MeshOpt = "",
    island: IslandOpt = "",
    kind: KindOpt = "",
    exclusive: ExclusiveOpt = False,
    host_axis: HostAxisOpt = None,
    dry_run: DryRunOpt = False,
    server: ServerOpt = None,
    output: OutputOpt = Format.table,
) -> None:
    """Allocate a slice, all or nothing, and print its virtual -> physical device mapping."""
    from schemas.pathways.v1 import controller_pb2 as cpb

    shape = parse_mesh(mesh) if mesh else []
    if devices is None:
        if not shape:
            raise InvalidArgument("give --devices N (or --mesh, whose size is the device count)")
        devices = math.prod(shape)
        check_int32(f"--mesh {mesh}: its size", devices)
    for flag, value in (("--devices", devices), *(("--mesh", d) for d in shape), ("--host-axis", host_axis)):
        check_int32(flag, value)
    spec = cpb.SliceSpec(name=name, devices=devices, mesh=shape, island=island, kind=kind,
                         exclusive=exclusive, host_axis=host_axis)
    with client(server) as c:
        resp = c.create_slice(spec, dry_run=dry_run)
    from schemas.views import SliceView  # pydantic: once the controller answered

    view = SliceView.of(resp.slice)
    emit_item(output, "Slice", view, render)
    if resp.explanation:
        hint(f"placement: {resp.explanation}")
    if dry_run:
        hint(f"dry run: nothing was reserved; run again without --dry-run to create {view.name}")


@app.command("list")
def list_(
    owner: OwnerOpt = "",
    server: ServerOpt = None,
    output: OutputOpt = Format.table,
) -> None:
    """List slices: state, size, mesh, island, owner, age."""
    with client(server) as c:
        found = c.slices(owner)
    from schemas.views import SliceView  # pydantic: once the controller answered

    items = [SliceView.of(s) for s in found]
    emit_list(output, "SliceList", items, ["name", "state", "devices", "mesh", "island", "owner", "age"],
              lambda v: [v.name, v.state, f"{v.spec.devices}{' excl' if v.spec.exclusive else ''}", _mesh(v),
                         ",".join(sorted({d.island for d in v.devices})) or "-", v.owner or "-",
                         age(v.created_at)],
              ["mapping", "generation", "reason"],
              lambda v: [_ids([d.device_id for d in v.devices]), str(v.generation), v.reason or "-"])


@app.command("describe")
def describe(
    name: Annotated[str, typer.Argument(help="Slice name (a unique prefix is enough)")],
    server: ServerOpt = None,
    output: OutputOpt = Format.table,
) -> None:
    """Show a slice: request, state, mapping, and every remap with its old and new devices."""
    with client(server) as c:
        found = c.get_slice(name)
    from schemas.views import SliceView  # pydantic: once the controller answered

    view = SliceView.of(found)
    emit_item(output, "Slice", view, render)


@app.command("delete")
def delete(
    names: Annotated[list[str], typer.Argument(help="Slice names (unique prefixes are enough)")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
    force: Annotated[bool, typer.Option("--force", help="Delete even if programs use the slice")] = False,
    server: ServerOpt = None,
) -> None:
    """Delete slices, freeing their devices. Asks first unless -y."""
    with client(server) as c:
        # Resolve every name first so a typo deletes nothing and the prompt shows full names.
        full = [c.get_slice(n).name for n in names]
    delete_each("slice", full, yes, lambda c, n: c.delete_slice(n, force=force), server)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="slice")
