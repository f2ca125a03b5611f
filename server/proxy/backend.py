"""What the proxy service needs from the cluster: a small interface, so the service stays protocol.

The proxy service (service.py) speaks the IFRT proxy protocol and never executes anything itself:
the controller is control plane only and arrays live in the workers. Everything that touches
devices goes through a `ClusterBackend` (the controller's adapter over its sessions, scheduler,
dispatcher and workers implements it). Ids here are the cluster's (buffer ids unique in the cluster),
never the client's handles, which are ids within its session only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .handles import HostData


class BackendError(Exception):
    """A request the cluster refused or failed; `code` is a grpc.StatusCode name (e.g. NOT_FOUND)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class DeviceInfo:
    """One device of the session's slice, as the client will see it (`jax.devices()`)."""

    id: int
    kind: str  # e.g. "cpu", "NVIDIA H100 80GB HBM3"
    process_index: int = 0
    attributes: dict[str, int | str] = field(default_factory=dict)


@dataclass(frozen=True)
class SliceInfo:
    """The platform a session's slice offers: what the client's `InitResponse` reports."""

    platform_name: str  # "cpu", "cuda", "tpu"
    platform_version: str
    platform_id: int  # PJRT's platform id (a fingerprint of the platform name)
    devices: tuple[DeviceInfo, ...]


@dataclass(frozen=True)
class ArraySpec:
    dtype: str  # numpy dtype name, e.g. "float32", "bfloat16"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CompiledInfo:
    """A client program registered for the workers: the one-node program that runs it, and what
    it takes and gives. The workers compile it on its first run, like every `pw.jit` function."""

    program_id: str
    name: str
    inputs: tuple[ArraySpec, ...]
    outputs: tuple[ArraySpec, ...]
    donated: tuple[int, ...]  # input indices whose buffers a run consumes
    in_shardings: tuple[bytes | None, ...] = ()  # serialized xla.OpSharding per input (None: replicated)
    out_shardings: tuple[bytes | None, ...] = ()
    keep_program_id: str = ""  # the same program without donation ("" : program_id)


class SessionBackend(Protocol):
    """One proxy session's share of the cluster; closing it frees everything it owns."""

    @property
    def slice(self) -> SliceInfo: ...

    async def compile(self, module: bytes, device_ids: Sequence[int]) -> CompiledInfo:
        """Registers a StableHLO module (portable artifact) to run on `device_ids`, once per
        content; the workers owning the devices compile it."""
        ...

    def execute(self, program_id: str, inputs: Sequence[int]) -> list[int]:
        """Submits one run through the scheduler and returns at once: the ids of its output
        buffers, which exist (or carry the run's error) once it ran."""
        ...

    async def prepare(self, program_id: str, inputs: Sequence[int]) -> tuple[list[int], list[int]]:
        """The buffers a run of `program_id` reads instead of `inputs` (an input spread over other
        devices than the program's is read through a gathered copy), and those of them it made,
        which the caller frees once the run is submitted."""
        ...

    def spread_over_workers(self, buffer_id: int) -> bool:
        """Whether the run that made this buffer left its parts on several workers."""
        ...

    async def run_function(self, name: str, exported: bytes, num_outputs: int, inputs: Sequence[int],
                           devices: Sequence[int] = (), outputs: Sequence[ArraySpec] = ()) -> list[int]:
        """Runs a serialized `jax.export.Exported` (no donation) that the server made itself,
        e.g. to assemble an array from shards: registered once, then like `execute`, on the
        slice's virtual `devices` (empty: all). `outputs`: its results' specs, which a backend of
        slices spanning hosts keeps for results left spread over workers (read elsewhere through
        a gathered copy)."""
        ...

    async def put(self, devices: Sequence[int], dtype: str, shape: tuple[int, ...], data: bytes | HostData,
                  replicated: bool = False) -> int:
        """Stores host bytes (C order) as a buffer holding the global value of an array on the
        slice's `devices` (its sharding's; `replicated`: each of them holds all of it); returns
        its buffer id. A backend of slices spanning hosts stores it on the worker holding those
        devices where one does, a replicated one on each worker holding some of them. `data` may
        be a `HostData` (the parts the client sent), joined only if need be."""
        ...

    async def get(self, buffer_id: int) -> bytes | HostData:
        """A buffer's bytes (C order), once it is computed; BackendError if its run failed."""
        ...

    async def ready(self, buffer_ids: Sequence[int], blocking: bool = True) -> None:
        """Returns when the buffers exist; raises BackendError with the run's error if one failed.
        `blocking`: the client waits for the answer (a readiness check, a download), not a
        status future the server keeps for it."""
        ...

    def free(self, buffer_ids: Sequence[int]) -> None:
        """Drops the buffers (no reply awaited)."""
        ...

    async def close(self) -> None:
        """Ends the session: frees its buffers and functions, releases a slice it created."""
        ...


class ClusterBackend(Protocol):
    async def open_session(self, slice_name: str | None, devices: int | None) -> SessionBackend:
        """A session on slice `slice_name`, else on a fresh slice of `devices` devices (None: the
        cluster's default). Raises BackendError (NOT_FOUND, RESOURCE_EXHAUSTED, ...)."""
        ...
