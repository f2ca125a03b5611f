"""The resource manager's words: devices, slice requests and slices, the events it takes and the
actions it returns (all immutable), and the placement results its placement step passes around."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

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
    # mesh axis that runs across hosts (one host per index along it), the others inside a host
    host_axis: int | None = None


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


