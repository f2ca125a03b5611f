"""Hosts, islands and devices: registration, heartbeats, loss and return.

In memory for the hot path, mirrored in the database for restarts. Listeners (the
resource manager, the scheduler) hear when a host comes up or is lost.

The database is read once, at start; every later change is a job for the database writer,
which the event loop never waits on. Host and device ids are therefore assigned here, from
what the database held at start: this controller is the database's only writer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb

from ..db.models import DeviceRow, HostRow, IslandRow, utcnow
from ..db.writer import Write
from ..timeutil import iso
from .links import WorkerLink

log = logging.getLogger(__name__)

READY = "ready"
LOST = "lost"
# In memory only: a host the database knew as ready when this controller started, whose worker
# has not registered with it yet (the database keeps "ready", so its slices keep their devices).
RECONNECTING = "reconnecting"

_HOST_STATES = {READY: pb.HOST_STATE_READY, RECONNECTING: pb.HOST_STATE_RECONNECTING}
_DEVICE_STATES = {READY: pb.DEVICE_STATE_AVAILABLE, RECONNECTING: pb.DEVICE_STATE_RECONNECTING}


def host_state(state: str) -> pb.HostState.ValueType:
    return _HOST_STATES.get(state, pb.HOST_STATE_LOST)


def device_state(state: str) -> pb.DeviceState.ValueType:
    """A device's state, from its host's."""
    return _DEVICE_STATES.get(state, pb.DEVICE_STATE_LOST)


@dataclass
class HostInfo:
    id: int
    name: str
    island: str
    address: str
    pid: int
    kind: str
    machine_id: str
    device_ids: list[int]
    state: str
    last_seen: float = field(default_factory=time.monotonic)
    last_heartbeat: datetime = field(default_factory=utcnow)
    link: WorkerLink | None = None


HostListener = Callable[[HostInfo], None]
LostListener = Callable[[HostInfo, str], None]


class Cluster:
    """The registry of workers. All methods run on the controller's event loop."""

    def __init__(self, sessions: sessionmaker[Session], write: Write, heartbeat_interval: float,
                 heartbeat_timeout: float):
        self._sessions = sessions
        self._write = write
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.hosts: dict[str, HostInfo] = {}
        self.islands: dict[str, datetime] = {}
        self.on_host_up: list[HostListener] = []
        self.on_host_lost: list[LostListener] = []
        self._dirty: set[str] = set()
        # host name -> local index -> device id, every device the host ever had (also removed ones)
        self._device_ids: dict[str, dict[int, int]] = {}
        self._host_ids = itertools.count(1)
        self._new_device_ids = itertools.count(1)
        # Set when the controller shuts down: its worker streams then close because it goes away,
        # not because hosts died; marking them lost would remap slices and persist that.
        self.closing = False

    # ---- start-up ----
    def load(self) -> None:
        """Restores what the database knew; hosts it knew as ready are reconnecting and get one
        heartbeat timeout to register again."""
        with self._sessions() as s:
            self._host_ids = itertools.count((s.scalar(select(func.max(HostRow.id))) or 0) + 1)
            self._new_device_ids = itertools.count((s.scalar(select(func.max(DeviceRow.id))) or 0) + 1)
            for island in s.scalars(select(IslandRow)):
                self.islands[island.name] = island.created_at
            for row in s.scalars(select(HostRow)):
                self._device_ids[row.name] = {d.local_index: d.id for d in row.devices}
                self.hosts[row.name] = HostInfo(
                    id=row.id,
                    name=row.name,
                    island=row.island.name,
                    address=row.address,
                    pid=row.pid,
                    kind=row.device_kind,
                    machine_id=row.machine_id,
                    device_ids=[d.id for d in row.devices if d.state != "removed"],
                    state=RECONNECTING if row.state == READY else row.state,
                    last_heartbeat=row.last_heartbeat,
                )

    # ---- registration ----
    def register(self, msg: cpb.RegisterWorker, link: WorkerLink) -> HostInfo:
        """Records the host in memory at once and queues its rows (island, host, devices)."""
        now = utcnow()
        created = self.islands.setdefault(msg.island, now)
        old = self.hosts.get(msg.name)
        host_id = old.id if old is not None else next(self._host_ids)
        by_index = self._device_ids.setdefault(msg.name, {})
        for i in range(msg.device_count):
            if i not in by_index:
                by_index[i] = next(self._new_device_ids)
        info = HostInfo(
            id=host_id,
            name=msg.name,
            island=msg.island,
            address=msg.address,
            pid=msg.pid,
            kind=msg.device_kind,
            machine_id=msg.machine_id,
            device_ids=[by_index[i] for i in range(msg.device_count)],
            state=READY,
            last_heartbeat=now,
        )
        devices = dict(by_index)
        self._write(lambda s: _save_registration(s, msg, host_id, now, created, devices))
        if old is not None and old.link is not None and old.link is not link:
            old.link.close()
        info.link = link
        self.hosts[msg.name] = info
        log.info("host %s registered on island %s (%d %s devices) at %s",
                 msg.name, msg.island, msg.device_count, msg.device_kind, msg.address)
        for cb in self.on_host_up:
            cb(info)
        return info

    def heartbeat(self, name: str, hb: cpb.Heartbeat) -> None:
        """The host is alive (the buffer counts `hb` carries are the worker's to report, not kept)."""
        info = self.hosts.get(name)
        if info is None or info.state != READY:
            return
        info.last_seen = time.monotonic()
        info.last_heartbeat = utcnow()
        self._dirty.add(name)

    def close_links(self) -> None:
        """Ends every worker's stream as the controller shuts down: their handlers return
        instead of being cancelled, and the workers reconnect to the next controller."""
        for info in self.hosts.values():
            if info.link is not None:
                info.link.close()

    def disconnected(self, name: str, link: WorkerLink) -> None:
        info = self.hosts.get(name)
        if info is not None and info.link is link:
            self.mark_lost(name, "its connection closed")

    def mark_lost(self, name: str, reason: str) -> None:
        info = self.hosts.get(name)
        if info is None or info.state == LOST or self.closing:
            return
        info.state = LOST
        if info.link is not None:
            info.link.close()
            info.link = None
        host_id, last = info.id, info.last_heartbeat
        self._write(lambda s: _save_lost(s, host_id, last))
        log.warning("host %s lost: %s", name, reason)
        for cb in self.on_host_lost:
            cb(info, reason)

    # ---- background ----
    async def monitor(self) -> None:
        """Marks hosts lost when heartbeats stop; flushes heartbeat times to the database."""
        last_flush = time.monotonic()
        while True:
            await asyncio.sleep(min(0.25, self.heartbeat_interval))
            now = time.monotonic()
            for info in list(self.hosts.values()):
                if info.state in (READY, RECONNECTING) and now - info.last_seen > self.heartbeat_timeout:
                    t = self.heartbeat_timeout
                    self.mark_lost(info.name, f"no heartbeat for {t:g} s" if info.state == READY
                                   else f"did not reconnect within {t:g} s of the controller's start")
            if self._dirty and now - last_flush > 2.0:
                self.flush_heartbeats()
                last_flush = now

    def flush_heartbeats(self) -> None:
        """Queues the heartbeat times that changed since the last flush as one write."""
        dirty, self._dirty = self._dirty, set()
        times = {info.id: info.last_heartbeat for info in map(self.hosts.get, dirty) if info is not None}
        if times:
            self._write(lambda s: _save_heartbeats(s, times))

    # ---- sending ----
    def send(self, host: str, msg: cpb.ControllerToWorker) -> None:
        """Queues `msg` on host `host`'s stream (dropped when it has none: it is lost)."""
        info = self.hosts.get(host)
        if info is not None and info.link is not None:
            info.link.send(msg)

    def broadcast(self, msg: cpb.ControllerToWorker) -> None:
        """Queues `msg` on the stream of every ready host."""
        for info in self.hosts.values():
            if info.state == READY and info.link is not None:
                info.link.send(msg)

    # ---- views ----
    def host_by_address(self, address: str) -> HostInfo | None:
        for h in self.hosts.values():
            if h.address == address and h.state == READY:
                return h
        return None

    def ready_hosts(self) -> list[HostInfo]:
        return [h for h in self.hosts.values() if h.state == READY]

    def host_of_device(self) -> dict[int, HostInfo]:
        return {d: h for h in self.hosts.values() for d in h.device_ids}

    def island_protos(self) -> list[pb.Island]:
        out = []
        for name, created in sorted(self.islands.items()):
            hosts = [h for h in self.hosts.values() if h.island == name]
            out.append(
                pb.Island(
                    name=name,
                    hosts=len(hosts),
                    devices=sum(len(h.device_ids) for h in hosts),
                    available_devices=sum(len(h.device_ids) for h in hosts if h.state == READY),
                    created_at=iso(created.replace(tzinfo=UTC)),
                )
            )
        return out

    def host_protos(self, island: str = "") -> list[pb.Host]:
        return [
            pb.Host(
                id=h.id,
                name=h.name,
                island=h.island,
                address=h.address,
                state=host_state(h.state),
                pid=h.pid,
                last_heartbeat=iso(h.last_heartbeat),
                devices=len(h.device_ids),
                device_kind=h.kind,
            )
            for h in sorted(self.hosts.values(), key=lambda h: (h.island, h.name))
            if not island or h.island == island
        ]

    def device_protos(self, island: str = "", slice_count: Callable[[int], int] | None = None) -> list[pb.Device]:
        out = []
        for h in sorted(self.hosts.values(), key=lambda h: (h.island, h.name)):
            if island and h.island != island:
                continue
            for local, dev_id in enumerate(h.device_ids):
                out.append(
                    pb.Device(
                        id=dev_id,
                        island=h.island,
                        host=h.name,
                        local_index=local,
                        kind=h.kind,
                        state=device_state(h.state),
                        last_heartbeat=iso(h.last_heartbeat),
                        slices=slice_count(dev_id) if slice_count else 0,
                    )
                )
        return out


# ---- database writes (run by the writer, in the order they were queued) ----
def _save_registration(s: Session, msg: cpb.RegisterWorker, host_id: int, now: datetime,
                       island_created: datetime, devices: dict[int, int]) -> None:
    island = s.scalar(select(IslandRow).where(IslandRow.name == msg.island))
    if island is None:
        island = IslandRow(name=msg.island, created_at=island_created)
        s.add(island)
        s.flush()
    host = s.get(HostRow, host_id)
    if host is None:
        host = HostRow(id=host_id, name=msg.name, island_id=island.id, address=msg.address, state=READY,
                       pid=msg.pid, device_kind=msg.device_kind, machine_id=msg.machine_id)
        s.add(host)
    host.island_id = island.id
    host.address, host.pid, host.state = msg.address, msg.pid, READY
    host.device_kind, host.machine_id, host.last_heartbeat = msg.device_kind, msg.machine_id, now
    s.flush()
    existing = {d.id: d for d in s.scalars(select(DeviceRow).where(DeviceRow.host_id == host_id))}
    for index, dev_id in devices.items():
        state = "available" if index < msg.device_count else "removed"
        dev = existing.get(dev_id)
        if dev is None:
            s.add(DeviceRow(id=dev_id, host_id=host_id, local_index=index, kind=msg.device_kind, state=state))
        else:
            dev.state = state
            if state == "available":
                dev.kind = msg.device_kind


def _save_lost(s: Session, host_id: int, last_heartbeat: datetime) -> None:
    row = s.get(HostRow, host_id)
    if row is not None:
        row.state = LOST
        row.last_heartbeat = last_heartbeat
        for dev in row.devices:
            if dev.state == "available":
                dev.state = "lost"


def _save_heartbeats(s: Session, times: dict[int, datetime]) -> None:
    for host_id, at in times.items():
        row = s.get(HostRow, host_id)
        if row is not None:
            row.last_heartbeat = at
