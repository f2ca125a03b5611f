"""Hosts, islands and devices: registration, heartbeats, loss and return.

In memory for the hot path, mirrored in the database for restarts. Listeners (the
resource manager, the scheduler) hear when a host comes up or is lost.

The database is read once, at start; every later change is a job for the database writer,
which the event loop never waits on. Host and device ids are therefore assigned here, from
what the database held at start: this controller is the database's only writer.

Costs grow with what changed, not with the cluster (issue 31): a registration, a heartbeat and
a loss touch one host's entries; the per-island indexes (`_by_island`, `_counts`) make island
listings cost one step per island; a heartbeat only stamps the host's monotonic time (and keeps
a reference to the beat, what the worker holds, for the metrics), and
last-seen times reach the database coarsely (every `PERSIST_SEEN_S`) as one batched UPDATE;
hosts found silent together are marked lost in one pass with one write.

Heartbeats: the interval the workers are given grows with the cluster (`beat_interval`), so
that their load on the controller stays bounded (each beat costs the controller's event loop
~100-250 us, most of it inside grpc.aio: about 300 beats a second is ~7% of a core), and the loss
timeout with it (two beats at least: one missed beat and the slack of the next), so that a silent
host is still found within 15 s. It never shrinks while the controller runs, and connected
workers hear of every change (`HeartbeatSettings`).

Restart: hosts the database knew as ready are presumed alive until they miss their own
reconnection window, counted from when this controller could first hear them (its monitor's
first tick, after the server started): the configured heartbeat timeout plus
`RECONNECT_PER_HOST_S` per host to come back (15 s at 2,048 hosts), since the workers
re-register one after another through one event loop. A monitor tick that comes late (the loop
was busy) marks nobody lost: what the loop could not read meanwhile may be heartbeats.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from bisect import bisect_left, insort
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb

from ..db.models import DeviceRow, HostRow, IslandRow, utcnow
from ..db.writer import Write
from ..timeutil import iso
from . import hostcreds
from .cluster_rows import (
    LOST,
    READY,
    delete_host_rows,
    delete_island_row,
    save_heartbeats,
    save_lost,
    save_registration,
)
from .errors import AlreadyExists, Rejected
from .host_info import RECONNECTING as RECONNECTING
from .host_info import HostInfo as HostInfo
from .host_info import HostListener, LostListener
from .host_info import device_state as device_state
from .host_info import host_state as host_state
from .limits import DEFAULT_MAX_HOSTS
from .links import WorkerLink

log = logging.getLogger(__name__)

PERSIST_SEEN_S = 30.0  # how stale the database's last-seen times may get (they are for display)
MONITOR_S = 0.25  # how often silence is checked: a silent host is found within timeout + this
LATE_TICK_S = 1.0  # a monitor tick this late means the loop was busy: nobody is marked lost
RECONNECT_PER_HOST_S = 0.005  # added to the reconnection window per host the database knew
HOSTS_PER_INTERVAL = 256  # the heartbeat interval doubles each time the hosts double beyond this
MAX_MISSED = 4096  # owners' releases kept per host that is not ready (the oldest go first)
MAX_SCALED_INTERVAL_S = 7.0  # ... up to this: with 2 beats per timeout, found lost within 14.25 s
BEATS_PER_TIMEOUT = 2


def beat_interval(base: float, hosts: int) -> float:
    """The heartbeat interval for a cluster of `hosts`: `base` up to `HOSTS_PER_INTERVAL` hosts,
    doubling with every doubling beyond, never past `MAX_SCALED_INTERVAL_S` (nor below `base`).
    At the default 1 s: 1 s up to 256 hosts, 2 s up to 512, 4 s up to 1,024, 7 s beyond: about
    300 beats a second at 2,048 hosts."""
    scale = 1
    while hosts > HOSTS_PER_INTERVAL * scale:
        scale *= 2
    return max(base, min(base * scale, MAX_SCALED_INTERVAL_S))


class Cluster:
    """The registry of workers. All methods run on the controller's event loop.

    `hosts` is the registry by name (shared read-only with other components); `_by_island`
    holds the same hosts by island, `_names` their names sorted, `_counts[island]` = [devices,
    available devices] and `_by_address` the ready hosts by address: `_add` and `_set_state`
    keep them in step."""

    def __init__(self, sessions: sessionmaker[Session], write: Write, heartbeat_interval: float,
                 heartbeat_timeout: float, max_hosts: int = DEFAULT_MAX_HOSTS):
        self._sessions = sessions
        self._write = write
        self.base_interval = heartbeat_interval
        self.base_timeout = heartbeat_timeout
        self.heartbeat_interval = heartbeat_interval  # what workers are told now
        self.heartbeat_timeout = heartbeat_timeout  # silence after which a ready host is lost
        self.max_hosts = max_hosts  # hosts known (any state); a new name beyond it is refused
        self.hosts: dict[str, HostInfo] = {}
        self.islands: dict[str, datetime] = {}
        self._by_island: dict[str, dict[str, HostInfo]] = {}
        self._names: dict[str, list[str]] = {}  # island -> its host names, sorted (for paging)
        self._counts: dict[str, list[int]] = {}
        self._by_address: dict[str, HostInfo] = {}  # ready hosts
        self.on_host_up: list[HostListener] = []
        self.on_host_lost: list[LostListener] = []
        # host name -> local index -> device id, every device the host ever had (also removed ones)
        self._device_ids: dict[str, dict[int, int]] = {}
        self._host_ids = itertools.count(1)
        self._new_device_ids = itertools.count(1)
        self._reconnect_until: float | None = None  # set on the monitor's first tick
        self._missed: dict[str, list[cpb.ControllerToWorker]] = {}  # host -> releases (`broadcast`)
        # Set when the controller shuts down: its worker streams then close because it goes away,
        # not because hosts died; marking them lost would remap slices and persist that.
        self.closing = False

    # ---- indexes ----
    def _add(self, info: HostInfo) -> None:
        """Enters `info` in the registry and the indexes, replacing the entry of its name."""
        old = self.hosts.get(info.name)
        if old is not None:
            self._count(old, -1)
            if old.island != info.island:
                del self._by_island[old.island][old.name]
                names = self._names[old.island]
                del names[bisect_left(names, old.name)]
        members = self._by_island.setdefault(info.island, {})
        if info.name not in members:
            insort(self._names.setdefault(info.island, []), info.name)
        members[info.name] = info
        self.hosts[info.name] = info
        self._count(info, 1)

    def _remove(self, info: HostInfo) -> None:
        """Takes `info` out of the registry and every index (its host was deleted)."""
        self._count(info, -1)
        del self._by_island[info.island][info.name]
        names = self._names[info.island]
        del names[bisect_left(names, info.name)]
        del self.hosts[info.name]
        self._device_ids.pop(info.name, None)

    def _count(self, info: HostInfo, sign: int) -> None:
        counts = self._counts.setdefault(info.island, [0, 0])
        counts[0] += sign * len(info.device_ids)
        if info.state == READY:
            counts[1] += sign * len(info.device_ids)
            if sign > 0:
                self._by_address[info.address] = info
            elif self._by_address.get(info.address) is info:
                del self._by_address[info.address]

    def _set_state(self, info: HostInfo, state: str) -> None:
        self._count(info, -1)
        info.state = state
        self._count(info, 1)

    def hosts_of(self, island: str) -> Iterable[HostInfo]:
        """The hosts of one island (any state), in no particular order."""
        return self._by_island.get(island, {}).values()

    def host_names(self, island: str) -> list[str]:
        """The names of an island's hosts, sorted (the index itself: do not change it)."""
        return self._names.get(island, [])

    def island_counts(self, island: str) -> tuple[int, int, int]:
        """(hosts, devices, available devices) of one island."""
        devices, available = self._counts.get(island, (0, 0))
        return len(self._by_island.get(island, ())), devices, available

    # ---- start-up ----
    def load(self) -> None:
        """Restores what the database knew; hosts it knew as ready are reconnecting (module
        docstring: how long they have to come back)."""
        with self._sessions() as s:
            self._host_ids = itertools.count((s.scalar(select(func.max(HostRow.id))) or 0) + 1)
            self._new_device_ids = itertools.count((s.scalar(select(func.max(DeviceRow.id))) or 0) + 1)
            island_names: dict[int, str] = {}
            for island in s.scalars(select(IslandRow)):
                self.islands[island.name] = island.created_at
                island_names[island.id] = island.name
            devices: dict[int, list[DeviceRow]] = {}
            for d in s.scalars(select(DeviceRow).order_by(DeviceRow.host_id, DeviceRow.local_index)):
                devices.setdefault(d.host_id, []).append(d)
            for row in s.scalars(select(HostRow)):
                rows = devices.get(row.id, [])
                self._device_ids[row.name] = {d.local_index: d.id for d in rows}
                self._add(HostInfo(
                    id=row.id,
                    name=row.name,
                    island=island_names[row.island_id],
                    address=row.address,
                    pid=row.pid,
                    kind=row.device_kind,
                    machine_id=row.machine_id,
                    device_ids=[d.id for d in rows if d.state != "removed"],
                    state=RECONNECTING if row.state == READY else row.state,
                    last_heartbeat=row.last_heartbeat,
                    credential_hash=row.credential_hash,
                ))
        self._rescale()

    # ---- registration ----
    def admit(self, msg: cpb.RegisterWorker) -> tuple[str, str]:
        """Whether `msg` may take its host name: (the credential to give the worker, "" when it
        keeps its own; the digest to keep). A live (ready or reconnecting) host's name is taken
        only with its credential; a lost host's by anyone (a new credential then), a new name
        while fewer than `max_hosts` hosts are known. Raises AlreadyExists or Rejected."""
        old = self.hosts.get(msg.name)
        if old is not None and old.credential_hash and hostcreds.matches(msg.credential, old.credential_hash):
            return "", old.credential_hash  # the host itself, back
        if old is not None and old.state != LOST and old.credential_hash is not None:
            log.warning("refused a registration as host %s (%s, island %s): the host is %s and the "
                        "registration %s its credential", msg.name, msg.address or "no address", msg.island,
                        old.state, "lacks" if not msg.credential else "does not carry")
            raise AlreadyExists(
                f"host {msg.name} is registered and {old.state}: a registration under its name must carry "
                "its credential (or stop that worker; `pwctl host delete` removes a lost host)")
        if old is None and len(self.hosts) >= self.max_hosts:
            raise Rejected(f"the cluster holds {len(self.hosts)} hosts, the limit (the controller's --max-hosts); "
                           "`pwctl host delete` removes lost ones")
        return hostcreds.issue()

    def register(self, msg: cpb.RegisterWorker, link: WorkerLink, credential_hash: str | None = None) -> HostInfo:
        """Records the host in memory at once and queues its rows (island, host, devices).
        `credential_hash`: what `admit` returned (the caller checked the registration with it)."""
        now = utcnow()
        created = self.islands.setdefault(msg.island, now)
        old = self.hosts.get(msg.name)
        if old is not None and old.state == READY and (old.pid, old.address) != (msg.pid, msg.address):
            # a new process before the old one's stream was seen to end (the controller was busy
            # or frozen): the old one is lost first, so its runs fail and its slices come back
            # on the new address, which clients hear of
            self.mark_lost(msg.name, f"a new worker process (pid {msg.pid}) registered in its place")
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
            credential_hash=credential_hash,
        )
        info.persisted_seen = info.last_seen
        devices = dict(by_index)
        known = old is not None
        self._write(lambda s: save_registration(s, msg, host_id, now, created, devices, known, credential_hash))
        if old is not None and old.link is not None and old.link is not link:
            old.link.close()
        info.link = link
        self._add(info)
        log.info("host %s registered on island %s (%d %s devices) at %s",
                 msg.name, msg.island, msg.device_count, msg.device_kind, msg.address)
        if old is None:
            self._rescale()
        for cb in self.on_host_up:
            cb(info)
        return info

    # ---- removal (removal.py decides; these keep the registry and the database in step) ----
    def all_device_ids(self, name: str) -> list[int]:
        """Every device id host `name` ever had (removed ones too: the database keeps their rows)."""
        return list(self._device_ids.get(name, {}).values())

    def delete_host(self, info: HostInfo) -> None:
        """Forgets a host (name, ids, credential) and queues the deletion of its rows."""
        if info.link is not None:
            info.link.close()
            info.link = None
        self._remove(info)
        self._missed.pop(info.name, None)
        host_id = info.id
        self._write(lambda s: delete_host_rows(s, host_id))

    def delete_island(self, name: str) -> None:
        """Forgets an island that holds no host and queues the deletion of its row."""
        assert not self._by_island.get(name), f"island {name} still holds hosts"
        self.islands.pop(name, None)
        self._by_island.pop(name, None)
        self._names.pop(name, None)
        self._counts.pop(name, None)
        self._write(lambda s: delete_island_row(s, name))

    def _rescale(self) -> None:
        """Lengthens the heartbeat interval (and the loss timeout with it) when the cluster grew
        past a step, and tells the connected workers (at most a few times in a cluster's life)."""
        interval = beat_interval(self.base_interval, len(self.hosts))
        if interval <= self.heartbeat_interval:
            return
        self.heartbeat_interval = interval
        self.heartbeat_timeout = max(self.base_timeout, BEATS_PER_TIMEOUT * interval)
        log.info("%d hosts: heartbeat every %g s, lost after %g s of silence",
                 len(self.hosts), interval, self.heartbeat_timeout)
        msg = cpb.ControllerToWorker(heartbeat=cpb.HeartbeatSettings(heartbeat_interval_s=interval))
        for info in self.hosts.values():
            if info.link is not None:
                info.link.send(msg)

    def heartbeat(self, name: str, hb: cpb.Heartbeat) -> None:
        """The host is alive; what it holds (`hb`) is kept as it is for the metrics, read at scrape
        time (one reference stored: a beat costs no more)."""
        info = self.hosts.get(name)
        if info is not None and info.state == READY:
            info.last_seen = time.monotonic()
            info.held = hb

    def last_heartbeat(self, info: HostInfo, now_wall: datetime, now_mono: float) -> datetime:
        """The wall time of the host's last sign of life."""
        if info.state != READY:
            return info.last_heartbeat
        return now_wall - timedelta(seconds=max(0.0, now_mono - info.last_seen))

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
        self.mark_lost_many([(name, reason)])

    def mark_lost_many(self, losses: list[tuple[str, str]]) -> None:
        """Marks hosts lost in one pass: one database write for all of them, then the listeners
        hear of each."""
        if self.closing:
            return
        now_wall, now_mono = utcnow(), time.monotonic()
        lost: list[tuple[HostInfo, str]] = []
        for name, reason in losses:
            info = self.hosts.get(name)
            if info is None or info.state == LOST:
                continue
            info.last_heartbeat = self.last_heartbeat(info, now_wall, now_mono)
            self._set_state(info, LOST)
            if info.link is not None:
                info.link.close()
                info.link = None
            lost.append((info, reason))
        if not lost:
            return
        rows = [(info.id, info.last_heartbeat) for info, _ in lost]
        self._write(lambda s: save_lost(s, rows))
        for info, reason in lost:
            log.warning("host %s lost: %s", info.name, reason)
            for cb in self.on_host_lost:
                cb(info, reason)

    # ---- background ----
    async def monitor(self) -> None:
        """Marks hosts lost when heartbeats stop; persists last-seen times now and then."""
        last_persist = last_tick = time.monotonic()
        while True:
            await asyncio.sleep(min(MONITOR_S, self.heartbeat_interval))
            now = time.monotonic()
            late = now - last_tick > MONITOR_S + LATE_TICK_S
            last_tick = now
            if self._reconnect_until is None:
                self.open_reconnect_window(now)
            if not late:
                self.check_silence(now)
            if now - last_persist > PERSIST_SEEN_S:
                self.flush_heartbeats()
                last_persist = now

    def open_reconnect_window(self, now: float) -> float:
        """From `now` (the controller can hear its workers), the hosts the database knew as
        ready have the configured heartbeat timeout (not the one lengthened with the interval:
        reconnecting is not beating) plus `RECONNECT_PER_HOST_S` each to register again; returns
        when that window closes."""
        reconnecting = [h for h in self.hosts.values() if h.state == RECONNECTING]
        for h in reconnecting:
            h.last_seen = now
        self._reconnect_until = now + self.base_timeout + RECONNECT_PER_HOST_S * len(reconnecting)
        return self._reconnect_until

    def check_silence(self, now: float) -> None:
        """Marks lost, in one pass, the ready hosts silent for longer than the timeout and the
        reconnecting ones whose window closed."""
        timeout = self.heartbeat_timeout
        cutoff = now - timeout
        window_closed = self._reconnect_until is not None and now > self._reconnect_until
        losses: list[tuple[str, str]] = []
        for info in self.hosts.values():
            if info.state == READY:
                if info.last_seen < cutoff:
                    losses.append((info.name, f"no heartbeat for {timeout:g} s"))
            elif info.state == RECONNECTING and window_closed:
                losses.append((info.name, "did not reconnect within the window after the controller's start"))
        if losses:
            self.mark_lost_many(losses)

    def flush_heartbeats(self) -> None:
        """Queues the last-seen times of the ready hosts heard from since they were last
        persisted, as one write (one executemany UPDATE)."""
        now_wall, now_mono = utcnow(), time.monotonic()
        rows: list[tuple[int, datetime]] = []
        for info in self.hosts.values():
            if info.state == READY and info.last_seen > info.persisted_seen:
                info.persisted_seen = info.last_seen
                rows.append((info.id, self.last_heartbeat(info, now_wall, now_mono)))
        if rows:
            self._write(lambda s: save_heartbeats(s, rows))

    # ---- sending ----
    def send(self, host: str, msg: cpb.ControllerToWorker) -> None:
        """Queues `msg` on host `host`'s stream (dropped when it has none: it is lost)."""
        info = self.hosts.get(host)
        if info is not None and info.link is not None:
            info.link.send(msg)

    def broadcast(self, msg: cpb.ControllerToWorker) -> None:
        """Queues `msg` on the stream of every ready host; an owner's release (its session or job
        ended) is kept for the others until they register again (`missed`): a worker frozen past
        its host's loss comes back with its buffers, which nothing else would ever free."""
        keep = msg.WhichOneof("msg") == "release" and msg.release.owner
        for info in self.hosts.values():
            if info.state == READY and info.link is not None:
                info.link.send(msg)
            elif keep:
                missed = self._missed.setdefault(info.name, [])
                missed.append(msg)
                del missed[:-MAX_MISSED]

    def missed(self, name: str) -> list[cpb.ControllerToWorker]:
        """The owners' releases host `name` missed while not ready (`broadcast`), now forgotten."""
        return self._missed.pop(name, [])

    # ---- views ----
    def host_by_address(self, address: str) -> HostInfo | None:
        return self._by_address.get(address)

    def island_protos(self) -> list[pb.Island]:
        """One entry per island, from the per-island counts (no host is visited)."""
        out = []
        for name, created in sorted(self.islands.items()):
            hosts, devices, available = self.island_counts(name)
            out.append(pb.Island(name=name, hosts=hosts, devices=devices, available_devices=available,
                                 created_at=iso(created.replace(tzinfo=UTC))))
        return out
