"""The controller's composition root: builds the components, hands each its collaborators,
and wires their events. Only this module (and the servicer, which translates requests) knows
the whole; the components know what they are given."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from pwctl.tls import TlsConfig
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from .. import paths
from ..credentials import JOB_KEY_FILE, KEY_FILE, job_secret, load_or_create_key
from ..db.engine import make_engine, session_factory
from ..db.writer import DbWriter
from ..proxy.transfer_counts import TransferCounts
from ..scheduler import GangScheduler, Policy
from ..timeutil import now_iso
from .cluster import Cluster
from .dispatch import Dispatcher
from .errors import NotFound
from .groups import IslandGroups, coordinator_host
from .hangs import HangReporter
from .job_files import DEFAULT_LOG_MAX_MB
from .jobs import JobManager
from .limits import Limits
from .observe import Observer
from .programs import ProgramRegistry
from .relays import DEFAULT_GROUP_SIZE, DEFAULT_MIN_HOSTS, Relays
from .removal import DEFAULT_LOST_HOST_TTL_S, Removal, slice_queries
from .session_store import DEFAULT_GRACE_S, SessionStore
from .sessions import SessionManager
from .slices import DEFAULT_GROUP_WAIT_S, SliceService
from .trace_store import DEFAULT_RETENTION_BYTES, TraceStore

log = logging.getLogger(__name__)

WRITER_DRAIN_S = 30.0  # how long a stopping controller waits for its queued database writes
ORPHAN_SERVICES_AFTER_S = 30.0  # after a start, an earlier controller's island services go


@dataclass
class ControllerConfig:
    listen: str
    db_url: str
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    dispatch: str = "parallel"  # or "sequential"
    hang_timeout: float = 60.0
    policy: str = "fifo"  # default time-multiplexing policy of every island: fifo | priority | fair
    window: int = 256  # admitted unfinished nodes per island; the policy orders only what waits beyond it
    token: str | None = None
    no_token: bool = False  # True (--no-token, a private machine): no call needs the cluster token
    job_log_max_mb: int = DEFAULT_LOG_MAX_MB  # output kept per job (rotated; older output dropped)
    metrics_listen: str = ""  # HOST:PORT of the Prometheus endpoint; "" or "off": none
    trace_retention: int = DEFAULT_RETENTION_BYTES  # bytes of node runs kept for traces on disk; 0: none
    session_grace: float = DEFAULT_GRACE_S  # how long sessions of the previous controller may resume
    limits: Limits = field(default_factory=Limits)  # bounds on requests (limits.py)
    lost_host_ttl: float = DEFAULT_LOST_HOST_TTL_S  # a host lost this long is deleted (0: never)
    relay_min_hosts: int = DEFAULT_MIN_HOSTS  # islands this large send through relays (relays.py); 0: never
    relay_group: int = DEFAULT_GROUP_SIZE  # hosts per relay
    group_wait: float = DEFAULT_GROUP_WAIT_S  # the longest a call on a slice spanning hosts waits for its group
    health_listen: str = ""  # HOST:PORT answering the health service alone, plaintext (health.py); "": none
    tls: TlsConfig | None = None  # serve TLS only, and reach workers over TLS (pwctl/tls.py); None: plaintext
    bulk_links: bool = True  # the proxy's bulk bytes on workers' TCP ports where no TLS; off (--no-bulk-links): gRPC


class Controller:
    """Holds the state of one controller process; every method runs on its event loop."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.address = config.listen
        self.metrics_url = ""  # set by the app once the metrics endpoint listens
        self.proxy_transfers = TransferCounts()  # the proxy sessions' bulk transfers, for the metrics
        self.db_url = config.db_url
        self.dispatch = config.dispatch
        self.engine = make_engine(config.db_url)
        self.db = session_factory(self.engine)  # reads at start; every write goes through the writer
        self.writer = DbWriter(self.db)
        write = self.writer.submit
        self.cluster = Cluster(self.db, write, config.heartbeat_interval, config.heartbeat_timeout,
                               max_hosts=config.limits.max_hosts)
        self.registry = ProgramRegistry()
        self.slices = SliceService(self.db, write, self.cluster.hosts, self.registry.slice_in_use)
        self.slices.program_counts = self.registry.slice_counts
        self.slices.group_wait_s = config.group_wait
        self.scheduler = GangScheduler(
            hang_timeout_s=config.hang_timeout or None, default_policy=Policy(config.policy),
            max_inflight_nodes=config.window,
        )
        # the dispatcher's messages: direct, or through a relay per group of a large island's hosts
        self.relays = Relays(self.cluster.hosts, self.cluster.host_names, config.relay_min_hosts, config.relay_group)
        self.dispatcher = Dispatcher(self.scheduler, self.registry, self.slices, self.cluster.hosts,
                                     self.cluster.host_by_address, self.relays)
        # signs the credentials workers check (server/credentials.py); kept across restarts
        self.worker_key = load_or_create_key(paths.data_dir() / KEY_FILE)
        # signs the job secrets of drivers (kept across restarts: drivers outlive the controller)
        job_key = load_or_create_key(paths.data_dir() / JOB_KEY_FILE)
        self.sessions = SessionManager(self.dispatcher, self.registry, self.slices, self.cluster.broadcast,
                                       config.dispatch, worker_key=self.worker_key,
                                       store=SessionStore(self.db, write), grace_s=config.session_grace,
                                       job_key=job_key, max_per_caller=config.limits.max_sessions_per_caller)
        self.jobs = JobManager(self.db, write, spawn=self.spawn, scheduler=self.scheduler,
                               owned_slices=self.slices.list, release_owner=self.sessions.release_owner,
                               address=lambda: self.address, token=config.token, tls=config.tls,
                               log_max_mb=config.job_log_max_mb,
                               job_secret=lambda job_id: job_secret(job_key, job_id))
        self.removal = Removal(self.cluster, *slice_queries(lambda: self.slices.rm.slices),
                               lost_ttl_s=config.lost_host_ttl)
        self.hangs = HangReporter(self.scheduler, self.cluster.hosts, config.heartbeat_interval,
                                  lambda job_id: paths.jobs_dir() / job_id / "output.log")
        store = TraceStore(paths.data_dir() / "traces", config.trace_retention) if config.trace_retention else None
        self.observer = Observer(self.cluster, scheduler=self.scheduler, slices=self.slices.list,
                                 jobs=self.jobs.list, hangs=self.hangs, store=store)
        # the slices first: the dispatcher's placements and the clients' notices read them
        # the relays first: a lost relay's hosts get their messages again before anything new
        self.cluster.on_host_up += [self.relays.host_up, self.slices.host_up, self.dispatcher.host_up]
        # the sessions after the dispatcher: a client hears of the runs the loss failed first
        self.cluster.on_host_lost += [self.relays.host_lost, self.slices.host_lost, self.dispatcher.host_lost,
                                      self.observer.host_lost, self.sessions.host_lost]
        # islands spanning hosts: after the slices and the dispatcher (a lost host's runs fail first)
        self.groups = IslandGroups(self.cluster.hosts, self.cluster.hosts_of, self.cluster.send,
                                   coordinator_host(config.listen))
        self.cluster.on_host_up.append(self.groups.host_up)
        self.cluster.on_host_lost.append(self.groups.host_lost)
        self.groups.listeners.append(self.slices.group_changed)
        self.slices.groups = self.groups
        self.slices.listeners.append(self.sessions.slice_changed)
        self.sessions.program_listeners.append(self.jobs.program_registered)
        if self.scheduler.debug or self.slices.rm.debug:
            log.info("state machines validate their invariants after every stimulus (PATHWAYS_VALIDATE)")
        self.dispatcher.node_listeners.append(self.observer.on_node_event)
        self.dispatcher.run_listeners.append(self.jobs.run_finished)
        self.dispatcher.hang_listeners.append(self.hangs.hang_detected)
        self.started_mono = time.monotonic()
        self.started_at = now_iso()
        self.shutdown_event = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self.slices.load()  # before any host event: the cluster's listeners feed the resource manager
        gone = self.slices.release_clients(keep=self.sessions.load())  # the sessions that may resume keep theirs
        self.cluster.load()
        for owner in gone:  # and their buffers, on the workers that outlived the previous controller: each
            # hears of it as it registers again (Cluster.broadcast keeps it for the hosts not ready)
            self.cluster.broadcast(cpb.ControllerToWorker(release=wpb.ReleaseBuffers(owner=owner)))
        self.jobs.load()  # after the slices: releases what jobs of a crashed controller owned
        self.spawn(self.cluster.monitor())
        self.spawn(self._ticker())
        self.spawn(self.observer.persist())
        self.spawn(self._reap_island_services())
        self.spawn(self.sessions.expire_resumable())
        self.spawn(self.dispatcher.release_acks.run())
        self.spawn(self.removal.run())

    async def stop(self) -> None:
        self.groups.close()
        await self.jobs.stop()  # before the tasks go: the job watchers record how drivers ended
        for task in list(self._tasks):
            task.cancel()
        self.cluster.flush_heartbeats()
        self.observer.flush()
        if not await asyncio.to_thread(self.writer.close, WRITER_DRAIN_S):  # runs every write queued so far
            log.error("the database writer did not finish its queue within %g s; the rest is lost", WRITER_DRAIN_S)
        self.engine.dispose()

    async def _reap_island_services(self) -> None:
        """Island coordination services a previous controller left (groups.py): stopped once the
        workers had time to register again, which makes them leave those groups."""
        await asyncio.sleep(max(ORPHAN_SERVICES_AFTER_S, 2 * self.config.heartbeat_timeout))
        self.groups.reap_orphans()

    async def _ticker(self) -> None:
        """Drives time-based scheduler decisions (hang detection)."""
        while True:
            await asyncio.sleep(0.5)
            self.dispatcher.tick()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    def request_shutdown(self) -> None:
        self.cluster.closing = True  # worker streams closing now do not mean hosts were lost
        self.shutdown_event.set()

    def end_streams(self) -> None:
        """Ends the long-lived streams (workers, client sessions; `watch` and `logs -f` end on
        the shutdown event) so that their handlers return before the server stops."""
        self.request_shutdown()
        self.cluster.close_links()
        self.sessions.end_all("the controller is shutting down")

    # ---- queries used by the servicer ----
    def require_island(self, island: str) -> None:
        if island and island not in self.cluster.islands:
            known = ", ".join(sorted(self.cluster.islands)) or "none"
            raise NotFound(f"no island named {island!r} (islands: {known})")

    def slice_count(self) -> int:
        return self.slices.slice_count()

    def job_count(self) -> int:
        return self.jobs.count()

    def device_slice_count(self, device_id: int) -> int:
        return self.slices.device_slice_count(device_id)
