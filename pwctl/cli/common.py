"""Options, output and error helpers shared by every pwctl command.

Every pwctl command imports this module, and `pwctl --help` imports every command module: so
modules here import only Typer and what command signatures need at the top, and the rest (gRPC,
the protocol stubs, the pydantic views, Rich, `pwctl.local`) inside the commands and helpers
that use it. `pwctl --help` and `pwctl up` then start in a fraction of the time.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import EXIT_FAILED, EXIT_USAGE, InvalidArgument, PathwaysError

if TYPE_CHECKING:
    from pydantic import BaseModel
    from rich.console import Console
    from rich.table import Table

    from ..client import Client

INT32_MAX = 2**31 - 1  # the controller's API carries counts, sizes and limits as int32


def check_int32(flag: str, value: int | None) -> None:
    """A number bound for an int32 field of a request: past that range one line, exit 2 (protobuf
    raised ValueError building the request: "internal error")."""
    if value is not None and not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise InvalidArgument(f"{flag} {value} is out of range: at most {INT32_MAX:,}")


ServerOpt = Annotated[
    str | None,
    typer.Option("--server", "-s", help="Controller address HOST:PORT (default: $PWCTL_SERVER, config, the data "
                 "directory's running controller, 127.0.0.1:7070)", show_default=False),
]

# a server's TLS (pwctl/tls.py; README.md, "TLS"): `pwctl up`, `server start`, `worker start`
TlsCertOpt = Annotated[str | None, typer.Option(
    "--tls-cert", show_default=False, help="This host's certificate (PEM): serve TLS only, present it to peers "
                                           "(default: $PATHWAYS_TLS_CERT; none: plaintext)")]
TlsKeyOpt = Annotated[str | None, typer.Option("--tls-key", show_default=False,
                                               help="Its private key (PEM; default: $PATHWAYS_TLS_KEY)")]
TlsCaOpt = Annotated[str | None, typer.Option(
    "--tls-ca", show_default=False, help="The CA bundle (PEM) that signs the cluster's certificates "
                                         "(default: $PATHWAYS_TLS_CA)")]
TlsServerNameOpt = Annotated[str | None, typer.Option(
    "--tls-server-name", show_default=False,
    help="Name to check in peers' certificates instead of the host dialled (certificates issued to one "
         "cluster-wide name; default: $PATHWAYS_TLS_SERVER_NAME)")]
TlsRequireOpt = Annotated[bool, typer.Option(
    "--tls-require-client-cert", help="Mutual TLS: callers must present a certificate the CA signs "
                                      "(default: $PATHWAYS_TLS_REQUIRE_CLIENT_CERT; the token still applies)")]

# the local clients' own pair under mutual TLS (`pwctl up`, `pwctl server start`; pwctl/local/tlsfiles.py)
TlsClientCertOpt = Annotated[str | None, typer.Option(
    "--tls-client-cert", show_default=False,
    help="With --tls-require-client-cert: a certificate (PEM) the CA signs, with a key of its own, for clients "
         "on this machine; left in the data directory for them (the server's key never is)")]
TlsClientKeyOpt = Annotated[str | None, typer.Option("--tls-client-key", show_default=False,
                                                     help="Its private key (PEM)")]

# the controller's (`pwctl server start`, `pwctl up`)
NoBulkLinksOpt = Annotated[bool, typer.Option("--no-bulk-links",
                                             help="The IFRT proxy's uploads and downloads of 4 MiB or more go "
                                                  "by gRPC, not on the workers' TCP transfer ports (with TLS "
                                                  "they always do)")]


def server_tls(cert: str | None, key: str | None, ca: str | None, server_name: str | None,
               require_client_cert: bool) -> Any:
    """A server's TlsConfig from its flags and $PATHWAYS_TLS_* (None: plaintext); a bad set is one
    line and exit 2 (InvalidArgument), before anything starts."""
    from ..tls import server_config

    return server_config(cert, key, ca, server_name, require_client_cert)


def local_client_tls(tls: Any, cert: str | None, key: str | None) -> Any:
    """The local clients' pair from --tls-client-cert/--tls-client-key (None: not given); a bad
    one is one line and exit 2, before anything starts."""
    from ..local.tlsfiles import client_pair

    return client_pair(tls, cert, key)


def hint_local_clients(tls: Any, client: Any) -> None:
    """Under mutual TLS without a local clients' pair: where clients here get a certificate."""
    if tls is not None and tls.require_client_cert and client is None:
        hint("mutual TLS: clients here need a certificate of their own that the CA signs (PWCTL_TLS_CERT, "
             "PWCTL_TLS_KEY; or start with --tls-client-cert/--tls-client-key to leave one in the data directory)")


class Format(StrEnum):
    table = "table"
    wide = "wide"
    json = "json"
    name = "name"


PIPED_WIDTH = 10_000  # a listing piped somewhere is as wide as its rows, never folded

OutputOpt = Annotated[Format, typer.Option("--output", "-o", help="Output format", case_sensitive=False)]


def stdout() -> Console:
    from rich.console import Console

    return Console(no_color=bool(os.environ.get("NO_COLOR")), soft_wrap=False)


def stderr() -> Console:
    from rich.console import Console

    return Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")) or not sys.stderr.isatty())


def print_table(console: Console, table: Table) -> None:
    """A table on stdout. Piped (no terminal), its lines go without the spaces Rich pads every
    cell with, the last column's included: what a script or a diff reads ends where the text does."""
    if console.is_terminal:
        console.print(table)
        return
    with console.capture() as captured:
        console.print(table)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def hint(message: str) -> None:
    """Hints and progress go to stderr, never mixed with data on stdout."""
    stderr().print(message, highlight=False, soft_wrap=True)


def client(server: str | None, timeout: float = 30.0, check_version: bool = True) -> Client:
    """A client of the controller, whose version is checked first (pwctl/version.py)."""
    from ..client import Client
    from ..version import check_server

    c = Client(server=server, timeout=timeout)
    if check_version:
        try:
            check_server(c)
        except BaseException:
            c.close()
            raise
    return c


def emit_list(
    fmt: Format,
    kind: str,
    items: Sequence[BaseModel],
    columns: Sequence[str],
    row: Callable[[Any], Sequence[str]],
    wide_columns: Sequence[str] = (),
    wide_row: Callable[[Any], Sequence[str]] | None = None,
    name: Callable[[Any], str] | None = None,
) -> None:
    if fmt == Format.json:
        from schemas import views

        doc = views.ListDocument[Any](kind=kind, items=list(items))
        sys.stdout.write(views.dump(doc) + "\n")
        return
    if fmt == Format.name:
        for item in items:
            sys.stdout.write((name(item) if name else str(getattr(item, "name", ""))) + "\n")
        return
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    cols = list(columns) + (list(wide_columns) if fmt == Format.wide else [])
    for c in cols:
        table.add_column(c.upper(), overflow="fold")
    for item in items:
        cells = list(row(item))
        if fmt == Format.wide and wide_row is not None:
            cells += list(wide_row(item))
        table.add_row(*cells)
    console = stdout()
    if not sys.stdout.isatty():
        console.width = PIPED_WIDTH  # piped: every row on one line, whatever its length (as kubectl)
    print_table(console, table)
    if not items:
        hint(f"no {kind.removesuffix('List').lower()}s")


def emit_item(fmt: Format, kind: str, item: BaseModel, render: Callable[[Any], None]) -> None:
    if fmt == Format.json:
        from schemas import views

        sys.stdout.write(views.dump(views.ItemDocument[Any](kind=kind, item=item)) + "\n")
    elif fmt == Format.name:  # what names it: a name, else an id (a job), else an address (the controller)
        sys.stdout.write(str(getattr(item, "name", "") or getattr(item, "id", "") or getattr(item, "address", ""))
                         + "\n")
    else:
        render(item)


def age(iso_ts: str) -> str:
    """'3s', '5m', '2h' since an ISO timestamp ('' when unknown)."""
    from datetime import UTC, datetime

    if not iso_ts:
        return "-"
    try:
        then = datetime.fromisoformat(iso_ts.replace("Z", "+00:00"))
    except ValueError:
        return iso_ts
    s = max(0.0, (datetime.now(UTC) - then).total_seconds())
    if s < 120:
        return f"{s:.0f}s ago"
    if s < 7200:
        return f"{s / 60:.0f}m ago"
    if s < 172800:
        return f"{s / 3600:.0f}h ago"
    return f"{s / 86400:.0f}d ago"


def confirm_or_exit(question: str, refusal: str, declined: str) -> None:
    """Asks `question` on the terminal; without one (stdin not a tty) refuses with `refusal` and exit
    code 2, so a script never destroys anything by default; a "no" says `declined` and exits 1."""
    if not sys.stdin.isatty():
        sys.stderr.write(f"error: {refusal}\n")
        raise typer.Exit(EXIT_USAGE)
    if not typer.confirm(question, default=False):
        hint(declined)
        raise typer.Exit(EXIT_FAILED)


def delete_each(noun: str, names: list[str], yes: bool, delete: Callable[[Client, str], None],
                server: str | None) -> None:
    """Deletes each named `noun` with `delete` after one confirmation (unless `yes`): an error is
    one line and the rest still go; exits with the first error's code."""
    names = list(dict.fromkeys(names))
    if not yes:
        what = f"{noun}{'s' if len(names) > 1 else ''} {', '.join(names)}"
        confirm_or_exit(f"delete {what}?", f"refusing to delete {', '.join(names)} without confirmation: "
                        "stdin is not a terminal; pass -y to delete", "nothing deleted")
    failed: PathwaysError | None = None
    with client(server) as c:
        for n in names:
            try:
                delete(c, n)
            except PathwaysError as e:
                sys.stderr.write(f"error: {e}\n")
                failed = failed or e
                continue
            hint(f"deleted {noun} {n}")
    if failed is not None:
        raise typer.Exit(failed.exit_code)
