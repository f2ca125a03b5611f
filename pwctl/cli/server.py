"""`pwctl server start|stop|info`"""

from __future__ import annotations

import sys
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

from .. import __version__, paths, units
from ..errors import InvalidArgument
from ..version import compatible, mismatch
from .common import (
    Format,
    NoBulkLinksOpt,
    OutputOpt,
    ServerOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsClientCertOpt,
    TlsClientKeyOpt,
    TlsKeyOpt,
    TlsRequireOpt,
    TlsServerNameOpt,
    client,
    emit_item,
    hint,
    hint_local_clients,
    local_client_tls,
    print_table,
    server_tls,
    stdout,
)

if TYPE_CHECKING:
    from schemas.views import ServerInfoView

app = typer.Typer(help="The controller: start, stop, inspect.", no_args_is_help=True)


class Dispatch(StrEnum):
    parallel = "parallel"
    sequential = "sequential"


class Policy(StrEnum):
    fifo = "fifo"
    priority = "priority"
    fair = "fair"


ListenOpt = Annotated[str, typer.Option("--listen", help="Address to serve on, HOST:PORT")]
DbOpt = Annotated[str | None, typer.Option("--db", show_default=False,
                                           help="Database URL (default: SQLite in the data directory)")]
ForegroundOpt = Annotated[bool, typer.Option("--foreground", help="Run in this terminal, log to stderr")]
DispatchOpt = Annotated[Dispatch, typer.Option("--dispatch", help="How programs are dispatched")]
HeartbeatOpt = Annotated[float, typer.Option("--heartbeat-timeout",
                                             help="Seconds without heartbeats before a host is lost")]
PolicyOpt = Annotated[Policy, typer.Option("--policy", help="How each island interleaves concurrent programs")]
HangOpt = Annotated[float, typer.Option("--hang-timeout",
                                        help="Seconds a gang node may hold its island before its program fails")]
WindowOpt = Annotated[int, typer.Option("--window",
                                        help="Admitted unfinished nodes per island; beyond it runs wait and the "
                                             "policy picks the next (smaller: priority and fair share bite sooner)")]
NoTokenOpt = Annotated[bool, typer.Option("--no-token",
                                          help="Require no cluster token of callers, on any address (a private "
                                               "machine); by default every call and scrape needs it")]
# the old opt-in, now the default: accepted and ignored so existing scripts keep working
RequireTokenOpt = Annotated[bool, typer.Option("--require-token", hidden=True)]
MetricsOpt = Annotated[str, typer.Option("--metrics-listen",
                                         help="Prometheus metrics endpoint HOST:PORT (port 0: a free one; 'off'); "
                                              "a scrape needs the token (docs/metrics.md)")]
RetentionOpt = Annotated[str, typer.Option("--trace-retention",
                                           help="Node runs kept on disk for `pwctl trace` (e.g. 512MiB, 2GiB; "
                                                "0: only the last 20,000 in memory)")]
LostHostTtlOpt = Annotated[str, typer.Option("--lost-host-ttl",
                                             help="A host lost this long is deleted, and its island when it was "
                                                  "the last host (s, m, h or d; 0: never)")]
RelayMinOpt = Annotated[int, typer.Option("--relay-min-hosts",
                                          help="Islands of this many hosts or more get their hosts' messages "
                                               "through relays, one per group of hosts (0: never)")]
RelayGroupOpt = Annotated[int, typer.Option("--relay-group", help="Hosts per relay group")]
GroupWaitOpt = Annotated[float, typer.Option("--group-wait",
                                             help="Seconds a call on a slice spanning hosts waits for its island's "
                                                  "group to form (at start, after a host joined or was lost) "
                                                  "before it fails naming why")]

GraceOpt = Annotated[float, typer.Option("--session-grace", min=0,
                                         help="After a restart, seconds the `pw` sessions of the previous "
                                              "controller may resume: their slices and buffers are kept that long")]
JobLogOpt = Annotated[int, typer.Option("--job-log-max-mb", min=1,
                                        help="Output kept per job (MiB): its log rotates at half of that, older "
                                             "output is dropped")]
MaxSessionsOpt = Annotated[int, typer.Option("--max-sessions", min=1, help="Client sessions open at once")]
MaxPerCallerOpt = Annotated[int, typer.Option("--max-sessions-per-caller", min=1,
                                              help="Client sessions one caller (a machine's address, or a job's "
                                                   "driver) may hold open at once")]


@app.command("start")
def start(
    listen: ListenOpt = paths.DEFAULT_ADDRESS,
    db: DbOpt = None,
    foreground: ForegroundOpt = False,
    dispatch: DispatchOpt = Dispatch.parallel,
    heartbeat_timeout: HeartbeatOpt = 5.0,
    policy: PolicyOpt = Policy.fifo,
    hang_timeout: HangOpt = 60.0,
    window: WindowOpt = 256,
    no_token: NoTokenOpt = False,
    require_token: RequireTokenOpt = False,
    metrics_listen: MetricsOpt = "127.0.0.1:9464",
    trace_retention: RetentionOpt = "512MiB",
    lost_host_ttl: LostHostTtlOpt = "24h",
    relay_min_hosts: RelayMinOpt = 32,
    relay_group: RelayGroupOpt = 64,
    group_wait: GroupWaitOpt = 60.0,
    session_grace: GraceOpt = 60.0,
    job_log_max_mb: JobLogOpt = 16,
    max_sessions: MaxSessionsOpt = 1024,
    max_sessions_per_caller: MaxPerCallerOpt = 256,
    no_bulk_links: NoBulkLinksOpt = False,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_server_name: TlsServerNameOpt = None,
    tls_require_client_cert: TlsRequireOpt = False,
    tls_client_cert: TlsClientCertOpt = None,
    tls_client_key: TlsClientKeyOpt = None,
) -> None:
    """Start the controller (detached: pid file and log under the data directory)."""
    from .. import local

    tls = server_tls(tls_cert, tls_key, tls_ca, tls_server_name, tls_require_client_cert)
    local_clients = local_client_tls(tls, tls_client_cert, tls_client_key)
    if heartbeat_timeout <= 0:
        raise typer.BadParameter("must be positive", param_hint="--heartbeat-timeout")
    if hang_timeout <= 0:
        raise typer.BadParameter("must be positive", param_hint="--hang-timeout")
    if group_wait <= 0:
        raise typer.BadParameter("must be positive", param_hint="--group-wait")
    if window < 1:
        raise typer.BadParameter("must be at least 1", param_hint="--window")
    if relay_min_hosts < 0:
        raise typer.BadParameter("must not be negative", param_hint="--relay-min-hosts")
    if relay_group < 1:
        raise typer.BadParameter("must be at least 1", param_hint="--relay-group")
    if no_token and require_token:
        raise typer.BadParameter("contradicts --no-token (the token is required by default)",
                                 param_hint="--require-token")
    for flag, value, parse in (("--trace-retention", trace_retention, units.parse_size),
                               ("--lost-host-ttl", lost_host_ttl, units.parse_duration)):
        try:
            parse(value)
        except ValueError as e:
            raise InvalidArgument(f"{flag}: {e}") from None  # one line, exit 2, nothing started
    if metrics_listen.strip() != "off":
        try:
            paths.split_address(metrics_listen.strip())
        except ValueError as e:
            raise typer.BadParameter(f"{e} (or 'off')", param_hint="--metrics-listen") from None
    extra = ["--policy", policy.value, "--hang-timeout", f"{hang_timeout:g}", "--window", str(window),
             "--metrics-listen", metrics_listen, "--trace-retention", trace_retention, "--lost-host-ttl", lost_host_ttl,
             "--relay-min-hosts", str(relay_min_hosts), "--relay-group", str(relay_group),
             "--group-wait", f"{group_wait:g}", "--session-grace", f"{session_grace:g}",
             "--job-log-max-mb", str(job_log_max_mb), "--max-sessions", str(max_sessions),
             "--max-sessions-per-caller", str(max_sessions_per_caller)]
    if no_token:
        extra.append("--no-token")
    if no_bulk_links:
        extra.append("--no-bulk-links")
    handle = local.start_controller(listen, db, foreground=foreground, dispatch=dispatch.value,
                                    heartbeat_timeout=heartbeat_timeout, extra_args=extra, tls=tls,
                                    client_tls=local_clients)
    if handle.already_running:
        sys.stderr.write(f"already running (pid {handle.pid} at {handle.address})\n")
        return
    sys.stdout.write(f"controller started (pid {handle.pid}) at {handle.address}\n")
    hint(f"log: {handle.log_path}; stop with `pwctl server stop`")
    if not no_token:
        hint(f"calls need the token in {paths.token_path()} (clients elsewhere: set PWCTL_TOKEN)")
    if tls is not None:
        hint(f"TLS only: clients elsewhere need the CA bundle {tls.ca} (PWCTL_TLS_CA)"
             + (" and a certificate it signs (PWCTL_TLS_CERT, PWCTL_TLS_KEY)" if tls.require_client_cert else ""))
        hint_local_clients(tls, local_clients)


@app.command("stop")
def stop() -> None:
    """Stop the controller started from this data directory."""
    from .. import local

    pid = local.stop_controller()
    if pid is None:
        hint("no controller running")
        return
    sys.stdout.write(f"controller stopped (pid {pid})\n")


@app.command("info")
def info(server: ServerOpt = None, output: OutputOpt = Format.table) -> None:
    """Version, address, database, uptime, and what the controller holds."""
    with client(server, timeout=10.0, check_version=False) as c:  # it shows the version: no check
        found = c.info()
    from schemas.views import ServerInfoView  # pydantic: once the controller answered

    view = ServerInfoView.of(found)
    emit_item(output, "ServerInfo", view, _render)
    if not compatible(__version__, view.version):
        hint(f"warning: {mismatch(view.version, view.address)}")


def _render(v: ServerInfoView) -> None:
    from rich.table import Table

    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in [
        ("version", v.version), ("address", v.address), ("database", v.database), ("pid", str(v.pid)),
        ("started", v.started_at), ("uptime", _duration(v.uptime_s)), ("dispatch", v.dispatch),
        ("policy", v.policy), ("islands", str(v.islands)), ("hosts", str(v.hosts)), ("devices", str(v.devices)),
        ("slices", str(v.slices)), ("jobs", f"{v.jobs_total} ({v.jobs} pending or running)"),
        ("metrics", v.metrics_url or "off"),
    ]:
        table.add_row(key, value)
    print_table(stdout(), table)


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s"
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="server")
