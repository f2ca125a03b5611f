"""`python -m server.controller`: the controller process (pwctl server start runs this)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from pwctl.errors import FailedPrecondition
from pwctl.units import parse_duration, parse_size
from pwctl.version import check_jax

from .. import paths, stackdump
from ..tlsflags import add_tls_flags, tls_from_flags
from .app import DEFAULT_METRICS_LISTEN, configure_logging, serve
from .core import ControllerConfig
from .job_files import DEFAULT_LOG_MAX_MB
from .limits import (
    DEFAULT_MAX_DEVICES_PER_HOST,
    DEFAULT_MAX_HOSTS,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_SESSIONS_PER_CALLER,
    DEFAULT_MAX_WATCHES,
    Limits,
)
from .relays import DEFAULT_GROUP_SIZE, DEFAULT_MIN_HOSTS
from .session_store import DEFAULT_GRACE_S
from .slices import DEFAULT_GROUP_WAIT_S
from .trace_store import DEFAULT_RETENTION_BYTES


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m server.controller")
    p.add_argument("--listen", default=paths.DEFAULT_ADDRESS)
    p.add_argument("--db", default=None)
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--dispatch", choices=["parallel", "sequential"], default="parallel")
    p.add_argument("--hang-timeout", type=float, default=60.0)
    p.add_argument("--group-wait", type=float, default=DEFAULT_GROUP_WAIT_S,
                   help="seconds a call on a slice spanning hosts waits for its island's group to form")
    p.add_argument("--policy", choices=["fifo", "priority", "fair"], default="fifo",
                   help="how each island interleaves concurrent programs")
    p.add_argument("--window", type=int, default=256,
                   help="admitted, unfinished nodes per island (default 256); runs beyond it wait and the "
                        "policy picks which goes next: a smaller window makes priority and fair share bite "
                        "sooner, a larger one keeps more work queued on the workers")
    p.add_argument("--pid-file", default=None)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--no-token", action="store_true",
                   help="require no cluster token of callers, for gRPC and metrics scrapes alike (a private "
                        "machine; by default every call needs it, on loopback too)")
    # the old opt-in, now the default: accepted and ignored, so existing scripts keep working
    p.add_argument("--require-token", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--job-log-max-mb", type=int, default=DEFAULT_LOG_MAX_MB,
                   help=f"output kept per job (default {DEFAULT_LOG_MAX_MB} MiB): its log rotates at half of "
                        "that and older output is dropped; `pwctl logs` says when it was")
    p.add_argument("--metrics-listen", default=DEFAULT_METRICS_LISTEN,
                   help="HOST:PORT of the Prometheus metrics endpoint (default %(default)s; port 0 picks a free one; "
                        "'off' disables it); a scrape needs the cluster token as a bearer token (docs/metrics.md)")
    p.add_argument("--trace-retention", default=f"{DEFAULT_RETENTION_BYTES // 2**20}MiB",
                   help="how much of the finished node runs to keep on disk for `pwctl trace` (in DATA_DIR/traces; "
                        "default %(default)s, the oldest go first; 0 keeps only the last 20,000 in memory)")
    p.add_argument("--session-grace", type=float, default=DEFAULT_GRACE_S,
                   help=f"after a restart, how long the sessions of `pw` clients of the previous controller "
                        f"may resume (default {DEFAULT_GRACE_S:g} s): their slices and buffers are kept that long")
    p.add_argument("--max-devices-per-host", type=int, default=DEFAULT_MAX_DEVICES_PER_HOST,
                   help="a worker declaring more devices is refused (default %(default)s)")
    p.add_argument("--max-hosts", type=int, default=DEFAULT_MAX_HOSTS,
                   help="hosts known at once, lost ones included (default %(default)s)")
    p.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS,
                   help="client sessions open at once (default %(default)s)")
    p.add_argument("--max-sessions-per-caller", type=int, default=DEFAULT_MAX_SESSIONS_PER_CALLER,
                   help="client sessions one caller may hold open at once: one machine's address, or one "
                        "job's driver (default %(default)s)")
    p.add_argument("--max-watches", type=int, default=DEFAULT_MAX_WATCHES,
                   help="`status --watch` streams open at once (default %(default)s)")
    p.add_argument("--lost-host-ttl", default="24h",
                   help="a host lost this long is deleted, and its island when it was the last host "
                        "(default %(default)s; s, m, h or d; 0: never)")
    p.add_argument("--relay-min-hosts", type=int, default=DEFAULT_MIN_HOSTS,
                   help="an island of this many ready hosts or more gets its hosts' messages through relays, "
                        "one per group of hosts (server/controller/relays.py; default %(default)s; 0: never)")
    p.add_argument("--relay-group", type=int, default=DEFAULT_GROUP_SIZE,
                   help="hosts per relay group (default %(default)s)")
    p.add_argument("--no-bulk-links", action="store_true",
                   help="the IFRT proxy's uploads and downloads of 4 MiB or more between the controller and the "
                        "workers go by gRPC, not on the workers' TCP transfer ports (where a firewall lets only "
                        "the workers' gRPC ports through; with TLS they always go by gRPC; "
                        "pathways_proxy_bulk_transfers_total counts which path each took)")
    add_tls_flags(p)
    ns = p.parse_args()
    tls = tls_from_flags(p, ns)
    if ns.relay_min_hosts < 0 or ns.relay_group < 1:
        p.error("--relay-min-hosts must not be negative and --relay-group must be at least 1")
    if ns.no_token and ns.require_token:
        p.error("--no-token and --require-token contradict each other (the token is required by default)")
    if ns.session_grace < 0:
        p.error("--session-grace must not be negative")
    try:
        lost_host_ttl = parse_duration(ns.lost_host_ttl)
    except ValueError as e:
        p.error(f"--lost-host-ttl: {e}")
    for flag in ("max_devices_per_host", "max_hosts", "max_sessions", "max_sessions_per_caller", "max_watches"):
        if getattr(ns, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    try:
        trace_retention = parse_size(ns.trace_retention)
    except ValueError as e:
        p.error(f"--trace-retention: {e}")
    if ns.group_wait <= 0:
        p.error("--group-wait must be positive")
    if ns.window < 1:
        p.error("--window must be at least 1")
    if ns.job_log_max_mb < 1:
        p.error("--job-log-max-mb must be at least 1")
    if ns.metrics_listen.strip() not in ("", "off"):
        try:
            paths.split_address(ns.metrics_listen.strip())
        except ValueError as e:
            p.error(f"--metrics-listen: {e} (or 'off')")
    try:
        jax_warnings = check_jax("the controller")
    except FailedPrecondition as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    configure_logging(ns.log_level)
    stackdump.install()
    for warning in jax_warnings:
        logging.getLogger("server.controller").warning("%s", warning)
    config = ControllerConfig(
        listen=ns.listen,
        db_url=ns.db or paths.default_db_url(),
        heartbeat_interval=ns.heartbeat_interval,
        heartbeat_timeout=ns.heartbeat_timeout,
        dispatch=ns.dispatch,
        hang_timeout=ns.hang_timeout,
        policy=ns.policy,
        window=ns.window,
        no_token=ns.no_token,
        job_log_max_mb=ns.job_log_max_mb,
        metrics_listen=ns.metrics_listen,
        trace_retention=trace_retention,
        session_grace=ns.session_grace,
        limits=Limits(max_devices_per_host=ns.max_devices_per_host, max_hosts=ns.max_hosts,
                      max_sessions=ns.max_sessions, max_sessions_per_caller=ns.max_sessions_per_caller,
                      max_watches=ns.max_watches),
        lost_host_ttl=lost_host_ttl,
        relay_min_hosts=ns.relay_min_hosts,
        relay_group=ns.relay_group,
        group_wait=ns.group_wait,
        tls=tls,
        health_listen=ns.health_listen,
        bulk_links=not ns.no_bulk_links,
    )
    asyncio.run(serve(config, Path(ns.pid_file) if ns.pid_file else None))


if __name__ == "__main__":
    main()
