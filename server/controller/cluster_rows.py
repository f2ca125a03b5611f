"""The cluster registry's database writes (server/controller/cluster.py), run by the database
writer in the order they were queued."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import cast

from sqlalchemy import Table, bindparam, select
from sqlalchemy.orm import Session

from schemas.pathways.v1 import controller_pb2 as cpb

from ..db.models import DeviceRow, HostRow, IslandRow

READY = "ready"
LOST = "lost"
_BATCH = 500  # ids per IN (...) list in one statement


# ---- database writes (run by the writer, in the order they were queued) ----
def save_registration(s: Session, msg: cpb.RegisterWorker, host_id: int, now: datetime,
                       island_created: datetime, devices: dict[int, int], known: bool,
                       credential_hash: str | None = None) -> None:
    island = s.scalar(select(IslandRow).where(IslandRow.name == msg.island))
    if island is None:
        island = IslandRow(name=msg.island, created_at=island_created)
        s.add(island)
        s.flush()
    host = s.get(HostRow, host_id) if known else None
    if host is None:
        host = HostRow(id=host_id, name=msg.name, island_id=island.id, address=msg.address, state=READY,
                       pid=msg.pid, device_kind=msg.device_kind, machine_id=msg.machine_id)
        s.add(host)
    host.island_id = island.id
    host.address, host.pid, host.state = msg.address, msg.pid, READY
    host.device_kind, host.machine_id, host.last_heartbeat = msg.device_kind, msg.machine_id, now
    host.credential_hash = credential_hash
    s.flush()
    existing = {d.id: d for d in s.scalars(select(DeviceRow).where(DeviceRow.host_id == host_id))} if known else {}
    for index, dev_id in devices.items():
        state = "available" if index < msg.device_count else "removed"
        dev = existing.get(dev_id)
        if dev is None:
            s.add(DeviceRow(id=dev_id, host_id=host_id, local_index=index, kind=msg.device_kind, state=state))
        else:
            dev.state = state
            if state == "available":
                dev.kind = msg.device_kind


def _bulk(s: Session, run: Callable[[], object]) -> None:
    """Runs bulk statements in the writer's session: what earlier jobs of the transaction
    changed is flushed first, and what the session holds is reloaded after (the bulk statements
    bypass it; a later job must not see a stale row)."""
    s.flush()
    run()
    s.expire_all()


def save_lost(s: Session, rows: list[tuple[int, datetime]]) -> None:
    hosts, devices = cast(Table, HostRow.__table__), cast(Table, DeviceRow.__table__)

    def run() -> None:
        s.execute(hosts.update().where(hosts.c.id == bindparam("hid"))
                  .values(state=LOST, last_heartbeat=bindparam("seen")),
                  [{"hid": i, "seen": at} for i, at in rows])
        ids = [i for i, _ in rows]
        for k in range(0, len(ids), _BATCH):
            s.execute(devices.update()
                      .where(devices.c.host_id.in_(ids[k:k + _BATCH]), devices.c.state == "available")
                      .values(state="lost"))
    _bulk(s, run)


def save_heartbeats(s: Session, rows: list[tuple[int, datetime]]) -> None:
    hosts = cast(Table, HostRow.__table__)
    _bulk(s, lambda: s.execute(hosts.update().where(hosts.c.id == bindparam("hid"))
                               .values(last_heartbeat=bindparam("seen")),
                               [{"hid": i, "seen": at} for i, at in rows]))


def delete_host_rows(s: Session, host_id: int) -> None:
    """Deletes a host's row and its devices' (no slice maps them: removal.py checked)."""
    devices = cast(Table, DeviceRow.__table__)
    hosts = cast(Table, HostRow.__table__)

    def run() -> None:
        s.execute(devices.delete().where(devices.c.host_id == host_id))
        s.execute(hosts.delete().where(hosts.c.id == host_id))
    _bulk(s, run)


def delete_island_row(s: Session, name: str) -> None:
    islands = cast(Table, IslandRow.__table__)
    _bulk(s, lambda: s.execute(islands.delete().where(islands.c.name == name)))
