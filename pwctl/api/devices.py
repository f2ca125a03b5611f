"""Virtual devices: what a client asks for; the resource manager maps them to physical ones."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from schemas.pathways.v1 import controller_pb2 as cpb

from ..errors import AlreadyExists, InvalidArgument, NotFound
from .runtime import Runtime


@dataclass(frozen=True)
class VirtualDevice:
    slice: VirtualSlice
    index: int

    @property
    def physical(self) -> int:
        """The physical device id it maps to now (may change when the slice is remapped)."""
        return self.slice.info.devices[self.index].device_id

    def __repr__(self) -> str:
        return f"VirtualDevice(slice={self.slice.name!r}, index={self.index})"


@dataclass(frozen=True)
class VirtualMesh:
    """A mesh over a slice's virtual devices, the target of `pw.jit`."""

    slice: VirtualSlice
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class VirtualSlice:
    """N virtual devices on one island, owned by this client (or job) unless named."""

    def __init__(self, rt: Runtime, info: cpb.Slice) -> None:
        self._rt = rt
        self.info = info
        self.name = info.name
        self.devices = [VirtualDevice(self, i) for i in range(len(info.devices))]

    def _update(self, info: cpb.Slice) -> None:
        self.info = info

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.info.spec.mesh) or (len(self.devices),)

    @property
    def kind(self) -> str:
        """The device kind the slice landed on ("cpu" or "gpu"): the export platform."""
        return (self.info.devices[0].kind if self.info.devices else "") or self.info.spec.kind or "cpu"

    @property
    def address(self) -> str:
        """The worker that runs this slice's computations (refreshed on remap); of a slice over
        several hosts, the first (where uploads go: the controller forwards them to the others)."""
        return self.info.devices[0].address

    @property
    def peers(self) -> tuple[str, ...]:
        """The other workers of a slice over several hosts (each computes on its own devices)."""
        return tuple(dict.fromkeys(d.address for d in self.info.devices[1:] if d.address != self.address))

    def mesh(self, axis_names: Sequence[str] | str = ("data",)) -> VirtualMesh:
        names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        shape = self.mesh_shape
        if len(names) == 1 and len(shape) > 1:
            shape = (math.prod(shape),)
        if len(names) != len(shape):
            raise InvalidArgument(
                f"slice {self.name!r} has a {'x'.join(map(str, shape))} mesh: give {len(shape)} axis names, "
                f"not {len(names)}"
            )
        return VirtualMesh(self, shape, names)

    def delete(self) -> None:
        self._rt.client.delete_slice(self.name, force=True)

    def __repr__(self) -> str:
        return f"VirtualSlice({self.name!r}, devices={len(self.devices)})"


class VirtualDeviceSet:
    """`pw.make_virtual_device_set()`: the entry point for asking for devices."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self.slices: list[VirtualSlice] = []

    def add_slice(
        self,
        devices: int,
        mesh: Sequence[int] | None = None,
        island: str | None = None,
        kind: str | None = None,
        *,
        name: str | None = None,
        exclusive: bool = False,
        host_axis: int | None = None,
    ) -> VirtualSlice:
        """Allocates a slice of `devices` virtual devices (all-or-nothing).

        Unnamed slices belong to this client (or job) and are released when it ends.
        `name` picks an existing named slice when one exists, else creates it by that name.
        """
        spec = cpb.SliceSpec(name=name or "", devices=devices, mesh=list(mesh or ()), island=island or "",
                             kind=kind or "", exclusive=exclusive, host_axis=host_axis)
        info = self._named(name) if name else None
        if info is None:
            try:
                info = self._rt.client.create_slice(spec, owner="" if name else self._rt.owner).slice
            except AlreadyExists:
                # another client made it between our look and our create: it is the one to use
                info = self._named(name) if name else None
                if info is None:
                    raise
        vs = VirtualSlice(self._rt, info)
        self._rt.slices[vs.name] = vs
        self.slices.append(vs)
        return vs

    def _named(self, name: str) -> cpb.Slice | None:
        """The named slice, or None when there is none by that name."""
        try:
            return self._rt.client.get_slice(name)
        except NotFound:
            return None


def make_virtual_device_set() -> VirtualDeviceSet:
    return VirtualDeviceSet(Runtime.get())
