"""Removing hosts and islands: `pwctl host delete`, `pwctl island delete`, and the garbage
collection of hosts lost for longer than `--lost-host-ttl` (issue 29, finding 2; issue 30, item 6).

Rules:
- A host is deleted only while lost, unless forced: `force` marks a live host lost first (its
  slices are remapped as on any loss; its worker, if it still runs, will register again as a
  new host: stop it first to be rid of it).
- A host whose devices a slice still maps (a degraded slice keeps its last mapping) is not
  deleted, forced or not: delete or recreate those slices first (their rows refer to the devices).
- An island is deleted only when it holds no host (delete them first) and no slice asks for it.
- The garbage collector deletes, every `GC_EVERY_S`, the hosts lost for longer than the TTL that
  no slice maps, and the islands it left empty; one log line each.

Deleting forgets the host (its name, ids and credential): the name is free for anyone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta

from .. import resource_manager as rm
from ..db.models import utcnow
from .cluster import LOST, Cluster, HostInfo
from .errors import InUse, NotFound

log = logging.getLogger(__name__)

DEFAULT_LOST_HOST_TTL_S = 24 * 3600.0
GC_EVERY_S = 60.0

# names of the slices that map any of these device ids (currently, or as a degraded slice's last mapping)
SlicesUsing = Callable[[Iterable[int]], list[str]]
# names of the slices whose request names this island
SlicesAsking = Callable[[str], list[str]]


def slice_queries(slices: Callable[[], Mapping[str, rm.Slice]]) -> tuple[SlicesUsing, SlicesAsking]:
    """`SlicesUsing` and `SlicesAsking` over the resource manager's slices (by name, read when asked)."""

    def using(device_ids: Iterable[int]) -> list[str]:
        ids = set(device_ids)
        return sorted(s.name for s in slices().values() if ids.intersection(s.mapping))

    def asking(island: str) -> list[str]:
        return sorted(s.name for s in slices().values() if s.request.island == island)

    return using, asking


def _names(items: list[str], most: int = 5) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


class Removal:
    def __init__(self, cluster: Cluster, slices_using: SlicesUsing, slices_asking: SlicesAsking,
                 lost_ttl_s: float = DEFAULT_LOST_HOST_TTL_S) -> None:
        self.cluster = cluster
        self._slices_using = slices_using
        self._slices_asking = slices_asking
        self.lost_ttl_s = lost_ttl_s

    def _host(self, name: str) -> HostInfo:
        info = self.cluster.hosts.get(name)
        if info is None:
            raise NotFound(f"no host named {name!r} (see `pwctl host list`)")
        return info

    def _check_unused(self, info: HostInfo) -> None:
        using = self._slices_using(self.cluster.all_device_ids(info.name))
        if using:
            raise InUse(f"host {info.name}'s devices are still mapped by slice(s) {_names(using)}: "
                        "delete those slices first")

    def delete_host(self, name: str, force: bool = False) -> HostInfo:
        """Deletes host `name` (rules in the module docstring); raises NotFound or InUse."""
        info = self._host(name)
        if info.state != LOST:
            if not force:
                raise InUse(f"host {name} is {info.state}: stop its worker first, or pass --force "
                            "(its slices move as on a loss; a worker still running registers again)")
            self.cluster.mark_lost(name, "deleted by the operator")
            using = self._slices_using(self.cluster.all_device_ids(name))
            if using:
                raise InUse(f"host {name} is lost now (forced), but slice(s) {_names(using)} still map its "
                            "devices (degraded: nowhere to move them): delete those slices, then the host")
        self._check_unused(info)
        self.cluster.delete_host(info)
        log.info("host %s (island %s) deleted%s", name, info.island, " (forced)" if force else "")
        return info

    def delete_island(self, name: str) -> None:
        """Deletes an empty island; raises NotFound or InUse."""
        if name not in self.cluster.islands:
            known = ", ".join(sorted(self.cluster.islands)) or "none"
            raise NotFound(f"no island named {name!r} (islands: {known})")
        hosts = sorted(h.name for h in self.cluster.hosts_of(name))
        if hosts:
            raise InUse(f"island {name} still holds host(s) {_names(hosts)}: delete them first "
                        "(`pwctl host delete`, once lost)")
        asking = self._slices_asking(name)
        if asking:
            raise InUse(f"slice(s) {_names(asking)} ask for island {name}: delete them first")
        self.cluster.delete_island(name)
        log.info("island %s deleted", name)

    # ---- garbage collection ----
    def collect(self) -> list[str]:
        """Deletes the hosts lost for longer than the TTL that no slice maps, and the islands
        that leaves empty (when no slice asks for them); returns the deleted hosts' names."""
        if self.lost_ttl_s <= 0:
            return []
        cutoff = utcnow() - timedelta(seconds=self.lost_ttl_s)
        deleted: list[str] = []
        emptied: set[str] = set()
        for info in list(self.cluster.hosts.values()):
            if info.state != LOST or info.last_heartbeat > cutoff:
                continue
            if self._slices_using(self.cluster.all_device_ids(info.name)):
                continue
            self.cluster.delete_host(info)
            deleted.append(info.name)
            emptied.add(info.island)
            log.info("host %s (island %s) deleted: lost for more than %g s (--lost-host-ttl)",
                     info.name, info.island, self.lost_ttl_s)
        for island in sorted(emptied):
            if not any(True for _ in self.cluster.hosts_of(island)) and not self._slices_asking(island):
                self.cluster.delete_island(island)
                log.info("island %s deleted: its last host was collected", island)
        return deleted

    async def run(self, every_s: float = GC_EVERY_S) -> None:
        """Background task: `collect` every `every_s` (sooner when the TTL is shorter)."""
        if self.lost_ttl_s <= 0:
            return
        interval = max(0.1, min(every_s, self.lost_ttl_s / 4))
        while True:
            await asyncio.sleep(interval)
            start = time.monotonic()
            self.collect()
            spent = time.monotonic() - start
            if spent > 0.05:
                log.info("lost-host collection took %.3f s", spent)
