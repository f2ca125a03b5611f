"""Virtual slices: the I/O shell around the pure `ResourceManager`.

Requests and host events become resource-manager events; the actions that come back become
database writes (one transaction per event: slice operations are control plane, not hot path),
protobuf replies, and `slice_changed` notices to connected clients. The resource manager's state
is the truth while the controller runs; the database is its durable copy, read once at start.

Every method runs on the controller's event loop, one at a time, so two creates racing for the
last devices are decided in arrival order: exactly one wins.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload, sessionmaker

from schemas.pathways.v1 import controller_pb2 as cpb

from .. import resource_manager as rm
from ..db.models import DeviceRow, HostRow, SliceRow, utcnow
from ..db.writer import Write
from ..timeutil import iso
from .cluster import READY, HostInfo
from .errors import AlreadyExists, ControllerError, GroupForming, InUse, InvalidArgument, NotFound, Rejected
from .groups import GROUP_STRIDE, IslandGroups
from .holders import Holders, slice_holders
from .segments import Gang
from .slice_rows import RowOp, auto_seq, slice_of, write_rows

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_GROUP_WAIT_S = 60.0  # the controller's --group-wait

_STATE = {
    rm.SliceStatus.READY: cpb.SLICE_STATE_READY,
    rm.SliceStatus.REMAPPED: cpb.SLICE_STATE_REMAPPED,
    rm.SliceStatus.DEGRADED: cpb.SLICE_STATE_DEGRADED,
}

_ERRORS: dict[rm.RejectCode, type[ControllerError]] = {
    rm.RejectCode.INVALID: InvalidArgument,
    rm.RejectCode.NOT_FOUND: NotFound,
    rm.RejectCode.CONFLICT: AlreadyExists,
    rm.RejectCode.CAPACITY: Rejected,
    rm.RejectCode.IN_USE: InUse,
}


# Actions that change state (everything but Rejected and PlacementPreview).
_Change = rm.SliceCreated | rm.SliceDeleted | rm.SliceRemapped | rm.SliceDegraded | rm.SliceRestored


@dataclass(frozen=True)
class Placement:
    """Where a slice's work runs now, for the dispatcher.

    `local_devices[i]` is the index, on `host`, of the physical device virtual device i maps to.
    `generation` changes on every remap: executables compiled for an older one must be re-lowered.
    """

    slice: str
    host: HostInfo
    local_devices: list[int]
    generation: int
    island: str
    # a slice over several hosts of its island (server/controller/groups.py); `host` is then its
    # first member (where uploads go) and `local_devices` are group-wide numbers
    gang: Gang | None = None


@dataclass
class _Meta:
    """What the database knows about a slice that the resource manager does not keep."""

    created_at: datetime
    remap_at: list[datetime]


SliceListener = Callable[[cpb.Slice], None]


class SliceService:
    """Owns the resource manager; see the module docstring.

    Collaborators: the database, the cluster's hosts by name (for placements and display),
    and `in_use`, which says why a slice may not be deleted (None: it may). The cluster's host
    listeners are `host_up` and `host_lost`; `listeners` hear every slice that changed under
    its clients (remapped, degraded, restored).
    """

    def __init__(self, db: sessionmaker[Session], write: Write, hosts: Mapping[str, HostInfo],
                 in_use: Callable[[str], str | None]) -> None:
        self.rm = rm.ResourceManager()
        self._db = db
        self._write = write
        self._hosts = hosts
        self._in_use = in_use
        # slice name -> registered programs placed on it (the controller sets it; none without)
        self.program_counts: Callable[[], Mapping[str, int]] = dict
        self.listeners: builtins.list[SliceListener] = []
        self._last_write: Future[None] | None = None
        self.epoch = 0  # bumps on every change of any slice
        self.groups: IslandGroups | None = None  # set by the composition root (core.py)
        # how long a computation on a slice spanning hosts waits for its island's group (--group-wait)
        self.group_wait_s = DEFAULT_GROUP_WAIT_S
        self._meta: dict[str, _Meta] = {}
        # slice name -> (epoch, placement) of its last placement (`current`), and its holders
        self._kept: dict[str, tuple[int, Placement]] = {}
        self._kept_holders: dict[str, tuple[int, Holders]] = {}
        # device id -> (host name, local index); kept for retired devices too, for display.
        self._local: dict[int, tuple[str, int]] = {}

    # ------------------------------------------------------------------------------------ start

    def load(self) -> None:
        """Rebuild the resource manager from the database, before any host event can arrive.

        Devices are taken as the database left them: healthy when available on a ready host. Hosts
        that do not come back are marked lost by the cluster monitor, which remaps their slices.
        """
        devices: list[tuple[rm.PhysicalDevice, bool]] = []
        slices: list[rm.Slice] = []
        with self._db() as s:
            query = select(DeviceRow).options(selectinload(DeviceRow.host).selectinload(HostRow.island))
            for d in s.scalars(query):
                pd = rm.PhysicalDevice(id=d.id, island=d.host.island.name, host=d.host.name, kind=d.kind)
                devices.append((pd, d.state == "available" and d.host.state == READY))
                self._local[d.id] = (d.host.name, d.local_index)
            rows = s.scalars(
                select(SliceRow)
                .options(selectinload(SliceRow.mapping), selectinload(SliceRow.remaps))
                .order_by(SliceRow.id)
            )
            for row in rows:
                slices.append(slice_of(row))
                self._meta[row.name] = _Meta(row.created_at, [r.at for r in row.remaps])
            seq = auto_seq(s)
        actions = self.rm.restore(devices, slices, auto_seq=seq)
        log.info("restored %d slices on %d devices", len(slices), len(devices))
        self._apply(actions)

    # ---------------------------------------------------------------------------- host events

    def host_up(self, info: HostInfo) -> None:
        for local, dev_id in enumerate(info.device_ids):
            self._local[dev_id] = (info.name, local)
        devices = tuple(rm.PhysicalDevice(d, info.island, info.name, info.kind) for d in info.device_ids)
        self._handle_host_event(rm.HostUp(info.name, devices))

    def host_lost(self, info: HostInfo, reason: str) -> None:
        self._handle_host_event(rm.HostLost(info.name))

    def _handle_host_event(self, event: rm.HostUp | rm.HostLost) -> None:
        try:
            actions = self.rm.handle(event)
            for a in actions:
                if isinstance(a, rm.Rejected):
                    log.warning("resource manager refused %s: %s", type(event).__name__, a.message)
            self._apply(actions)
        except Exception:  # a listener must not break registration or loss handling
            log.exception("slice bookkeeping failed for %s", event)

    # ---------------------------------------------------------------------------- requests

    def create(self, spec: cpb.SliceSpec, dry_run: bool, owner: str) -> cpb.CreateSliceResponse:
        request = rm.SliceRequest(
            name=spec.name,
            devices=spec.devices,
            mesh=tuple(spec.mesh) if spec.mesh else None,
            island=spec.island or None,
            kind=spec.kind or None,
            exclusive=spec.exclusive,
            host_axis=spec.host_axis if spec.HasField("host_axis") else None,
        )
        actions = self._handle(rm.CreateSlice(request, owner=owner, dry_run=dry_run))
        first = actions[0]
        if isinstance(first, rm.PlacementPreview):
            preview = rm.Slice(name=first.name, request=replace(request, name=first.name), owner=owner,
                               mapping=first.mapping)
            proto = self._proto(preview, state=cpb.SLICE_STATE_UNSPECIFIED)
            return cpb.CreateSliceResponse(slice=proto, explanation=first.explanation)
        assert isinstance(first, rm.SliceCreated), first
        log.info("slice %s created on devices %s (%s)", first.slice.name, list(first.slice.mapping),
                 first.explanation)
        return cpb.CreateSliceResponse(slice=self._proto(first.slice), explanation=first.explanation)

    def list(self, owner: str = "") -> list[cpb.Slice]:
        counts = self.program_counts()
        return [self._proto(s, programs=counts.get(s.name, 0)) for s in self.rm.slices.values()
                if not owner or s.owner == owner]

    def get(self, name: str) -> cpb.Slice:
        full = self.resolve(name)
        return self._proto(self.rm.slices[full], programs=self.program_counts().get(full, 0))

    def resolve(self, name: str) -> str:
        """The full name of the slice `name` names exactly or as a unique prefix."""
        if name in self.rm.slices:
            return name
        matches = [n for n in self.rm.slices if name and n.startswith(name)]
        if len(matches) == 1:
            return matches[0]
        if matches:
            several = ", ".join(matches)
            raise InvalidArgument(f"{name!r} matches several slices ({several}); give more of the name")
        raise NotFound(f"no slice named {name!r} (see `pwctl slice list`)")

    def delete(self, name: str, force: bool = False) -> None:
        full = self.resolve(name)
        in_use = self._in_use(full)
        self._handle(rm.DeleteSlice(full, force=force, in_use=in_use))
        log.info("slice %s deleted%s", full, " (forced)" if force and in_use else "")

    def release_owner(self, owner: str) -> None:
        """Delete every slice a client or job owned (it disconnected or finished)."""
        self._handle(rm.ReleaseOwner(owner))

    def release_clients(self, keep: Iterable[str] = ()) -> builtins.list[str]:
        """At start: the slices of clients whose sessions did not survive the restart go (those
        of `keep`, sessions that may resume, stay); returns those clients (their buffers on the
        workers go too: core.py). Job-owned slices are the job manager's to judge."""
        kept = set(keep)
        owners = sorted({s.owner for s in self.rm.slices.values() if s.owner.startswith("client:")} - kept)
        for owner in owners:
            self.release_owner(owner)
        if owners:
            log.info("released the slices of %d client(s) of the previous controller", len(owners))
        return owners

    async def written(self) -> None:
        """Returns once every change made so far is in the database (writes run in order);
        raises what the last write raised. Requests await it before they answer."""
        if self._last_write is not None:
            await asyncio.wrap_future(self._last_write)

    # ---------------------------------------------------------------------------- queries

    def slice_count(self) -> int:
        return len(self.rm.slices)

    def device_slice_count(self, device_id: int) -> int:
        return self.rm.device_load(device_id)

    def placement(self, name: str) -> Placement:
        """Where slice `name` runs now; raises NotFound or Rejected (degraded, or spans hosts)."""
        s = self.rm.slices.get(name)
        if s is None:
            raise NotFound(f"slice {name!r} does not exist (deleted?)")
        if s.status is rm.SliceStatus.DEGRADED:
            raise Rejected(f"slice {name!r} is degraded: {s.reason}")
        devices = [self.rm.devices[d] for d in s.mapping]
        hosts = sorted({d.host for d in devices})
        if len(hosts) != 1:
            return self._gang_placement(name, s, devices[0].island, hosts)
        host = self._hosts.get(hosts[0])
        if host is None:  # pragma: no cover - the resource manager only knows registered hosts
            raise Rejected(f"slice {name!r} is on host {hosts[0]}, which is not registered")
        index = {dev: local for local, dev in enumerate(host.device_ids)}
        return Placement(
            slice=name,
            host=host,
            local_devices=[index[d] for d in s.mapping],
            generation=s.generation,
            island=devices[0].island,
        )

    def current(self, name: str) -> Placement:
        """`placement(name)`, without building it again while nothing it depends on changed (the
        IFRT proxy asks on every execute): the slices (`epoch` bumps on every change of one, and on
        an island group's) and the registered host records it names (a host registering again is
        a new record in the cluster's hosts: a record's address and devices never change in place),
        so the last answer stands while the epoch is the same and its hosts are still the
        registered records. Placements are frozen and their lists only read."""
        known = self._kept.get(name)
        if known is not None:
            epoch, kept = known
            if self._still(epoch, kept.gang.members if kept.gang is not None else (kept.host,)):
                return kept
        placed = self.placement(name)  # NotFound, Rejected: nothing kept
        self._kept[name] = (self.epoch, placed)
        self._kept = self._pruned(self._kept)
        return placed

    def _still(self, epoch: int, hosts: Iterable[HostInfo]) -> bool:
        """Whether an answer kept at `epoch` naming the host records `hosts` stands (`current`)."""
        return epoch == self.epoch and all(self._hosts.get(h.name) is h for h in hosts)

    def _pruned(self, kept: dict[str, T]) -> dict[str, T]:
        """`kept` without deleted slices' entries, once they may outnumber the others."""
        if len(kept) > 2 * len(self.rm.slices) + 64:
            return {n: v for n, v in kept.items() if n in self.rm.slices}
        return kept

    def holders(self, name: str) -> Holders:
        """Which registered worker holds each virtual device of slice `name` now, whether or not
        its island's group is formed (holders.py: what uploads need); kept like `current`. Raises
        NotFound, or Rejected (degraded, or on a host not registered)."""
        known = self._kept_holders.get(name)
        if known is not None and self._still(known[0], known[1].hosts):
            return known[1]
        s = self.rm.slices.get(name)
        if s is None:
            raise NotFound(f"slice {name!r} does not exist (deleted?)")
        if s.status is rm.SliceStatus.DEGRADED:
            raise Rejected(f"slice {name!r} is degraded: {s.reason}")
        made = slice_holders(name, s.mapping, s.generation, lambda d: self.rm.devices[d].host, self._hosts)
        if isinstance(made, str):  # pragma: no cover - the resource manager only knows registered hosts
            raise Rejected(made)
        self._kept_holders[name] = (self.epoch, made)
        self._kept_holders = self._pruned(self._kept_holders)
        return made

    async def settled(self, name: str, timeout: float | None = None) -> Placement:
        """`current(name)`, waiting up to `timeout` seconds (None: `group_wait_s`, the controller's
        --group-wait) while slice `name` spans hosts whose island group is not usable with them
        (forming at start, after a host joined or was lost, after a remap); then raises what
        `current` raises (GroupForming saying how long it waited)."""
        timeout = self.group_wait_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.current(name)
            except GroupForming as e:
                s = self.rm.slices.get(name)
                left = deadline - time.monotonic()
                if left <= 0 and timeout > 0:
                    raise GroupForming(f"{e}; waited {timeout:g} s for it", name) from None
                if (s is None or s.status is rm.SliceStatus.DEGRADED or self.groups is None or left <= 0
                        or len({self.rm.devices[d].host for d in s.mapping}) < 2):
                    raise
                island = self.rm.devices[s.mapping[0]].island
            if self.groups.usable(island) is None:
                await self.groups.wait_usable(island, left)
            else:  # usable, but not with this slice's hosts yet: the next generation is due
                await asyncio.sleep(min(left, 0.05))

    def _gang_placement(self, name: str, s: rm.Slice, island: str, hosts: builtins.list[str]) -> Placement:
        """A slice over several hosts: one SPMD computation over the island's group (groups.py)."""
        g = self.groups.usable(island) if self.groups is not None else None
        if g is None or not set(hosts) <= set(g.members):
            if self.groups is not None:
                self.groups.want(island)
            why = self.groups.describe(island) if self.groups is not None else "no island groups here"
            raise GroupForming(f"slice {name} spans hosts {', '.join(hosts)}: {why}", name)
        # one pass over the devices (the dispatcher asks again after any host or slice event, and
        # an island of 512 hosts has 2,048 devices: nothing here per member per device)
        spans = set(hosts)
        members = tuple(self._hosts[h] for h in g.members if h in spans)
        process = {h: p for p, h in enumerate(g.members)}
        by_member: dict[str, builtins.list[int]] = {m.name: [] for m in members}
        position = {m.name: k for k, m in enumerate(members)}
        numbers = []
        member_of = []
        for dev_id in s.mapping:
            host_name, local = self._local[dev_id]
            numbers.append(process[host_name] * GROUP_STRIDE + local)
            by_member[host_name].append(dev_id)
            member_of.append(position[host_name])
        member_devices = tuple(tuple(by_member[m.name]) for m in members)
        gang = Gang(g.number, members, tuple(numbers), member_devices, tuple(member_of))
        return Placement(slice=name, host=members[0], local_devices=numbers, generation=s.generation,
                         island=island, gang=gang)

    def group_changed(self, island: str) -> None:
        """The island's group became usable or went: placements of its multi-host slices change."""
        self.epoch += 1

    # ---------------------------------------------------------------------------- internals

    def _handle(self, event: rm.Event) -> builtins.list[rm.Action]:
        """Apply a request event; raise the mapped error if refused, else persist and notify."""
        actions = self.rm.handle(event)
        for a in actions:
            if isinstance(a, rm.Rejected):
                raise _ERRORS[a.code](a.message)
        self._apply(actions)
        return actions

    def _apply(self, actions: Iterable[rm.Action]) -> Future[None] | None:
        """Queue every change as one write, then tell clients about changed slices.

        The resource manager's state is the truth; the write (whose future this returns, None
        when nothing changed) makes the database its copy. Writes run in the order they were
        queued, so a slice created then deleted is never written the other way round.
        """
        todo: builtins.list[_Change] = [
            a for a in actions if not isinstance(a, rm.Rejected | rm.PlacementPreview)
        ]
        if not todo:
            return None
        self.epoch += 1  # the dispatcher's cached placements are stale now
        now = utcnow()
        ops: builtins.list[RowOp] = []
        changed: builtins.list[rm.Slice] = []
        for a in todo:
            if isinstance(a, rm.SliceDeleted):
                self._meta.pop(a.name, None)
                ops.append((a.name, None, now, ()))
                continue
            meta = self._meta.get(a.slice.name)
            if meta is None:
                meta = self._meta[a.slice.name] = _Meta(now, [])
            meta.remap_at.extend(now for _ in range(len(a.slice.history) - len(meta.remap_at)))
            ops.append((a.slice.name, a.slice, meta.created_at, tuple(meta.remap_at)))
            if not isinstance(a, rm.SliceCreated):
                changed.append(a.slice)
        done = self._last_write = self._write(lambda s: write_rows(s, ops))
        if self.groups is not None:
            for a in todo:
                sl = getattr(a, "slice", None)
                if sl is not None and len({self._local.get(d, ("", 0))[0] for d in sl.mapping}) > 1:
                    self.groups.want(self.rm.devices[sl.mapping[0]].island)
        for a in todo:
            if isinstance(a, rm.SliceRemapped):
                log.warning("slice %s remapped %s -> %s: %s",
                            a.slice.name, list(a.old), list(a.slice.mapping), a.reason)
            elif isinstance(a, rm.SliceDegraded):
                log.warning("slice %s degraded: %s", a.slice.name, a.reason)
            elif isinstance(a, rm.SliceRestored):
                log.info("slice %s restored on devices %s", a.slice.name, list(a.slice.mapping))
        for sl in changed:
            proto = self._proto(sl)
            for notify in self.listeners:
                try:
                    notify(proto)
                except Exception:
                    log.exception("slice_changed notification failed for %s", sl.name)
        return done

    def _proto(self, sl: rm.Slice, state: cpb.SliceState.ValueType | None = None, programs: int = 0) -> cpb.Slice:
        req = sl.request
        meta = self._meta.get(sl.name)
        devices = []
        for i, dev_id in enumerate(sl.mapping):
            dev = self.rm.devices.get(dev_id)
            host_name, local = self._local.get(dev_id, (dev.host if dev else "", -1))
            host = self._hosts.get(host_name)
            devices.append(
                cpb.VirtualDevice(
                    index=i,
                    device_id=dev_id,
                    island=dev.island if dev else "",
                    host=host_name,
                    address=host.address if host else "",
                    local_index=local,
                    kind=dev.kind if dev else "",
                )
            )
        history = [
            cpb.Remap(
                at=iso(meta.remap_at[i]) if meta and i < len(meta.remap_at) else "",
                reason=rec.reason,
                old_devices=list(rec.old),
                new_devices=list(rec.new),
            )
            for i, rec in enumerate(sl.history)
        ]
        return cpb.Slice(
            name=sl.name,
            spec=cpb.SliceSpec(
                name=sl.name,
                devices=req.devices,
                mesh=list(req.mesh) if req.mesh is not None else [],
                island=req.island or "",
                kind=req.kind or "",
                exclusive=req.exclusive,
                host_axis=req.host_axis,
            ),
            state=_STATE[sl.status] if state is None else state,
            reason=sl.reason,
            devices=devices,
            owner=sl.owner,
            created_at=iso(meta.created_at) if meta else "",
            history=history,
            generation=sl.generation,
            programs=programs,
        )
