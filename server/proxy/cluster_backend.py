"""The controller's side of the proxy service: proxy sessions on the cluster's slices.

A proxy session runs on the slice the client named (`PATHWAYS_SLICE`), or on a fresh slice it
owns (`PATHWAYS_DEVICES` devices; default: every free device of the island with the most free
devices), released when the session ends. The client sees the slice's virtual devices 0..n-1 as
its devices; the slice maps them onto physical devices as it does for `pw` clients.

Device work (compile, execute, array transfers) is not wired to the workers yet: those methods
answer UNIMPLEMENTED, which the client shows as a JaxRuntimeError naming the request.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from schemas.pathways.v1 import controller_pb2 as cpb

from ..controller.errors import ControllerError
from ..resource_manager import ResourceManager
from .backend import ArraySpec, BackendError, CompiledInfo, DeviceInfo, SliceInfo

log = logging.getLogger(__name__)

PLATFORMS = {"cpu": "cpu", "gpu": "cuda"}  # slice device kind -> the PJRT platform name clients see


class Slices(Protocol):
    """What proxy sessions need of the slice service (server/controller/slices.py)."""

    rm: ResourceManager

    def get(self, name: str) -> cpb.Slice: ...

    def create(self, spec: cpb.SliceSpec, dry_run: bool, owner: str) -> cpb.CreateSliceResponse: ...

    def release_owner(self, owner: str) -> None: ...

    async def written(self) -> None: ...


def _backend_error(e: ControllerError) -> BackendError:
    return BackendError(e.code.name, str(e))


def free_island(rm: ResourceManager) -> tuple[str, int] | None:
    """The island with the most free (healthy, unused) devices and how many, or None."""
    free = Counter(
        d.island for d in rm.devices.values() if rm.is_healthy(d.id) and rm.device_load(d.id) == 0
    )
    if not free:
        return None
    island, count = max(sorted(free.items()), key=lambda kv: kv[1])
    return island, count


def slice_info(sl: cpb.Slice) -> SliceInfo:
    kinds = {d.kind for d in sl.devices}
    kind = kinds.pop() if len(kinds) == 1 else "cpu"
    platform = PLATFORMS.get(kind, kind)
    devices = tuple(DeviceInfo(id=d.index, kind=kind) for d in sorted(sl.devices, key=lambda d: d.index))
    return SliceInfo(platform_name=platform, platform_version=f"pathways slice {sl.name}", platform_id=0,
                     devices=devices)


class SliceSession:
    """One proxy session's slice; owns the slice when it created it."""

    def __init__(self, slices: Slices, sl: cpb.Slice, owner: str | None) -> None:
        self._slices = slices
        self._owner = owner
        self.name = sl.name
        self.slice = slice_info(sl)

    def _unwired(self, what: str) -> BackendError:
        return BackendError("UNIMPLEMENTED", f"{what} through the IFRT proxy is not wired to the workers yet")

    async def compile(
        self, key: bytes, module: bytes, compile_options: bytes, device_ids: Sequence[int]
    ) -> CompiledInfo:
        raise self._unwired("compiling")

    def execute(self, function_id: str, inputs: Sequence[str], outputs: Sequence[str]) -> None:
        raise self._unwired("executing")

    async def put(self, buffer_id: str, device_id: int, spec: ArraySpec, chunks: AsyncIterator[bytes]) -> None:
        raise self._unwired("uploading arrays")

    async def get(self, buffer_id: str) -> AsyncIterator[bytes]:
        raise self._unwired("downloading arrays")
        yield b""  # pragma: no cover - makes this an async generator

    async def ready(self, buffer_ids: Sequence[str]) -> None:
        raise self._unwired("waiting for arrays")

    def free(self, buffer_ids: Sequence[str]) -> None:
        pass  # nothing is uploaded or computed yet

    async def close(self) -> None:
        if self._owner is None:
            return
        try:
            self._slices.release_owner(self._owner)
            await self._slices.written()
        except ControllerError as e:
            raise _backend_error(e) from None
        log.info("proxy: released slice %s", self.name)


class ControllerBackend:
    """`ClusterBackend` over the controller's slice service."""

    def __init__(self, slices: Slices) -> None:
        self._slices = slices

    async def open_session(self, slice_name: str | None, devices: int | None) -> SliceSession:
        try:
            if slice_name:
                return SliceSession(self._slices, self._slices.get(slice_name), owner=None)
            spec = cpb.SliceSpec(devices=devices or 0)
            if devices is None:
                best = free_island(self._slices.rm)
                if best is None:
                    raise BackendError(
                        "RESOURCE_EXHAUSTED",
                        "no free devices for a fresh slice: name a slice with PATHWAYS_SLICE, or wait",
                    )
                spec.island, spec.devices = best
            owner = f"client:proxy-{secrets.token_hex(6)}"
            created = self._slices.create(spec, dry_run=False, owner=owner)
            await self._slices.written()
            log.info("proxy: slice %s created for a proxy session", created.slice.name)
            return SliceSession(self._slices, created.slice, owner=owner)
        except ControllerError as e:
            raise _backend_error(e) from None
