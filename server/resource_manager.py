"""The resource manager: a pure, synchronous state machine mapping virtual slices onto physical devices.

Events go in through `ResourceManager.handle`, actions come out; the controller turns actions into
database writes and replies. No I/O happens here (style of Dask distributed's worker state machine).

Model:
- Devices belong to hosts and islands; every island holds one kind of device ("cpu" or "gpu").
  Device records are kept forever (a lost host's devices stay known, unhealthy), so islands and
  kinds once seen stay valid filters.
- Slices are virtual: by default several slices may share a physical device (time-multiplexing).
  The load of a device is the number of placed (non-degraded) slices mapped to it. An exclusive
  slice needs devices of load 0, and a device it holds can be used by no other slice.
- A slice always lies inside one island. Placement takes, per island, the n least-loaded usable
  devices (ties by id); among islands that fit it prefers the least total load of those devices,
  then the most idle (load-0) usable devices, then the island name.
- A degraded slice keeps its last mapping for display but holds no devices: it adds no load and
  reserves nothing. It is tried again whenever capacity may have returned (a host came up, a slice
  was deleted, a host loss degraded an exclusive slice).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType

KINDS: frozenset[str] = frozenset({"cpu", "gpu"})
NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,62}")
OWNER_RE = re.compile(r"(client|job):\S+")


# ---------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class PhysicalDevice:
    """One accelerator. `id` is unique in the cluster; `kind` is "cpu" or "gpu"."""

    id: int
    island: str
    host: str
    kind: str


@dataclass(frozen=True)
class SliceRequest:
    """What a client asks for. `mesh`, when given, has product == `devices`.

    An empty `name` lets the manager choose one; the stored request carries the chosen name.
    """

    name: str
    devices: int
    mesh: tuple[int, ...] | None = None
    island: str | None = None
    kind: str | None = None
    exclusive: bool = False


class SliceStatus(StrEnum):
    READY = "ready"  # placed where it was first placed (or back there)
    REMAPPED = "remapped"  # placed, but moved at least once since creation
    DEGRADED = "degraded"  # cannot be placed; mapping is the last one it had, holds nothing


@dataclass(frozen=True)
class RemapRecord:
    old: tuple[int, ...]
    new: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class Slice:
    """A placed (or degraded) virtual slice; immutable, replaced on every change.

    `mapping[i]` is the physical device id of virtual device i. `generation` grows by one on every
    remap or restore so compiled functions know to re-lower. `owner` is "" for named CLI slices,
    "client:<id>" or "job:<id>" otherwise.
    """

    name: str
    request: SliceRequest
    owner: str
    mapping: tuple[int, ...]
    status: SliceStatus = SliceStatus.READY
    reason: str = ""
    history: tuple[RemapRecord, ...] = ()
    generation: int = 0


class RejectCode(StrEnum):
    INVALID = "invalid"  # bad input
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"  # duplicate name
    CAPACITY = "capacity"  # cannot place
    IN_USE = "in_use"


# -------------------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class HostUp:
    """A host registered or came back with these devices (all become healthy).

    Devices it had before but no longer lists are retired (unhealthy). Idempotent.
    """

    host: str
    devices: tuple[PhysicalDevice, ...]


@dataclass(frozen=True)
class HostLost:
    host: str


@dataclass(frozen=True)
class CreateSlice:
    request: SliceRequest
    owner: str = ""
    dry_run: bool = False


@dataclass(frozen=True)
class DeleteSlice:
    """`in_use` is the controller's reason the slice is busy; the delete is refused unless `force`."""

    name: str
    force: bool = False
    in_use: str | None = None


@dataclass(frozen=True)
class ReleaseOwner:
    """Delete every slice owned by a client or job (it disconnected or finished)."""

    owner: str


Event = HostUp | HostLost | CreateSlice | DeleteSlice | ReleaseOwner


# ------------------------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class SliceCreated:
    slice: Slice
    explanation: str


@dataclass(frozen=True)
class PlacementPreview:
    """Answer to a dry run: where the slice would go. Nothing changed."""

    name: str
    mapping: tuple[int, ...]
    explanation: str


@dataclass(frozen=True)
class Rejected:
    """The event was refused; state is unchanged."""

    code: RejectCode
    message: str


@dataclass(frozen=True)
class SliceDeleted:
    name: str


@dataclass(frozen=True)
class SliceRemapped:
    slice: Slice
    old: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class SliceDegraded:
    slice: Slice
    reason: str


@dataclass(frozen=True)
class SliceRestored:
    """A degraded slice was placed again (status READY if on its old mapping, else REMAPPED)."""

    slice: Slice


Action = (
    SliceCreated | PlacementPreview | Rejected | SliceDeleted | SliceRemapped | SliceDegraded | SliceRestored
)


@dataclass(frozen=True)
class _Placement:
    mapping: tuple[int, ...]
    explanation: str


@dataclass(frozen=True)
class _Unplaceable:
    reason: str


@dataclass(frozen=True)
class _Option:
    """One island that fits a request, with the sort key that ranks it."""

    island: str
    chosen: tuple[int, ...]
    total_load: int
    idle: int

    def key(self) -> tuple[int, int, str]:
        return (self.total_load, -self.idle, self.island)


def _fmt_ids(ids: Iterable[int]) -> str:
    return "[" + ", ".join(str(i) for i in ids) + "]"


# ------------------------------------------------------------------------------------------- manager


@dataclass
class ResourceManager:
    """Owns devices and slices; `handle(event)` returns the actions the controller must carry out.

    Invariants (checked by `validate`, after every `handle` when `debug`):
    - every non-degraded slice maps `request.devices` distinct, existing, healthy devices, all on
      one island that matches the request's island and kind filters;
    - `_load` / `_exclusive` equal what the non-degraded slices imply; a device held by an
      exclusive slice is mapped by no other non-degraded slice;
    - degraded slices have a reason and hold nothing.
    """

    debug: bool = False
    _devices: dict[int, PhysicalDevice] = field(default_factory=dict)
    _healthy: set[int] = field(default_factory=set)
    _hosts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _slices: dict[str, Slice] = field(default_factory=dict)  # creation order
    _load: dict[int, int] = field(default_factory=dict)  # only devices with load > 0
    _exclusive: dict[int, str] = field(default_factory=dict)  # device id -> exclusive slice name

    # ---------------------------------------------------------------------------- read-only views

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
        return {d.island: d.kind for d in self._devices.values()}

    # ---------------------------------------------------------------------------------- handling

    def handle(self, event: Event) -> list[Action]:
        """Apply one event; a `Rejected` action means nothing changed."""
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
        # A device may move to another host only while unhealthy where it was.
        others = {i: h for h, hids in self._hosts.items() if h != ev.host for i in hids if i in self._healthy}
        for d in ev.devices:
            if d.host != ev.host:
                return [Rejected(RejectCode.INVALID, f"device {d.id} names host {d.host!r}, not {ev.host!r}")]
            if d.kind not in KINDS:
                message = f"device {d.id} has unknown kind {d.kind!r}; expected cpu or gpu"
                return [Rejected(RejectCode.INVALID, message)]
            if not d.island:
                return [Rejected(RejectCode.INVALID, f"device {d.id} has no island")]
            if d.id in others:
                return [Rejected(RejectCode.INVALID, f"device {d.id} already belongs to host {others[d.id]}")]
        # Islands are homogeneous: collectives run between devices of one kind.
        merged = {**self._devices, **{d.id: d for d in ev.devices}}
        for d in ev.devices:
            clash = next((m for m in merged.values() if m.island == d.island and m.kind != d.kind), None)
            if clash is not None:
                return [
                    Rejected(
                        RejectCode.INVALID,
                        f"island {d.island} holds {clash.kind} devices (device {clash.id}); "
                        f"device {d.id} of host {ev.host} is {d.kind}",
                    )
                ]

        # Devices that left the host, or changed island or kind, count as lost for the slices on them.
        new = {d.id: d for d in ev.devices}
        old_ids = self._hosts.get(ev.host, ())
        changed = any(i not in new or self._devices[i] != new[i] for i in old_ids) or any(
            i in self._devices and self._devices[i] != d for i, d in new.items()
        )
        for i in old_ids:
            if i not in new:
                self._healthy.discard(i)
        for i, d in new.items():
            self._devices[i] = d
            self._healthy.add(i)
        for h, hids in list(self._hosts.items()):
            if h != ev.host and any(i in new for i in hids):
                self._hosts[h] = tuple(i for i in hids if i not in new)
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
        """Raise AssertionError if an invariant is broken."""
        for name, s in self._slices.items():
            assert name == s.name, f"slice stored under {name!r} is named {s.name!r}"
            problems = self._slice_problems(s)
            assert not problems, "; ".join(problems)
            if s.status is not SliceStatus.DEGRADED:
                sick = [d for d in s.mapping if d not in self._healthy]
                assert not sick, f"slice {name}: unhealthy devices {_fmt_ids(sick)}"
        load: dict[int, int] = {}
        exclusive: dict[int, str] = {}
        for s in self._placed():
            for d in s.mapping:
                load[d] = load.get(d, 0) + 1
                if s.request.exclusive:
                    exclusive[d] = s.name
        assert load == self._load, f"load {self._load} != recomputed {load}"
        assert exclusive == self._exclusive, f"exclusive {self._exclusive} != recomputed {exclusive}"
        for d, holder in exclusive.items():
            assert load[d] == 1, f"device {d} held exclusively by {holder} but used by {load[d]} slices"
        assert self._healthy <= self._devices.keys(), "healthy devices that do not exist"
        seen: dict[int, str] = {}
        for host, ids in self._hosts.items():
            for i in ids:
                assert i not in seen, f"device {i} on hosts {seen[i]} and {host}"
                seen[i] = host
                assert self._devices[i].host == host, f"device {i} listed on {host} but names another host"
        assert seen.keys() == self._devices.keys(), "every device record is listed under its host"
        for island, kind in self.islands().items():
            kinds = {d.kind for d in self._devices.values() if d.island == island}
            assert kinds == {kind}, f"island {island} mixes kinds {sorted(kinds)}"

    # -------------------------------------------------------------------------------- placement

    def _usable(self, device_id: int, exclusive: bool) -> bool:
        if exclusive:
            return device_id not in self._load
        return device_id not in self._exclusive

    def _load_key(self, device_id: int) -> tuple[int, int]:
        return (self.device_load(device_id), device_id)

    def _pools(self, req: SliceRequest) -> dict[str, list[int]]:
        """Islands matching the filters -> their healthy device ids, sorted (possibly none)."""
        pools: dict[str, list[int]] = {}
        for d in sorted(self._devices.values(), key=lambda d: d.id):
            if (req.island is None or d.island == req.island) and (req.kind is None or d.kind == req.kind):
                ids = pools.setdefault(d.island, [])
                if d.id in self._healthy:
                    ids.append(d.id)
        return dict(sorted(pools.items()))

    def _place(self, req: SliceRequest, prefer: tuple[int, ...] | None) -> _Placement | _Unplaceable:
        """Choose devices for `req` without changing state. The slice being placed must be detached.

        With `prefer` (its previous mapping), keep its still-usable devices in their virtual
        positions and its island when that island can hold the request; otherwise place afresh.
        """
        pools = self._pools(req)
        if prefer is not None and len(prefer) == req.devices:
            kept = self._place_preferring(req, prefer, pools)
            if kept is not None:
                return kept
        n = req.devices
        options: list[_Option] = []
        too_small: list[str] = []
        word = "unshared" if req.exclusive else "usable"
        for island, ids in pools.items():
            usable = sorted((d for d in ids if self._usable(d, req.exclusive)), key=self._load_key)
            if len(usable) < n:
                too_small.append(f"{island} (only {len(usable)} {word})")
                continue
            chosen = usable[:n]
            idle = sum(1 for d in usable if self.device_load(d) == 0)
            total = sum(self.device_load(d) for d in chosen)
            options.append(_Option(island, tuple(sorted(chosen)), total, idle))
        if not options:
            return _Unplaceable(self._capacity_reason(req, pools))
        options.sort(key=_Option.key)
        best = options[0]
        lost: list[str] = []
        for o in options[1:]:
            if o.total_load > best.total_load:
                lost.append(f"{o.island} (total load {o.total_load} > {best.total_load})")
            elif o.idle < best.idle:
                lost.append(f"{o.island} (idle devices {o.idle} < {best.idle})")
            else:
                lost.append(f"{o.island} (tie, name order)")
        loads = [self.device_load(d) for d in best.chosen]
        text = f"island {best.island}: devices {_fmt_ids(best.chosen)} with loads {_fmt_ids(loads)}"
        if req.island is not None:
            text += f"; island {req.island} requested"
        elif lost or too_small:
            text += "; other islands: " + ", ".join(lost + too_small)
        else:
            text += "; the only candidate island"
        return _Placement(best.chosen, text)

    def _place_preferring(
        self, req: SliceRequest, prefer: tuple[int, ...], pools: dict[str, list[int]]
    ) -> _Placement | None:
        counts: dict[str, int] = {}
        for d in prefer:
            if d in self._devices:
                island = self._devices[d].island
                counts[island] = counts.get(island, 0) + 1
        if not counts:
            return None
        island = min(counts, key=lambda i: (-counts[i], i))
        if island not in pools:
            return None
        usable = [d for d in pools[island] if self._usable(d, req.exclusive)]
        kept = {i: d for i, d in enumerate(prefer) if d in usable}
        spare = sorted((d for d in usable if d not in kept.values()), key=self._load_key)
        free_positions = [i for i in range(req.devices) if i not in kept]
        if len(spare) < len(free_positions):
            return None
        added = sorted(spare[: len(free_positions)])
        mapping = list(prefer)
        for i, d in zip(free_positions, added, strict=True):
            mapping[i] = d
        if not added:
            return _Placement(tuple(mapping), f"island {island}: kept devices {_fmt_ids(prefer)}")
        loads = [self.device_load(d) for d in added]
        text = (
            f"island {island}: kept devices {_fmt_ids(sorted(kept.values()))}, "
            f"added {_fmt_ids(added)} with loads {_fmt_ids(loads)}"
        )
        return _Placement(tuple(mapping), text)

    def _capacity_reason(self, req: SliceRequest, pools: dict[str, list[int]]) -> str:
        """A reason a person can act on for why no island fits `req` (pools from `_pools`)."""
        n = req.devices
        kind = f" {req.kind}" if req.kind else ""
        if req.island is not None:
            healthy = pools.get(req.island, [])
            head = f"island {req.island} has {len(healthy)} healthy{kind} devices"
            if req.exclusive:
                busy = sum(1 for d in healthy if d in self._load)
                need = f"needs {n} unshared"
                return f"{head}, {busy} of them in use; {need}" if busy else f"{head}; {need}"
            held = sum(1 for d in healthy if d in self._exclusive)
            return f"{head}, {held} of them held exclusively; needs {n}" if held else f"{head}; needs {n}"
        if not any(pools.values()):
            return f"needs {n}{kind} devices on one island; no healthy{kind} devices"
        if req.exclusive:
            unshared = {i: sum(1 for d in ids if d not in self._load) for i, ids in pools.items()}
            best = min(unshared, key=lambda i: (-unshared[i], i))
            return (
                f"needs {n} unshared{kind} devices on one island; "
                f"the most any island has is {unshared[best]} (island {best})"
            )
        free = {i: sum(1 for d in ids if d not in self._exclusive) for i, ids in pools.items()}
        best = min(free, key=lambda i: (-free[i], -len(pools[i]), i))
        return (
            f"needs {n}{kind} devices on one island; "
            f"the largest island has {len(pools[best])} (island {best}, {free[best]} free)"
        )

    # ------------------------------------------------------------------------------ transitions

    def _placed(self) -> Iterable[Slice]:
        return (s for s in self._slices.values() if s.status is not SliceStatus.DEGRADED)

    def _attach(self, s: Slice) -> None:
        for d in s.mapping:
            self._load[d] = self._load.get(d, 0) + 1
            if s.request.exclusive:
                self._exclusive[d] = s.name

    def _detach(self, s: Slice) -> None:
        for d in s.mapping:
            self._load[d] -= 1
            if not self._load[d]:
                del self._load[d]
            if self._exclusive.get(d) == s.name:
                del self._exclusive[d]

    def _remove(self, s: Slice) -> None:
        if s.status is not SliceStatus.DEGRADED:
            self._detach(s)
        del self._slices[s.name]

    def _broken(self, s: Slice) -> bool:
        """A placed slice whose devices went unhealthy or moved under its filters (re-registration)."""
        if any(d not in self._healthy for d in s.mapping):
            return True
        devs = [self._devices[d] for d in s.mapping]
        return (
            len({d.island for d in devs}) > 1
            or (s.request.island is not None and any(d.island != s.request.island for d in devs))
            or (s.request.kind is not None and any(d.kind != s.request.kind for d in devs))
        )

    def _repair(self, cause: str) -> list[Action]:
        """Re-place every broken placed slice, in creation order; degrade those that do not fit."""
        actions: list[Action] = []
        for s in [s for s in self._placed() if self._broken(s)]:
            self._detach(s)
            placed = self._place(s.request, prefer=s.mapping)
            if isinstance(placed, _Unplaceable):
                reason = f"{cause}; {placed.reason}"
                new = replace(s, status=SliceStatus.DEGRADED, reason=reason)
                self._slices[s.name] = new
                actions.append(SliceDegraded(new, reason))
                continue
            new = replace(
                s,
                mapping=placed.mapping,
                status=SliceStatus.REMAPPED,
                reason=cause,
                history=(*s.history, RemapRecord(s.mapping, placed.mapping, cause)),
                generation=s.generation + 1,
            )
            self._slices[s.name] = new
            self._attach(new)
            actions.append(SliceRemapped(new, s.mapping, cause))
        return actions

    def _retry_degraded(self, trigger: str, skip: frozenset[str] = frozenset()) -> list[Action]:
        """Try to place every degraded slice again, in creation order; failures stay as they are."""
        actions: list[Action] = []
        for s in list(self._slices.values()):
            if s.status is not SliceStatus.DEGRADED or s.name in skip:
                continue
            placed = self._place(s.request, prefer=s.mapping)
            if isinstance(placed, _Unplaceable):
                continue
            if placed.mapping == s.mapping:
                new = replace(s, status=SliceStatus.READY, reason="", generation=s.generation + 1)
            else:
                new = replace(
                    s,
                    mapping=placed.mapping,
                    status=SliceStatus.REMAPPED,
                    reason=trigger,
                    history=(*s.history, RemapRecord(s.mapping, placed.mapping, trigger)),
                    generation=s.generation + 1,
                )
            self._slices[s.name] = new
            self._attach(new)
            actions.append(SliceRestored(new))
        return actions

    @staticmethod
    def _degraded_names(actions: list[Action]) -> frozenset[str]:
        return frozenset(a.slice.name for a in actions if isinstance(a, SliceDegraded))

    def _next_auto_name(self) -> str:
        """The first free "slice-N" (N from 1); a deleted slice's name may come back."""
        seq = 1
        while f"slice-{seq}" in self._slices:
            seq += 1
        return f"slice-{seq}"

    # ---------------------------------------------------------------------------------- restore

    def restore(
        self, devices: Iterable[tuple[PhysicalDevice, bool]], slices: Iterable[Slice]
    ) -> list[Action]:
        """Replace all state with what the database holds: (device, healthy) pairs and slices.

        Slices are taken in creation order. Raises ValueError (state unchanged) on inconsistent
        input. Placed slices on unhealthy devices are then repaired as after a host loss, and the
        resulting actions returned, so a controller that marks every device unhealthy until its
        host re-registers will see slices degrade and come back; one that trusts the database
        passes healthy=True and sends HostLost for hosts that do not return.
        """
        saved = dict(vars(self))
        fresh = ResourceManager(debug=self.debug)
        vars(self).update(vars(fresh))
        try:
            self._restore(list(devices), list(slices))
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
            self._devices[d.id] = d
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
