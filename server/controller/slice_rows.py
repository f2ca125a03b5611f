"""The slice service's database rows (slices.py): writing the resource manager's slices to
them, and reading them back at start."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from .. import resource_manager as rm
from ..db.models import CounterRow, SliceDeviceRow, SliceRemapRow, SliceRow, int_list
from ..resource_manager.remap import auto_name_seq

AUTO_SEQ = "slice_auto_seq"  # CounterRow: the highest N of an automatic name "slice-N" ever given

# (name, the slice as it is now or None when deleted, created at, remap times)
RowOp = tuple[str, "rm.Slice | None", datetime, tuple[datetime, ...]]


def write_rows(s: Session, ops: list[RowOp]) -> None:
    """The writer's job: make the slices' rows what `ops` say, in order."""
    for name, sl, created_at, remap_at in ops:
        row = s.scalar(select(SliceRow).where(SliceRow.name == name))
        if sl is None:
            if row is not None:
                s.delete(row)
                s.flush()  # a slice of the same name may come back in this transaction
            continue
        created = row is None
        if row is None:
            req = sl.request
            row = SliceRow(
                name=sl.name,
                owner=sl.owner,
                devices=req.devices,
                mesh=list(req.mesh) if req.mesh is not None else None,
                island=req.island or "",
                kind=req.kind or "",
                exclusive=req.exclusive,
                host_axis=req.host_axis,
                created_at=created_at,
            )
            s.add(row)
        row.status, row.reason, row.generation = sl.status.value, sl.reason, sl.generation
        if created:  # (after the row is complete: the counter's read flushes it)
            _note_name(s, sl.name)
        by_index = {m.virtual_index: m for m in row.mapping}
        for i, dev in enumerate(sl.mapping):
            if i in by_index:
                by_index[i].device_id = dev
            else:
                row.mapping.append(SliceDeviceRow(virtual_index=i, device_id=dev))
        for i, rec in enumerate(sl.history[len(row.remaps):], start=len(row.remaps)):
            row.remaps.append(SliceRemapRow(at=remap_at[i] if i < len(remap_at) else created_at,
                                            reason=rec.reason, old_devices=list(rec.old),
                                            new_devices=list(rec.new)))
        s.flush()


def _note_name(s: Session, name: str) -> None:
    """Raises the `slice_auto_seq` counter to N when `name` is "slice-N" (automatic or chosen
    like one), so that no later controller gives that name again."""
    seq = auto_name_seq(name)
    if seq is None:
        return
    counter = s.get(CounterRow, AUTO_SEQ)
    if counter is None:
        s.add(CounterRow(name=AUTO_SEQ, value=seq))
    elif counter.value < seq:
        counter.value = seq


def auto_seq(s: Session) -> int:
    """The `slice_auto_seq` counter (0 in a database that has not given one yet)."""
    counter = s.get(CounterRow, AUTO_SEQ)
    return 0 if counter is None else counter.value


def slice_of(row: SliceRow) -> rm.Slice:
    """The resource manager's slice from its database rows (JSON columns validated)."""
    request = rm.SliceRequest(
        name=row.name,
        devices=row.devices,
        mesh=row.mesh_shape(),
        island=row.island or None,
        kind=row.kind or None,
        exclusive=row.exclusive,
        host_axis=row.host_axis,
    )
    history = tuple(
        rm.RemapRecord(tuple(int_list(r.old_devices)), tuple(int_list(r.new_devices)), r.reason)
        for r in row.remaps
    )
    return rm.Slice(
        name=row.name,
        request=request,
        owner=row.owner,
        mapping=tuple(m.device_id for m in row.mapping),
        status=rm.SliceStatus(row.status),
        reason=row.reason,
        history=history,
        generation=row.generation,
    )
