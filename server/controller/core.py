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
from ..timeutil import now_iso
from .cluster import Cluster, HostInfo
from .errors import NotFound

log = logging.getLogger(__name__)


@dataclass
class ControllerConfig:
    listen: str
    db_url: str
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    dispatch: str = "parallel"  # or "sequential"
    hang_timeout: float = 60.0
    token: str | None = None


class Controller:
    """Holds the state of one controller process; every method runs on its event loop."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.address = config.listen
        self.db_url = config.db_url
        self.dispatch = config.dispatch
        self.engine = make_engine(config.db_url)
        self.sessions = session_factory(self.engine)
        self.cluster = Cluster(self.sessions, config.heartbeat_interval, config.heartbeat_timeout)
        self.started_mono = time.monotonic()
        self.started_at = now_iso()
        self.shutdown_event = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self.cluster.load()
        self.spawn(self.cluster.monitor())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self.cluster.flush_heartbeats()
        self.engine.dispose()

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
        self.shutdown_event.set()

    # ---- queries used by the servicer ----
    def require_island(self, island: str) -> None:
        if island and island not in self.cluster.islands:
            known = ", ".join(sorted(self.cluster.islands)) or "none"
            raise NotFound(f"no island named {island!r} (islands: {known})")

    def slice_count(self) -> int:
        return 0

    def job_count(self) -> int:
        return 0

    def device_slice_count(self, device_id: int) -> int:
        return 0

    # ---- worker events ----
    def host_connected(self, info: HostInfo) -> None:
        pass

    def node_events(self, host: str, events: cpb.NodeEvents) -> None:
        pass
