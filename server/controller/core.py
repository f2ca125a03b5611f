"""The controller's composition root: owns the components and wires their events."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from schemas.pathways.v1 import controller_pb2 as cpb

from ..db.engine import make_engine, session_factory
from ..scheduler import GangScheduler, Policy
from ..timeutil import now_iso
from .cluster import Cluster
from .dispatch import Dispatcher
from .errors import NotFound
from .jobs import JobManager
from .observe import Observer
from .programs import ProgramRecord, ProgramRegistry
from .sessions import ClientSession, SessionManager
from .slices import SliceService

log = logging.getLogger(__name__)


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
    require_token: bool = False  # also on loopback (tests check rejection without a public address)


class Controller:
    """Holds the state of one controller process; every method runs on its event loop."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.address = config.listen
        self.db_url = config.db_url
        self.dispatch = config.dispatch
        self.engine = make_engine(config.db_url)
        self.db = session_factory(self.engine)
        self.cluster = Cluster(self.db, config.heartbeat_interval, config.heartbeat_timeout)
        self.slices = SliceService(self)
        self.registry = ProgramRegistry()
        self.scheduler = GangScheduler(
            hang_timeout_s=config.hang_timeout or None, default_policy=Policy(config.policy),
            max_inflight_nodes=config.window,
        )
        if self.scheduler.debug or self.slices.rm.debug:
            log.info("state machines validate their invariants after every stimulus (PATHWAYS_VALIDATE)")
        self.dispatcher = Dispatcher(self, self.scheduler)
        self.sessions = SessionManager(self)
        self.cluster.on_host_up.append(self.dispatcher.host_up)
        self.cluster.on_host_lost.append(self.dispatcher.host_lost)
        self.observer = Observer(self)
        self.dispatcher.node_listeners.append(self.observer.on_node_event)
        self.cluster.on_host_lost.append(self.observer.host_lost)
        self.jobs = JobManager(self)  # after the dispatcher: it listens to finished runs
        self.started_mono = time.monotonic()
        self.started_at = now_iso()
        self.shutdown_event = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self.slices.load()  # before any host event: the cluster's listeners feed the resource manager
        self.slices.release_clients()
        self.cluster.load()
        self.jobs.load()  # after the slices: releases what jobs of a crashed controller owned
        self.spawn(self.cluster.monitor())
        self.spawn(self._ticker())

    async def stop(self) -> None:
        await self.jobs.stop()  # before the tasks go: the job watchers record how drivers ended
        for task in list(self._tasks):
            task.cancel()
        self.cluster.flush_heartbeats()
        self.engine.dispose()

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

    # ---- worker events ----
    def node_events(self, host: str, events: cpb.NodeEvents) -> None:
        self.dispatcher.node_events(host, events)

    def program_registered(self, session: ClientSession, program: ProgramRecord) -> None:
        self.jobs.program_registered(session, program)
