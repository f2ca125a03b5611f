"""The resource manager's stimulus handling: `handle(event) -> actions` and `restore`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from itertools import chain

from server.resource_manager.models import (
    KINDS,
    Action,
    CreateSlice,
    DeleteSlice,
    Event,
    HostLost,
    HostUp,
    PhysicalDevice,
    PlacementPreview,
    RejectCode,
    Rejected,
    ReleaseOwner,
    Slice,
    SliceCreated,
    SliceDeleted,
    SliceStatus,
    _fmt_ids,
    _Unplaceable,
)
from server.resource_manager.remap import Remapper


class ResourceManager(Remapper):
    """Owns devices and slices; `handle(event)` returns the actions the controller must carry out.

    Every stimulus (event or restore) is recorded in a bounded log; with `debug` (default:
    `PATHWAYS_VALIDATE`) the state is validated after each, and an `InvariantError` carries the log.
    """

    def handle(self, event: Event) -> list[Action]:
        """Apply one event; a `Rejected` action means nothing changed."""
        self._log.record(describe(event))
        actions: list[Action]
        if isinstance(event, HostUp):
            actions = self._host_up(event)
        elif isinstance(event, HostLost):
            actions = self._host_lost(event)
        elif isinstance(event, CreateSlice):
            actions = self._create(event)
        elif isinstance(event, DeleteSlice):
            actions = self._delete(event)
        elif isinstance(event, ReleaseOwner):
            actions = self._release(event)
        else:  # pragma: no cover - guarded by the type checker
            raise TypeError(f"unknown event {event!r}")
        if self.debug:
            self.validate()
        return actions

    def _host_up(self, ev: HostUp) -> list[Action]:
        if not ev.host:
            return [Rejected(RejectCode.INVALID, "host name must not be empty")]
        ids = [d.id for d in ev.devices]
        if len(set(ids)) != len(ids):
            return [Rejected(RejectCode.INVALID, f"host {ev.host} lists a device id twice: {_fmt_ids(ids)}")]
        # Only the registering host's devices are visited: the per-island kind counts stand for
        # the rest of the cluster (costs linear in what changed, issue 31).
        for d in ev.devices:
            if d.host != ev.host:
                return [Rejected(RejectCode.INVALID, f"device {d.id} names host {d.host!r}, not {ev.host!r}")]
            if d.kind not in KINDS:
                message = f"device {d.id} has unknown kind {d.kind!r}; expected cpu or gpu"
                return [Rejected(RejectCode.INVALID, message)]
            if not d.island:
                return [Rejected(RejectCode.INVALID, f"device {d.id} has no island")]
            # A device may move to another host only while unhealthy where it was.
            known = self._devices.get(d.id)
            if known is not None and known.host != ev.host and d.id in self._healthy:
                return [Rejected(RejectCode.INVALID, f"device {d.id} already belongs to host {known.host}")]
        # Islands are homogeneous: collectives run between devices of one kind.
        new = {d.id: d for d in ev.devices}
        kinds = {i: dict(self._island_kinds.get(i, {})) for i in {d.island for d in ev.devices}}
        for i, d in new.items():
            known = self._devices.get(i)
            if known is not None and known.island in kinds:
                kinds[known.island][known.kind] -= 1
            kinds[d.island][d.kind] = kinds[d.island].get(d.kind, 0) + 1
        for d in ev.devices:
            if any(n for k, n in kinds[d.island].items() if k != d.kind):
                merged = chain((new.get(m.id, m) for m in self._devices.values()),
                               (n for i, n in new.items() if i not in self._devices))
                clash = next(m for m in merged if m.island == d.island and m.kind != d.kind)
                return [
                    Rejected(
                        RejectCode.INVALID,
                        f"island {d.island} holds {clash.kind} devices (device {clash.id}); "
                        f"device {d.id} of host {ev.host} is {d.kind}",
                    )
                ]

        # Devices that left the host, or changed island or kind, count as lost for the slices on them.
        old_ids = self._hosts.get(ev.host, ())
        changed = any(i not in new or self._devices[i] != new[i] for i in old_ids) or any(
            i in self._devices and self._devices[i] != d for i, d in new.items()
        )
        for i in old_ids:
            if i not in new:
                self._healthy.discard(i)
        for i, d in new.items():
            prev = self._devices.get(i)
            if prev is not None and prev.host != ev.host:
                self._hosts[prev.host] = tuple(x for x in self._hosts[prev.host] if x != i)
            self._set_device(d)
            self._healthy.add(i)
        self._hosts[ev.host] = tuple(sorted({*old_ids, *new}))
        actions: list[Action] = []
        if changed:
            actions += self._repair(f"host {ev.host} re-registered with different devices")
        actions += self._retry_degraded(f"host {ev.host} up", skip=self._degraded_names(actions))
        return actions

    def _host_lost(self, ev: HostLost) -> list[Action]:
        if ev.host not in self._hosts:
            return [Rejected(RejectCode.NOT_FOUND, f"no host named {ev.host!r}")]
        for i in self._hosts[ev.host]:
            self._healthy.discard(i)
        cause = f"host {ev.host} lost"
        actions = self._repair(cause)
        # A degraded exclusive slice frees its healthy devices; older degraded slices may fit now.
        actions += self._retry_degraded(cause, skip=self._degraded_names(actions))
        return actions

    def _create(self, ev: CreateSlice) -> list[Action]:
        req = ev.request
        problem = self._check_request(req) or self._check_owner(ev.owner)
        if problem:
            return [Rejected(RejectCode.INVALID, problem)]
        if req.name in self._slices:
            return [Rejected(RejectCode.CONFLICT, f"a slice named {req.name!r} already exists")]
        name = req.name or self._next_auto_name()
        req = replace(req, name=name)
        placed = self._place(req, prefer=None)
        if isinstance(placed, _Unplaceable):
            return [Rejected(RejectCode.CAPACITY, placed.reason)]
        if ev.dry_run:
            return [PlacementPreview(name, placed.mapping, placed.explanation)]
        s = Slice(name=name, request=req, owner=ev.owner, mapping=placed.mapping)
        self._slices[name] = s
        self._held_name(name)
        self._attach(s)
        return [SliceCreated(s, placed.explanation)]

    def _delete(self, ev: DeleteSlice) -> list[Action]:
        s = self._slices.get(ev.name)
        if s is None:
            return [Rejected(RejectCode.NOT_FOUND, f"no slice named {ev.name!r}")]
        if ev.in_use and not ev.force:
            message = f"slice {ev.name} is in use ({ev.in_use}); force to delete it anyway"
            return [Rejected(RejectCode.IN_USE, message)]
        self._remove(s)
        return [SliceDeleted(ev.name), *self._retry_degraded(f"slice {ev.name} deleted")]

    def _release(self, ev: ReleaseOwner) -> list[Action]:
        problem = self._check_owner(ev.owner)
        if problem or not ev.owner:
            return [Rejected(RejectCode.INVALID, problem or "owner must not be empty")]
        actions: list[Action] = []
        for s in [s for s in self._slices.values() if s.owner == ev.owner]:
            self._remove(s)
            actions.append(SliceDeleted(s.name))
        if actions:
            actions += self._retry_degraded(f"{ev.owner} released its slices")
        return actions

    # ---------------------------------------------------------------------------------- restore

    def restore(
        self, devices: Iterable[tuple[PhysicalDevice, bool]], slices: Iterable[Slice], auto_seq: int = 0
    ) -> list[Action]:
        """Replace all state with what the database holds: (device, healthy) pairs and slices,
        and `auto_seq`, the highest automatic name "slice-N" ever given (deleted slices included).

        Slices are taken in creation order. Raises ValueError (state unchanged) on inconsistent
        input. Placed slices on unhealthy devices are then repaired as after a host loss, and the
        resulting actions returned, so a controller that marks every device unhealthy until its
        host re-registers will see slices degrade and come back; one that trusts the database
        passes healthy=True and sends HostLost for hosts that do not return.
        """
        device_list, slice_list = list(devices), list(slices)
        self._log.record(f"restore {len(device_list)} devices, {len(slice_list)} slices")
        saved = dict(vars(self))
        fresh = ResourceManager(debug=self.debug, _log=self._log)
        vars(self).update(vars(fresh))
        try:
            self._restore(device_list, slice_list)
            self._auto_seq = max(self._auto_seq, auto_seq)
        except ValueError:
            vars(self).update(saved)
            raise
        actions = self._repair("device unhealthy at controller restart")
        if self.debug:
            self.validate()
        return actions

    def _restore(self, devices: list[tuple[PhysicalDevice, bool]], slices: list[Slice]) -> None:
        hosts: dict[str, list[int]] = {}
        kinds: dict[str, str] = {}
        for d, healthy in devices:
            if d.id in self._devices:
                raise ValueError(f"device {d.id} restored twice")
            if d.kind not in KINDS or not d.island or not d.host:
                raise ValueError(f"bad device record {d}")
            if kinds.setdefault(d.island, d.kind) != d.kind:
                raise ValueError(f"island {d.island} mixes {kinds[d.island]} and {d.kind} devices")
            self._set_device(d)
            hosts.setdefault(d.host, []).append(d.id)
            if healthy:
                self._healthy.add(d.id)
        self._hosts = {h: tuple(sorted(ids)) for h, ids in hosts.items()}
        for s in slices:
            if s.name in self._slices:
                raise ValueError(f"slice {s.name} restored twice")
            problems = self._slice_problems(s)
            if problems:
                raise ValueError("; ".join(problems))
            if s.status is not SliceStatus.DEGRADED:
                clash = [d for d in s.mapping if not self._usable(d, s.request.exclusive)]
                if clash:
                    raise ValueError(f"slice {s.name} shares devices {_fmt_ids(clash)} held exclusively")
                self._attach(s)
            self._slices[s.name] = s
            self._held_name(s.name)


def describe(event: Event) -> str:
    """One line for the stimulus log."""
    if isinstance(event, HostUp):
        return f"HostUp {event.host} devices {_fmt_ids(d.id for d in event.devices)}"
    if isinstance(event, HostLost):
        return f"HostLost {event.host}"
    if isinstance(event, CreateSlice):
        r = event.request
        where = "".join(f" {k}={v}" for k, v in (("island", r.island), ("kind", r.kind)) if v is not None)
        flags = " exclusive" * r.exclusive + " dry-run" * event.dry_run
        return f"CreateSlice {r.name or '(auto)'} devices={r.devices}{where}{flags} owner={event.owner!r}"
    if isinstance(event, DeleteSlice):
        busy = f" in_use={event.in_use!r}" if event.in_use else ""
        return f"DeleteSlice {event.name}" + " force" * event.force + busy
    return f"ReleaseOwner {event.owner}"
