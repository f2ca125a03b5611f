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

Modules, by noun: `models` (the words: devices, requests, slices, events, actions), `state` (the
state, its views and `validate`), `placement`, `remap` (attach, detach, repair, retry), `machine`
(`ResourceManager`: stimulus handling and restore).
"""

from server.invariants import InvariantError
from server.resource_manager.machine import ResourceManager
from server.resource_manager.models import (
    KINDS,
    NAME_RE,
    OWNER_RE,
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
    RemapRecord,
    Slice,
    SliceCreated,
    SliceDegraded,
    SliceDeleted,
    SliceRemapped,
    SliceRequest,
    SliceRestored,
    SliceStatus,
)

__all__ = [
    "KINDS",
    "NAME_RE",
    "OWNER_RE",
    "Action",
    "CreateSlice",
    "DeleteSlice",
    "Event",
    "HostLost",
    "HostUp",
    "InvariantError",
    "PhysicalDevice",
    "PlacementPreview",
    "RejectCode",
    "Rejected",
    "ReleaseOwner",
    "RemapRecord",
    "ResourceManager",
    "Slice",
    "SliceCreated",
    "SliceDegraded",
    "SliceDeleted",
    "SliceRemapped",
    "SliceRequest",
    "SliceRestored",
    "SliceStatus",
]
