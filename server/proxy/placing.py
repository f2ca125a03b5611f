"""Where a proxy program over some of its slice's virtual devices runs, read from the slice's
placement (server/controller/slices.py `Placement`), and where an upload for some of them goes,
read from the slice's holders (server/controller/holders.py, which need no island group): pure
functions, asked again at each run and upload, as a remap may move a sub-mesh from one worker
onto several or the reverse."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..controller.cluster import HostInfo
from ..controller.segments import narrowed


def runs_on(placement: Any, devices: Sequence[int]) -> tuple[str, tuple[int, ...] | None, tuple[str, ...]]:
    """Where a program over the slice's virtual `devices` (empty: all, in order) runs under
    `placement`: the address of the worker its outputs are recorded on (the uploads' worker, or
    the first of those running it), and, for an SPMD computation over several workers, the
    virtual devices its outputs' parts are on (None: its outputs are whole on that worker) and
    the addresses of the other workers holding parts of them."""
    gang = placement.gang
    if gang is None:
        return placement.host.address, None, ()
    on: tuple[int, ...] = tuple(range(len(gang.devices)))
    if devices:
        host, _, sub = narrowed(gang, devices)
        if sub is None:  # one worker's devices
            return host.address, None, ()
        gang, on = sub, tuple(devices)
    return gang.members[0].address, on, tuple(m.address for m in gang.members[1:])


def holders_of(holders: Any, devices: Sequence[int]) -> tuple[str, ...]:
    """The addresses of the workers holding the slice's virtual `devices` under `holders` (the
    slice's `Holders`, server/controller/holders.py: known while its island's group forms), each
    once, in the order of the devices (empty where a device is not the slice's)."""
    if not all(0 <= v < len(holders.host_of) for v in devices):
        return ()
    return tuple(dict.fromkeys(str(holders.hosts[holders.host_of[v]].address) for v in devices))


def compiles_on(placement: Any, devices: Sequence[int]) -> tuple[HostInfo, list[int], int]:
    """The worker that compiles a program over the slice's virtual `devices` (empty: all, in
    order), the devices it compiles for in its numbering, and the group generation (0: not a
    group computation). On a slice spanning hosts, the first member running it compiles (each
    member compiles the same module alike when it runs it), its devices numbered group-wide;
    devices on one member only are that worker's own."""
    gang = placement.gang
    if gang is not None and devices:
        host, numbers, sub = narrowed(gang, devices)
        return host, numbers, sub.generation if sub is not None else 0
    if gang is not None:
        return placement.host, list(placement.local_devices), gang.generation
    local = placement.local_devices
    return placement.host, [local[v] for v in devices] if devices else list(local), 0


def spread_members(placement: Any, devices: Sequence[int]) -> list[tuple[str, list[int]]] | None:
    """Where the parts of an upload sharded over the slice's virtual `devices` (its sharding's,
    in order) go under `placement`: per member of the island's group holding some of them, in
    the order of their first device, its address and the positions in `devices` of its devices.
    None where they are not on several members (one worker, or no group)."""
    gang = placement.gang
    if gang is None or len(gang.member_of) != len(gang.devices) or not all(
            0 <= v < len(gang.devices) for v in devices):
        return None
    by_member: dict[int, list[int]] = {}
    for k, v in enumerate(devices):
        by_member.setdefault(gang.member_of[v], []).append(k)
    if len(by_member) < 2:
        return None
    return [(str(gang.members[m].address), positions) for m, positions in by_member.items()]
