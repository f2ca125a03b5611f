"""The IFRT proxy's `ClusterBackend` on the controller: a proxy session opens on a named slice
(`PATHWAYS_SLICE`) or on a fresh slice of the island with the most free devices, which the
session owns and releases when it ends (`SliceSession`, cluster_backend.py)."""

from __future__ import annotations

import logging
import secrets
from collections import Counter

from schemas.pathways.v1 import controller_pb2 as cpb

from ..controller.errors import ControllerError
from ..resource_manager import ResourceManager
from .backend import BackendError
from .cluster_backend import Controls, Slices, SliceSession, backend_error

log = logging.getLogger(__name__)


def free_island(rm: ResourceManager) -> tuple[str, int] | None:
    """The island with the most free (healthy, unused) devices and how many, or None."""
    free = Counter(
        d.island for d in rm.devices.values() if rm.is_healthy(d.id) and rm.device_load(d.id) == 0
    )
    if not free:
        return None
    island, count = max(sorted(free.items()), key=lambda kv: kv[1])
    return island, count



class ControllerBackend:
    """`ClusterBackend` over the controller's slice service."""

    def __init__(self, slices: Slices, controls: Controls) -> None:
        self._slices = slices
        self._controls = controls

    async def open_session(self, slice_name: str | None, devices: int | None) -> SliceSession:
        owner = f"client:proxy-{secrets.token_hex(6)}"
        try:
            if slice_name:
                return SliceSession(self._slices, self._controls, self._slices.get(slice_name), owner, False)
            spec = cpb.SliceSpec(devices=devices or 0)
            if devices is None:
                best = free_island(self._slices.rm)
                if best is None:
                    raise BackendError(
                        "RESOURCE_EXHAUSTED",
                        "no free devices for a fresh slice: name a slice with PATHWAYS_SLICE, or wait",
                    )
                spec.island, spec.devices = best
            created = self._slices.create(spec, dry_run=False, owner=owner)
            await self._slices.written()
            log.info("proxy: slice %s created for a proxy session", created.slice.name)
            return SliceSession(self._slices, self._controls, created.slice, owner, True)
        except ControllerError as e:
            raise backend_error(e) from None
