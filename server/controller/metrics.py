"""Prometheus metrics: what the controller serves on `--metrics-listen` (docs/metrics.md).

Everything is read at scrape time by one collector from what the components already keep (the
hosts, the observer's counters, the scheduler's queues and `stats`, the jobs): nothing is added
to the dispatch path. The endpoint is a small asyncio HTTP server on the controller's event loop,
so a scrape reads the components on the thread that changes them (no locks, no torn reads);
`prometheus-client` formats the exposition. A scrape must carry the cluster token as
`Authorization: Bearer <token>` (on loopback too; not with the controller's `--no-token`), as
Prometheus' `authorization: {credentials_file: ...}` sends it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from schemas.pathways.v1 import controller_pb2 as cpb

from .. import __version__
from ..proxy.transfer_counts import TransferCounts
from ..scheduler import GangScheduler
from ..scheduler.stats import Histogram
from .cluster import LOST, READY, RECONNECTING, Cluster
from .hangs import HangReporter
from .observe import Observer

if TYPE_CHECKING:
    import ssl

    from .job_record import JobRecord
    from .relays import Relays

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:9464"  # 9464: the port OpenTelemetry's Prometheus exporter uses
REQUEST_TIMEOUT_S = 5.0  # a scrape's request must arrive within this long
MAX_REQUEST_BYTES = 16 * 1024  # request line and headers
JOB_STATES = {cpb.JOB_STATE_PENDING: "pending", cpb.JOB_STATE_RUNNING: "running",
              cpb.JOB_STATE_SUCCEEDED: "succeeded", cpb.JOB_STATE_FAILED: "failed",
              cpb.JOB_STATE_CANCELLED: "cancelled"}
DEVICE_STATES = {READY: "available", RECONNECTING: "reconnecting", LOST: "lost"}


class ControllerCollector(Collector):
    """Every `pathways_*` metric, collected at scrape time from the controller's components: the
    hosts, the observer, the scheduler, the jobs (by id), the hang reporter and the slice count."""

    def __init__(self, cluster: Cluster, observer: Observer, scheduler: GangScheduler,
                 jobs: Mapping[str, JobRecord], hangs: HangReporter, slice_count: Callable[[], int], *,
                 dispatch: str, policy: str, relays: Relays | None = None,
                 transfers: TransferCounts | None = None) -> None:
        self.cluster = cluster
        self.observer = observer
        self.scheduler = scheduler
        self.jobs = jobs
        self.hangs = hangs
        self.slice_count = slice_count
        self.relays = relays
        self.transfers = transfers
        self.dispatch = dispatch
        self.policy = policy
        self.started = time.monotonic()

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("pathways_info", "The controller: version, dispatch mode, default policy",
                                 labels=["version", "dispatch", "policy"])
        info.add_metric([__version__, self.dispatch, self.policy], 1)
        yield info
        yield GaugeMetricFamily("pathways_uptime_seconds", "Seconds since the controller started",
                                value=time.monotonic() - self.started)
        yield from self._hosts()
        yield from self._queues()
        yield from self._runs()
        jobs = GaugeMetricFamily("pathways_jobs", "Jobs the controller remembers, by state", labels=["state"])
        counts = dict.fromkeys(JOB_STATES.values(), 0)
        for rec in self.jobs.values():
            name = JOB_STATES.get(rec.state)
            if name is not None:
                counts[name] += 1
        for state, n in counts.items():
            jobs.add_metric([state], n)
        yield jobs
        yield GaugeMetricFamily("pathways_slices", "Virtual slices", value=self.slice_count())

    def _hosts(self) -> Iterator[Metric]:
        stalled = self.hangs.stalled_hosts()
        hosts = GaugeMetricFamily("pathways_hosts", "Hosts (workers) by island and state "
                                  "(ready, stalled, reconnecting, lost)", labels=["island", "state"])
        devices = GaugeMetricFamily("pathways_devices", "Devices by island and state "
                                    "(available, reconnecting, lost)", labels=["island", "state"])
        util = GaugeMetricFamily("pathways_island_utilization", "Mean busy fraction of an island's "
                                 "available devices over the last ~5 s (0..1)", labels=["island"])
        host_counts: dict[tuple[str, str], int] = {}
        device_counts: dict[tuple[str, str], int] = {}
        busy: dict[str, list[float]] = {island: [] for island in self.cluster.islands}
        now_ns = time.time_ns()
        for h in self.cluster.hosts.values():
            state = "stalled" if h.name in stalled else h.state
            host_counts[(h.island, state)] = host_counts.get((h.island, state), 0) + 1
            dstate = DEVICE_STATES.get(h.state, "lost")
            device_counts[(h.island, dstate)] = device_counts.get((h.island, dstate), 0) + len(h.device_ids)
            if h.state == READY:
                busy.setdefault(h.island, []).extend(
                    self.observer.utilization(h.name, i, now_ns) for i in range(len(h.device_ids)))
        for island in self.cluster.islands:
            for state in (READY, "stalled", RECONNECTING, LOST):
                hosts.add_metric([island, state], host_counts.get((island, state), 0))
            for state in DEVICE_STATES.values():
                devices.add_metric([island, state], device_counts.get((island, state), 0))
        for island, values in sorted(busy.items()):
            util.add_metric([island], sum(values) / len(values) if values else 0.0)
        yield hosts
        yield devices
        yield util
        yield from self._held()

    def _held(self) -> Iterator[Metric]:
        """What the ready workers of each island hold, summed, as of their last heartbeats."""
        families = [
            ("pathways_worker_buffers", "Buffers the ready workers of an island hold (ready or pending), "
             "as of their last heartbeats"),
            ("pathways_worker_buffer_bytes", "Bytes of the buffers the ready workers of an island hold, as "
             "of their last heartbeats"),
            ("pathways_worker_gathering", "Arrays of multi-host slices the ready workers of an island are "
             "gathering from their members' parts, not whole yet, as of their last heartbeats"),
            ("pathways_worker_gathering_bytes", "Bytes those unfinished gatherings hold, as of the workers' "
             "last heartbeats"),
        ]
        sums = {island: [0, 0, 0, 0] for island in self.cluster.islands}
        for h in self.cluster.hosts.values():
            hb = h.held
            if h.state == READY and hb is not None:
                s = sums.setdefault(h.island, [0, 0, 0, 0])
                s[0] += hb.buffers
                s[1] += hb.buffer_bytes
                s[2] += hb.gathering
                s[3] += hb.gathering_bytes
        for i, (name, doc) in enumerate(families):
            family = GaugeMetricFamily(name, doc, labels=["island"])
            for island, s in sorted(sums.items()):
                family.add_metric([island], s[i])
            yield family

    def _queues(self) -> Iterator[Metric]:
        snap = self.scheduler.snapshot()
        runs = GaugeMetricFamily("pathways_queue_runs", "Runs in an island's queue: running (admitted) "
                                 "and waiting", labels=["island", "state"])
        nodes = GaugeMetricFamily("pathways_queue_inflight_nodes", "Admitted, unfinished nodes on an island "
                                  "(at most the window)", labels=["island"])
        oldest = GaugeMetricFamily("pathways_queue_oldest_wait_seconds", "How long the island's longest "
                                   "waiting run has waited (0 when none waits)", labels=["island"])
        now = time.monotonic()
        for v in snap.islands:
            runs.add_metric([v.island, "running"], len(v.running))
            runs.add_metric([v.island, "waiting"], len(v.waiting))
            nodes.add_metric([v.island], v.inflight_nodes)
            oldest.add_metric([v.island], max((now - r.submitted_at for r in v.waiting), default=0.0))
        yield runs
        yield nodes
        yield oldest
        yield GaugeMetricFamily("pathways_stalled_gangs", "Admitted runs held back now by a host that has "
                                "not started (or not finished) their node", value=len(self.hangs.stalls()))

    def _runs(self) -> Iterator[Metric]:
        stats = self.scheduler.stats
        runs = CounterMetricFamily("pathways_runs", "Program runs finished, by outcome", labels=["outcome"])
        runs.add_metric(["ok"], stats.runs_ok)
        runs.add_metric(["failed"], stats.runs_failed)
        yield runs
        yield CounterMetricFamily("pathways_computations", "Computations (program nodes) finished on the "
                                  "workers", value=self.observer.computations_total)
        yield CounterMetricFamily("pathways_hangs_detected", "Runs failed by hang detection",
                                  value=stats.hangs_detected)
        if self.relays is not None:
            yield CounterMetricFamily("pathways_relayed_messages", "Controller messages sent to their hosts "
                                      "through a relay", value=self.relays.relayed)
            yield CounterMetricFamily("pathways_relay_rejected", "Relayed messages their hosts dropped: the "
                                      "signature did not match (forged or altered on the way)",
                                      value=self.relays.rejected)
        if self.transfers is not None:
            yield from _transfers(self.transfers)
        yield _histogram("pathways_run_latency_seconds", "A run's time from its arrival (submit) at the "
                         "controller to its end", stats.run_latency)
        yield _histogram("pathways_admission_wait_seconds", "A run's time from its arrival to its admission "
                         "(its gang's seqs given)", stats.admission_wait)


def _transfers(counts: TransferCounts) -> Iterator[Metric]:
    transfers = CounterMetricFamily("pathways_proxy_bulk_transfers", "IFRT proxy uploads and downloads of 4 MiB or "
                                    "more between the controller and a worker, by direction and path (tcp: the "
                                    "worker's transfer port; grpc: the fallback, and the only path with TLS or "
                                    "--no-bulk-links)", labels=["direction", "path"])
    moved = CounterMetricFamily("pathways_proxy_bulk_bytes", "The bytes of those transfers, by direction and path",
                                labels=["direction", "path"])
    for key, n in counts.transfers.items():
        transfers.add_metric(list(key), n)
        moved.add_metric(list(key), counts.bytes[key])
    yield transfers
    yield moved


def _histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=[(le, float(n)) for le, n in h.cumulative()],
                                 sum_value=h.total)


class MetricsServer:
    """`GET /metrics` (or `/`) over HTTP/1.0-style single requests; `token` set: Bearer required."""

    def __init__(self, collector: Collector, token: str | None, ssl_context: ssl.SSLContext | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.token = token
        # HTTPS with the controller's certificate where it serves TLS (a failed handshake is
        # logged at debug level only, by asyncio, and bounded like a request's read)
        self.ssl_context = ssl_context
        self._server: asyncio.Server | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context is not None else "http"

    async def start(self, host: str, port: int) -> int:
        """Listens; returns the bound port. Raises OSError when the address is not available."""
        self._server = await asyncio.start_server(
            self._serve, host, port, limit=MAX_REQUEST_BYTES, ssl=self.ssl_context,
            ssl_handshake_timeout=REQUEST_TIMEOUT_S if self.ssl_context is not None else None)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            status, headers, body = self._respond(head.decode("latin-1"))
            lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close", *headers]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _respond(self, head: str) -> tuple[str, list[str], bytes]:
        request, *header_lines = head.split("\r\n")
        parts = request.split(" ")
        if len(parts) != 3:
            return "400 Bad Request", [], b"malformed request line\n"
        method, target, _ = parts
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
        if self.token is not None:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                peer = "missing" if not given else "wrong"
                log.warning("metrics scrape refused: %s bearer token", peer)
                return ("401 Unauthorized", ['WWW-Authenticate: Bearer realm="pathways"'],
                        b"the cluster token is required: Authorization: Bearer <token>\n")
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", ["Allow: GET, HEAD"], b"use GET\n"
        if target.split("?", 1)[0] not in ("/metrics", "/"):
            return "404 Not Found", [], b"metrics are at /metrics\n"
        body = generate_latest(self.registry)
        return "200 OK", [f"Content-Type: {CONTENT_TYPE_LATEST}"], b"" if method == "HEAD" else body
