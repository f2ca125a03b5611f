"""The controller's side of the proxy service: proxy sessions on the cluster's slices.

A proxy session runs on the slice the client named (`PATHWAYS_SLICE`), or on a fresh slice it
owns (`PATHWAYS_DEVICES` devices; default: every free device of the island with the most free
devices), released when the session ends. The client sees the slice's virtual devices 0..n-1 as
its devices; the slice maps them onto physical devices as it does for `pw` clients.

Arrays live in the workers' buffer stores, owned by the session (`client:proxy-<hex>`), so they
go with the session like a `pw` client's; the controller moves their bytes with the workers' own
RPCs (PutBuffers, Fetch, Wait). Compiling and executing are not wired yet: they answer
UNIMPLEMENTED, which the client shows as a JaxRuntimeError naming the request.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc import aio

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

from ..controller.errors import ControllerError
from ..resource_manager import ResourceManager
from .backend import BackendError, CompiledInfo, DeviceInfo, SliceInfo

log = logging.getLogger(__name__)

PLATFORMS = {"cpu": "cpu", "gpu": "cuda"}  # slice device kind -> the PJRT platform name clients see


CHANNEL_OPTIONS = [("grpc.max_send_message_length", 512 << 20), ("grpc.max_receive_message_length", 512 << 20)]
WAIT_S = 3600.0  # the longest a download or a readiness check waits for a computation
# A worker's PutBuffers takes one message per array, and workers accept messages up to 64 MiB
# (server/worker/transfer.py); this leaves room for the message's other fields.
MAX_UPLOAD_BYTES = (64 << 20) - (64 << 10)


class Slices(Protocol):
    """What proxy sessions need of the slice service (server/controller/slices.py)."""

    rm: ResourceManager

    def placement(self, name: str) -> Any: ...

    def get(self, name: str) -> cpb.Slice: ...

    def create(self, spec: cpb.SliceSpec, dry_run: bool, owner: str) -> cpb.CreateSliceResponse: ...

    def release_owner(self, owner: str) -> None: ...

    async def written(self) -> None: ...


@dataclass(frozen=True)
class Controls:
    """What proxy sessions need of the rest of the controller."""

    release_buffers: Any  # (worker address, buffer ids) -> None: frees them after earlier runs
    release_owner: Any  # owner -> None: frees an owner's buffers on every worker, and its slices
    new_id_prefix: Any  # () -> int: a buffer-id prefix no live client holds
    token: str | None  # the cluster token the workers may require


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
    """One proxy session's slice and buffers; owns the slice when it created it."""

    def __init__(self, slices: Slices, controls: Controls, sl: cpb.Slice, owner: str, owns_slice: bool) -> None:
        self._slices = slices
        self._controls = controls
        self._owner = owner
        self._owns_slice = owns_slice
        self.name = sl.name
        self.slice = slice_info(sl)
        prefix = controls.new_id_prefix() << 40
        self._ids = (prefix | n for n in itertools.count(1))
        self._channels: dict[str, tuple[aio.Channel, wgrpc.WorkerStub]] = {}
        self._home: dict[int, str] = {}  # buffer id -> the address of the worker holding it
        self._metadata = (("authorization", f"Bearer {controls.token}"),) if controls.token else ()

    def _unwired(self, what: str) -> BackendError:
        return BackendError("UNIMPLEMENTED", f"{what} through the IFRT proxy is not wired to the workers yet")

    def _worker(self, address: str | None = None) -> tuple[str, wgrpc.WorkerStub]:
        if address is None:
            try:
                address = self._slices.placement(self.name).host.address
            except ControllerError as e:
                raise _backend_error(e) from None
        assert address is not None
        conn = self._channels.get(address)
        if conn is None:
            channel = aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            conn = self._channels[address] = (channel, wgrpc.WorkerStub(channel))
        return address, conn[1]

    async def compile(
        self, key: bytes, module: bytes, compile_options: bytes, device_ids: Sequence[int]
    ) -> CompiledInfo:
        raise self._unwired("compiling")

    def execute(self, function_id: str, inputs: Sequence[int], outputs: Sequence[int]) -> None:
        raise self._unwired("executing")

    async def put(self, device_id: int, dtype: str, shape: tuple[int, ...], data: bytes) -> int:
        if len(data) > MAX_UPLOAD_BYTES:
            raise BackendError(
                "RESOURCE_EXHAUSTED",
                f"an array of {len(data)} bytes: arrays over {MAX_UPLOAD_BYTES} bytes cannot be uploaded through "
                "the IFRT proxy yet (a worker takes one message of at most 64 MiB per uploaded array)",
            )
        address, stub = self._worker()
        buffer_id = next(self._ids)
        req = wpb.PutBufferRequest(
            buffer_id=buffer_id, owner=self._owner, array=pb.ArrayProto(dtype=dtype, shape=list(shape), data=data)
        )
        try:
            await stub.PutBuffers(iter([req]), metadata=self._metadata)
        except grpc.RpcError as e:
            raise BackendError("UNAVAILABLE", f"uploading to worker {address} failed: {e.details()}") from None
        self._home[buffer_id] = address
        return buffer_id

    def _address_of(self, buffer_id: int) -> str:
        address = self._home.get(buffer_id)
        if address is None:
            raise BackendError("NOT_FOUND", f"buffer {buffer_id} is not this session's")
        return address

    async def get(self, buffer_id: int) -> bytes:
        address, stub = self._worker(self._address_of(buffer_id))
        parts: list[bytes] = []
        try:
            async for chunk in stub.Fetch(wpb.FetchRequest(buffer_id=buffer_id, timeout_s=WAIT_S),
                                          metadata=self._metadata):
                if chunk.error:
                    raise BackendError("FAILED_PRECONDITION", chunk.error)
                parts.append(chunk.array.data)
        except grpc.RpcError as e:
            raise BackendError("UNAVAILABLE", f"downloading from worker {address} failed: {e.details()}") from None
        return b"".join(parts)

    async def ready(self, buffer_ids: Sequence[int]) -> None:
        by_worker: dict[str, list[int]] = {}
        for b in buffer_ids:
            by_worker.setdefault(self._address_of(b), []).append(b)
        for address, ids in by_worker.items():
            _, stub = self._worker(address)
            try:
                reply = await stub.Wait(wpb.WaitRequest(buffer_ids=ids, timeout_s=WAIT_S), metadata=self._metadata)
            except grpc.RpcError as e:
                raise BackendError("UNAVAILABLE", f"waiting on worker {address} failed: {e.details()}") from None
            if reply.error:
                raise BackendError("FAILED_PRECONDITION", reply.error)
            if not reply.ready:
                raise BackendError("DEADLINE_EXCEEDED", f"buffers not ready after {WAIT_S:g} s")

    def free(self, buffer_ids: Sequence[int]) -> None:
        by_worker: dict[str, list[int]] = {}
        for b in buffer_ids:
            address = self._home.pop(b, None)
            if address is not None:
                by_worker.setdefault(address, []).append(b)
        for address, ids in by_worker.items():
            self._controls.release_buffers(address, ids)

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._home.clear()
        try:
            self._controls.release_owner(self._owner)  # its buffers everywhere, and a slice it made
            if self._owns_slice:
                await self._slices.written()
        except ControllerError as e:
            raise _backend_error(e) from None
        log.info("proxy: session of %s on slice %s closed", self._owner, self.name)


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
            raise _backend_error(e) from None
