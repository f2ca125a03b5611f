"""The resource manager's state, its read-only views and its invariants (`validate`)."""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from server.invariants import InvariantError, StimulusLog, validation_enabled
from server.resource_manager.models import (
    KINDS,
    NAME_RE,
    OWNER_RE,
    PhysicalDevice,
    Slice,
    SliceRequest,
    SliceStatus,
    _fmt_ids,
)


@dataclass
class RMState:
    """The devices and slices the resource manager owns, with the bookkeeping derived from them.

    Invariants (checked by `validate`, after every stimulus when `debug`, which defaults to
    `PATHWAYS_VALIDATE`):
    - every non-degraded slice maps `request.devices` distinct, existing, healthy devices, all on
      one island that matches the request's island and kind filters;
    - `_load` / `_exclusive` equal what the non-degraded slices imply; a device held by an
      exclusive slice is mapped by no other non-degraded slice;
    - degraded slices have a reason and hold nothing.
    """

    debug: bool = field(default_factory=validation_enabled)
    _devices: dict[int, PhysicalDevice] = field(default_factory=dict)
    _healthy: set[int] = field(default_factory=set)
    _hosts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _slices: dict[str, Slice] = field(default_factory=dict)  # creation order
    # the highest N of every "slice-N" this manager has held: an automatic name never comes back
    # again, so a stale reference to a deleted slice cannot reach a new slice of the same name.
    # The database keeps it (the `counters` table, server/controller/slice_rows.py) and `restore`
    # takes it back; not compared, since the database view rebuilds only the compared fields
    _auto_seq: int = field(default=0, compare=False)
    _load: dict[int, int] = field(default_factory=dict)  # only devices with load > 0
    _exclusive: dict[int, str] = field(default_factory=dict)  # device id -> exclusive slice name
    # island -> kind -> devices of that kind (one kind per island): derived from `_devices`, so
    # that a host's registration checks its islands without visiting the other hosts' devices
    _island_kinds: dict[str, dict[str, int]] = field(default_factory=dict)
    # island -> ids of the devices whose record names it, sorted (placement reads one island's)
    _island_devices: dict[str, list[int]] = field(default_factory=dict)
    # the recent stimuli, for the history an InvariantError carries (not part of the state proper)
    _log: StimulusLog = field(default_factory=StimulusLog, compare=False, repr=False)

    @property
    def slices(self) -> Mapping[str, Slice]:
        """Slices by name, in creation order (a read-only view; slices are immutable)."""
        return MappingProxyType(self._slices)

    @property
    def devices(self) -> Mapping[int, PhysicalDevice]:
        """Every device ever seen, healthy or not, by id."""
        return MappingProxyType(self._devices)

    @property
    def hosts(self) -> Mapping[str, tuple[int, ...]]:
        """Host -> ids of the devices whose record names it (retired ones included, unhealthy)."""
        return MappingProxyType(self._hosts)

    def is_healthy(self, device_id: int) -> bool:
        return device_id in self._healthy

    def device_load(self, device_id: int) -> int:
        """Number of placed (non-degraded) slices mapped to the device."""
        return self._load.get(device_id, 0)

    def exclusive_holder(self, device_id: int) -> str | None:
        """Name of the exclusive slice holding the device, if any."""
        return self._exclusive.get(device_id)

    def islands(self) -> dict[str, str]:
        """Island name -> device kind, for every island ever seen."""
        return {i: k for i, kinds in self._island_kinds.items() for k, n in kinds.items() if n}

    def _set_device(self, d: PhysicalDevice) -> None:
        """Records (or replaces) a device record, keeping `_island_kinds` in step."""
        prev = self._devices.get(d.id)
        if prev is not None:
            self._island_kinds[prev.island][prev.kind] -= 1
            if prev.island != d.island:
                ids = self._island_devices[prev.island]
                del ids[bisect_left(ids, d.id)]
        if prev is None or prev.island != d.island:
            insort(self._island_devices.setdefault(d.island, []), d.id)
        kinds = self._island_kinds.setdefault(d.island, {})
        kinds[d.kind] = kinds.get(d.kind, 0) + 1
        self._devices[d.id] = d

    # ---------------------------------------------------------------------------------- handling
    # ------------------------------------------------------------------------------- validation

    def _check_request(self, req: SliceRequest) -> str | None:
        """Why the request is malformed or names things that never existed, or None."""
        if req.name and not NAME_RE.fullmatch(req.name):
            return (
                f"invalid slice name {req.name!r}: use lowercase letters, digits and '-', "
                "start with a letter, at most 63 characters"
            )
        if req.devices <= 0:
            return f"devices must be positive, got {req.devices}"
        if req.mesh is not None:
            if not req.mesh or any(d <= 0 for d in req.mesh):
                return f"mesh {req.mesh} must have at least one dimension, all positive"
            if math.prod(req.mesh) != req.devices:
                return f"mesh {req.mesh} has {math.prod(req.mesh)} devices, but {req.devices} were requested"
        if req.host_axis is not None:
            if req.mesh is None:
                return "a host axis needs a mesh (e.g. --mesh 2x4 --host-axis 0)"
            if not 0 <= req.host_axis < len(req.mesh):
                return f"host axis {req.host_axis} is not an axis of mesh {'x'.join(map(str, req.mesh))}"
        if req.kind is not None and req.kind not in KINDS:
            return f"unknown device kind {req.kind!r}; expected cpu or gpu"
        islands = self.islands()
        if req.island is not None and req.island not in islands:
            known = ", ".join(sorted(islands)) or "none"
            return f"unknown island {req.island!r}; known islands: {known}"
        if req.kind is not None:
            if req.island is not None and islands[req.island] != req.kind:
                return f"island {req.island} has no {req.kind} devices (it holds {islands[req.island]})"
            if req.kind not in islands.values():
                return f"the cluster has no {req.kind} devices"
        return None

    @staticmethod
    def _check_owner(owner: str) -> str | None:
        if owner and not OWNER_RE.fullmatch(owner):
            return f"invalid owner {owner!r}: expected '', 'client:<id>' or 'job:<id>'"
        return None

    def _slice_problems(self, s: Slice) -> list[str]:
        """Shape problems of a slice that hold whatever its status (health is checked elsewhere)."""
        problems: list[str] = []
        if s.request.name != s.name or not NAME_RE.fullmatch(s.name):
            problems.append(f"slice {s.name!r}: bad name (request says {s.request.name!r})")
        req_problem = self._check_request(replace(s.request, name=s.name))
        if req_problem:
            problems.append(f"slice {s.name}: {req_problem}")
        if self._check_owner(s.owner):
            problems.append(f"slice {s.name}: bad owner {s.owner!r}")
        if len(set(s.mapping)) != len(s.mapping):
            problems.append(f"slice {s.name}: duplicate devices in {_fmt_ids(s.mapping)}")
        missing = [d for d in s.mapping if d not in self._devices]
        if missing:
            problems.append(f"slice {s.name}: unknown devices {_fmt_ids(missing)}")
            return problems
        if s.status is SliceStatus.DEGRADED:
            if not s.reason:
                problems.append(f"slice {s.name}: degraded without a reason")
            return problems
        if len(s.mapping) != s.request.devices:
            problems.append(f"slice {s.name}: maps {len(s.mapping)} devices, requested {s.request.devices}")
        islands = {self._devices[d].island for d in s.mapping}
        kinds = {self._devices[d].kind for d in s.mapping}
        if len(islands) > 1:
            problems.append(f"slice {s.name}: spans islands {sorted(islands)}")
        if s.request.island is not None and islands - {s.request.island}:
            problems.append(f"slice {s.name}: not on requested island {s.request.island}")
        if s.request.kind is not None and kinds - {s.request.kind}:
            problems.append(f"slice {s.name}: not of requested kind {s.request.kind}")
        if s.status is SliceStatus.READY and s.reason:
            problems.append(f"slice {s.name}: ready with a reason")
        if len(s.history) > s.generation:
            problems.append(f"slice {s.name}: {len(s.history)} remaps but generation {s.generation}")
        return problems

    def validate(self) -> None:
        """Raise `InvariantError` (carrying the recent stimuli) if an invariant is broken."""
        problem = self._first_problem()
        if problem is not None:
            raise InvariantError(problem, self._log.recent())

    def _first_problem(self) -> str | None:
        for name, s in self._slices.items():
            if name != s.name:
                return f"slice stored under {name!r} is named {s.name!r}"
            problems = self._slice_problems(s)
            if problems:
                return "; ".join(problems)
            if s.status is not SliceStatus.DEGRADED:
                sick = [d for d in s.mapping if d not in self._healthy]
                if sick:
                    return f"slice {name}: unhealthy devices {_fmt_ids(sick)}"
        load: dict[int, int] = {}
        exclusive: dict[int, str] = {}
        for s in self._placed():
            for d in s.mapping:
                load[d] = load.get(d, 0) + 1
                if s.request.exclusive:
                    exclusive[d] = s.name
        if load != self._load:
            return f"load {self._load} != recomputed {load}"
        if exclusive != self._exclusive:
            return f"exclusive {self._exclusive} != recomputed {exclusive}"
        for d, holder in exclusive.items():
            if load[d] != 1:
                return f"device {d} held exclusively by {holder} but used by {load[d]} slices"
        if not self._healthy <= self._devices.keys():
            return "healthy devices that do not exist"
        seen: dict[int, str] = {}
        for host, ids in self._hosts.items():
            for i in ids:
                if i in seen:
                    return f"device {i} on hosts {seen[i]} and {host}"
                seen[i] = host
                if self._devices[i].host != host:
                    return f"device {i} listed on {host} but names another host"
        if seen.keys() != self._devices.keys():
            return "a device record is not listed under its host"
        counted: dict[str, dict[str, int]] = {}
        for dev in self._devices.values():
            per = counted.setdefault(dev.island, {})
            per[dev.kind] = per.get(dev.kind, 0) + 1
        kept = {i: {k: n for k, n in ks.items() if n} for i, ks in self._island_kinds.items()}
        if counted != {i: ks for i, ks in kept.items() if ks}:
            return f"island kinds {self._island_kinds} != recomputed {counted}"
        by_island: dict[str, list[int]] = {}
        for dev in sorted(self._devices.values(), key=lambda d: d.id):
            by_island.setdefault(dev.island, []).append(dev.id)
        if by_island != {i: ids for i, ids in self._island_devices.items() if ids}:
            return "the per-island device index differs from the device records"
        for island, kinds in counted.items():
            if len(kinds) != 1:
                return f"island {island} mixes kinds {sorted(kinds)}"
        return None

    def _placed(self) -> Iterable[Slice]:
        return (s for s in self._slices.values() if s.status is not SliceStatus.DEGRADED)
