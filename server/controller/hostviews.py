"""The cluster's listings of hosts and devices, filtered and paged.

Hosts and devices are listed
in (island, host[, local index]) order from the per-island index: a page builds only its own
entries, and a filter by island reads only that island. A page token is the key of the last
entry of the previous page (opaque to clients), so paging stays in order while hosts come and go.
"""

from __future__ import annotations

import base64
import binascii
import json
from bisect import bisect_left
from collections.abc import Callable, Container, Iterator

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb

from .cluster import Cluster, HostInfo, device_state, host_state
from .device_rows import rows_of
from .errors import InvalidArgument
from .host_rows import host_rows_of


def _decode(token: str, parts: int) -> list[str | int] | None:
    if not token:
        return None
    try:
        key = json.loads(base64.urlsafe_b64decode(token.encode()))
    except (ValueError, binascii.Error):
        key = None
    if not isinstance(key, list) or len(key) != parts:
        raise InvalidArgument("invalid page token: pass back the next_page_token of the previous page")
    return key


def _encode(key: list[str | int]) -> str:
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode()


def _hosts_from(cluster: Cluster, island: str, after: list[str | int] | None) -> Iterator[HostInfo]:
    """Hosts in (island, name) order, from the first whose key is not before `after`'s
    (island, host) (that one included: a device page may end inside it)."""
    islands = [island] if island else sorted(cluster.islands)
    start = (str(after[0]), str(after[1])) if after else None
    if start is not None:
        islands = islands[bisect_left(islands, start[0]):]
    for name in islands:
        names = cluster.host_names(name)
        first = bisect_left(names, start[1]) if start is not None and name == start[0] else 0
        for k in range(first, len(names)):
            yield cluster.hosts[names[k]]


def list_hosts(cluster: Cluster, island: str = "", state: pb.HostState.ValueType = pb.HOST_STATE_UNSPECIFIED,
               limit: int = 0, page_token: str = "", stalled: Container[str] = ()) -> cpb.ListHostsResponse:
    """Hosts in (island, name) order; a ready host named in `stalled` is listed as stalled (the
    `state` filter reads the host's own state). Each entry's fixed fields come encoded from
    `host_rows`, and the page is parsed from their bytes in one call."""
    if limit < 0:
        raise InvalidArgument(f"limit must not be negative, got {limit}")
    after = _decode(page_token, 2)
    islands = [island] if island else list(cluster.islands)
    if state == pb.HOST_STATE_UNSPECIFIED:
        total = sum(cluster.island_counts(i)[0] for i in islands)
    else:
        total = sum(1 for i in islands for h in cluster.hosts_of(i) if host_state(h.state) == state)
    rows = host_rows_of(cluster)
    parts: list[bytes] = []
    last: HostInfo | None = None
    next_token = ""
    for h in _hosts_from(cluster, island, after):
        if after is not None and [h.island, h.name] == after:
            continue
        if state != pb.HOST_STATE_UNSPECIFIED and host_state(h.state) != state:
            continue
        if limit and len(parts) == limit:
            assert last is not None
            next_token = _encode([last.island, last.name])
            break
        parts.append(rows.entry(h, stalled))
        last = h
    reply = cpb.ListHostsResponse(total=total, next_page_token=next_token)
    reply.MergeFromString(b"".join(parts))
    return reply


def list_devices(cluster: Cluster, island: str = "", state: pb.DeviceState.ValueType = pb.DEVICE_STATE_UNSPECIFIED,
                 limit: int = 0, page_token: str = "",
                 slice_count: Callable[[int], int] | None = None, slice_epoch: int = 0) -> cpb.ListDevicesResponse:
    """Devices in (island, host, local index) order. Each host's entries come encoded from
    `device_rows` (rebuilt when the host, or `slice_epoch`, changed) and the page is parsed
    from their bytes in one call; `slice_epoch` must change whenever a `slice_count` may have."""
    if limit < 0:
        raise InvalidArgument(f"limit must not be negative, got {limit}")
    after = _decode(page_token, 3)
    islands = [island] if island else list(cluster.islands)
    if state == pb.DEVICE_STATE_UNSPECIFIED:
        total = sum(cluster.island_counts(i)[1] for i in islands)
    else:
        total = sum(len(h.device_ids) for i in islands for h in cluster.hosts_of(i) if device_state(h.state) == state)
    cache = rows_of(cluster)
    parts: list[bytes] = []
    count = 0
    last: tuple[HostInfo, int] | None = None  # the page's last device
    next_token = ""
    for h in _hosts_from(cluster, island, after):
        if state != pb.DEVICE_STATE_UNSPECIFIED and device_state(h.state) != state:
            continue
        first = int(after[2]) + 1 if after is not None and [h.island, h.name] == after[:2] else 0
        n = len(h.device_ids)
        if first >= n:
            continue
        if limit and count == limit:  # a device beyond the page: the next page starts after `last`
            assert last is not None
            next_token = _encode([last[0].island, last[0].name, last[1]])
            break
        rows = cache.of(h, slice_count, slice_epoch)
        end = min(n, first + limit - count) if limit else n
        parts.extend(rows[first:end])
        count += end - first
        last = (h, end - 1)
        if end < n:  # the page ends inside this host
            next_token = _encode([h.island, h.name, end - 1])
            break
    reply = cpb.ListDevicesResponse(total=total, next_page_token=next_token)
    reply.MergeFromString(b"".join(parts))
    return reply
