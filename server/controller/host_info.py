"""A host as the controller knows it (`HostInfo`), and the host and device states it shows.

Kept apart from `cluster.py` (registration, heartbeats, loss), which owns these records; most of
the controller reads them only."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb

from ..db.models import utcnow
from .cluster_rows import READY
from .links import WorkerLink

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
    # monotonic time of the last sign of life (for a reconnecting host: when it could be heard)
    last_seen: float = field(default_factory=time.monotonic)
    # wall time that `last_seen` stands for; the wall time of a ready host's last beat is derived
    # from its `last_seen` (`Cluster.last_heartbeat`), so a heartbeat stamps one float
    last_heartbeat: datetime = field(default_factory=utcnow)
    link: WorkerLink | None = None
    persisted_seen: float = 0.0  # `last_seen` as the database last heard of it
    # SHA-256 of the credential that proves a re-registration is this host (hostcreds.py);
    # None for a host recorded before credentials existed (the first to register adopts it)
    credential_hash: str | None = None
    # what the worker said it holds in its last heartbeat (buffers, gathering: the metrics);
    # None until its first beat after this registration
    held: cpb.Heartbeat | None = None


HostListener = Callable[[HostInfo], None]
LostListener = Callable[[HostInfo, str], None]
