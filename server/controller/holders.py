"""Which worker holds each virtual device of a slice: all that storing a slice's bytes needs.

A computation over a slice spanning hosts needs the island's `jax.distributed` group (the
placement's gang, slices.py and groups.py), which forms again after every change of the island's
hosts: at start, when a host joins or is lost, after a remap. Putting bytes on a worker does not:
it needs only the slice's mapping and the registered hosts, so uploads (the IFRT proxy's,
server/proxy) ask this and go on while the group forms.

Pure: a slice's mapping and the hosts in, `Holders` out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .cluster import HostInfo


@dataclass(frozen=True)
class Holders:
    """The hosts of a slice now, and which of them holds each of its virtual devices."""

    slice: str
    # in host-name order, which is the island group's process order (groups.py `_members`): the
    # first is the gang placement's first member, `Placement.host`, where uploads go
    hosts: tuple[HostInfo, ...]
    host_of: tuple[int, ...]  # virtual device -> the index in `hosts` of the host holding it
    generation: int  # the slice's (it changes on every remap)

    @property
    def first(self) -> HostInfo:
        return self.hosts[0]


def slice_holders(name: str, mapping: Sequence[int], generation: int, host_of_device: Callable[[int], str],
                  hosts: Mapping[str, HostInfo]) -> Holders | str:
    """The holders of slice `name` over physical devices `mapping` (by virtual device), or why
    there are none: a host of its devices is not registered."""
    names = [host_of_device(d) for d in mapping]
    order = sorted(set(names))
    missing = [h for h in order if h not in hosts]
    if missing or not order:
        return f"slice {name!r} is on host {', '.join(missing) or '?'}, which is not registered"
    position = {h: k for k, h in enumerate(order)}
    return Holders(slice=name, hosts=tuple(hosts[h] for h in order), host_of=tuple(position[h] for h in names),
                   generation=generation)
