"""Program statistics: registrations and run counts per (program, owner), kept in memory and
written to the database about once a second, never per run."""

from __future__ import annotations

import builtins
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..db.models import ProgramRow, utcnow
from ..db.writer import Write
from .programs import ProgramRecord


@dataclass
class ProgramDelta:
    """What happened to one (program, owner) since the last flush."""

    program_id: str
    owner: str
    name: str
    nodes: int
    slices: list[str]
    registered_at: datetime | None = None
    runs: int = 0
    failures: int = 0
    last_run: float | None = None


class ProgramStats:
    """Counts per (program, owner) since the last flush; `flush` hands them to the writer."""

    def __init__(self, write: Write) -> None:
        self._write = write
        self._dirty: dict[tuple[str, str], ProgramDelta] = {}

    def registered(self, program: ProgramRecord, owner: str) -> None:
        d = self._delta((program.program_id, owner), program)
        if d.registered_at is None:
            d.registered_at = utcnow()  # used only when the row is new: the first registration

    def run_finished(self, program: ProgramRecord, owner: str, ok: bool, at: float) -> None:
        d = self._delta((program.program_id, owner), program)
        d.runs += 1
        d.failures += 0 if ok else 1
        d.last_run = at

    def _delta(self, key: tuple[str, str], program: ProgramRecord) -> ProgramDelta:
        d = self._dirty.get(key)
        if d is None:
            d = self._dirty[key] = ProgramDelta(
                program_id=key[0], owner=key[1], name=program.name, nodes=len(program.graph.nodes),
                slices=sorted(program.slices),
            )
        return d

    def flush(self) -> Future[None] | None:
        """Queues what changed since the last flush as one write; None when nothing did."""
        batch = list(self._dirty.values())
        self._dirty = {}
        if not batch:
            return None
        return self._write(lambda s: write_programs(s, batch))


def write_programs(s: Session, batch: builtins.list[ProgramDelta]) -> None:
    for d in batch:
        row = s.scalar(select(ProgramRow).where(ProgramRow.program_id == d.program_id,
                                                ProgramRow.owner == d.owner))
        if row is None:
            row = ProgramRow(program_id=d.program_id, owner=d.owner, name=d.name, nodes=d.nodes,
                             slices=d.slices, registered_at=d.registered_at or utcnow(), runs=0, failures=0)
            s.add(row)
        row.runs = (row.runs or 0) + d.runs
        row.failures = (row.failures or 0) + d.failures
        if d.last_run is not None:
            row.last_run_at = datetime.fromtimestamp(d.last_run, UTC).replace(tzinfo=None)
