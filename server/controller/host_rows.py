"""ListHosts entries, encoded once per host and kept until that host changes (issue 31).

Building a `Host` message field by field, and its last-beat string, costs ~2.5 µs in Python: a
listing of 2,048 hosts took ~4.4 ms to build before gRPC serialized it again. What changes
between two listings of a heartbeating cluster is a host's state and last beat; the rest (id,
name, island, address, pid, device count and kind) changes only when the host registers again.
So each host's fixed fields are kept encoded, a host's whole entry is kept with the state and
beat it was built for (only the hosts that beat since the last listing are rebuilt, as in
`device_rows`), and a rebuilt entry appends the two changing fields to the fixed ones by hand
(protobuf reads a message's fields in any order). A listing joins its page's entries and parses
them into the reply in one call.
"""

from __future__ import annotations

import weakref
from collections.abc import Container
from typing import Any

from schemas.pathways.v1 import common_pb2 as pb

from ..timeutil import iso
from .cluster import READY, Cluster, HostInfo, host_state
from .listing_rows import ListingRows, rows_for, stamp

_HOSTS_TAG = b"\x0a"  # ListHostsResponse.hosts: field 1, length-delimited
_STATE_TAG = b"\x28"  # Host.state: field 5, varint
_BEAT_TAG = b"\x3a"  # Host.last_heartbeat: field 7, length-delimited


def varint(n: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int."""
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class HostRows(ListingRows):
    """Each host's encoded entry and fixed fields, kept with the keys they were built under."""

    def __init__(self) -> None:
        super().__init__()
        self._fixed: dict[str, tuple[tuple[Any, ...], bytes]] = {}
        self._entries: dict[str, tuple[tuple[Any, ...], bytes]] = {}

    def entry(self, h: HostInfo, stalled: Container[str]) -> bytes:
        """Host `h`'s `ListHostsResponse.hosts` entry, field tag and length included; a ready
        host named in `stalled` is listed as stalled."""
        fixed_key = (h.id, h.island, h.address, h.pid, len(h.device_ids), h.kind)
        ready = h.state == READY
        state = pb.HOST_STATE_STALLED if ready and h.name in stalled else host_state(h.state)
        key = (fixed_key, state, h.last_seen if ready else h.last_heartbeat, self._offset)
        kept = self._entries.get(h.name)
        if kept is not None and kept[0] == key:
            return kept[1]
        fixed = self._fixed.get(h.name)
        if fixed is None or fixed[0] != fixed_key:
            fixed = (fixed_key, pb.Host(id=h.id, name=h.name, island=h.island, address=h.address, pid=h.pid,
                                        devices=len(h.device_ids), device_kind=h.kind).SerializeToString())
            self._fixed[h.name] = fixed
        beat = (stamp(self._offset + h.last_seen) if ready else iso(h.last_heartbeat)).encode()
        body = b"".join((fixed[1], _STATE_TAG, varint(state), _BEAT_TAG, varint(len(beat)), beat))
        row = _HOSTS_TAG + varint(len(body)) + body
        self._entries[h.name] = (key, row)
        return row

    def forget(self, names: Container[str]) -> None:
        """Drops the entries of hosts no longer in the cluster."""
        for name in [n for n in self._fixed if n not in names]:
            del self._fixed[name]
            self._entries.pop(name, None)

    def __len__(self) -> int:
        return len(self._fixed)


_ROWS: weakref.WeakKeyDictionary[Cluster, HostRows] = weakref.WeakKeyDictionary()


def host_rows_of(cluster: Cluster) -> HostRows:
    """The cluster's cache (one per cluster object, gone with it), ready for a listing."""
    return rows_for(_ROWS, cluster, HostRows)
