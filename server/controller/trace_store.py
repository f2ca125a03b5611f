"""Traces that last: finished node runs kept on disk beyond the observer's in-memory ring.

The observer's ring holds the last node runs for live traces. Every `FLUSH_INTERVAL_S` the
controller takes the records appended since the last flush (two slices of the ring's columns:
a copy in C, no Python per record on the event loop) and a thread writes them as one *segment*
file in `<data dir>/traces/`: a first line with its index (the jobs and program ids it holds,
its time span, its record count), then the columns as JSON. A trace of a job or program reads
the segments whose index names it, then the records still only in the ring.

Retention: the segments together stay under `retention_bytes` (`--trace-retention`, default
512 MiB); the oldest go first. `pwctl trace JOB` therefore works for any job whose node runs
are among the newest `retention_bytes` of node runs written (about 4 million at ~130 bytes
each), also after a controller restart.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .trace import NodeRun

log = logging.getLogger(__name__)

DEFAULT_RETENTION_BYTES = 512 * 2**20
FLUSH_INTERVAL_S = 0.5
N_REFS = 9  # the ring's REFS: host, island, devices, program_id, program, job, client, label, error
N_INTS = 7  # the ring's INTS: run_id, segment, size, seq, start_ns, end_ns, ok
JOB, PROGRAM_ID, PROGRAM = 5, 3, 4


@dataclass(frozen=True, slots=True)
class Segment:
    """One segment file's index (its first line)."""

    path: Path
    jobs: frozenset[str]
    program_ids: frozenset[str]
    programs: dict[str, str]  # program id -> name
    start_ns: int
    end_ns: int
    count: int
    nbytes: int


class TraceStore:
    """The segment files of one data directory. `write_file` and `read` run in a worker thread;
    the index (`segments`) changes only on the event loop (`add`), so a trace that takes the
    index and the ring's unwritten records in one step sees every record exactly once."""

    def __init__(self, directory: Path, retention_bytes: int = DEFAULT_RETENTION_BYTES) -> None:
        self.directory = directory
        self.retention_bytes = retention_bytes
        self.segments: list[Segment] = []
        directory.mkdir(parents=True, exist_ok=True)
        for path in sorted(directory.glob("*.trace")):
            seg = _read_index(path)
            if seg is not None:
                self.segments.append(seg)
        last = max((int(s.path.stem) for s in self.segments), default=0)
        self._numbers = itertools.count(last + 1)
        self._trim()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def write_file(self, refs: list[Any], ints: list[int]) -> Segment | None:
        """Writes one segment file (records in the ring's column layout); `add` makes it part of
        the store. None when it could not be written (logged: those node runs are not kept)."""
        count = len(refs) // N_REFS
        if count == 0:
            return None
        jobs = {j for j in refs[JOB::N_REFS] if j}
        programs = dict(zip(refs[PROGRAM_ID::N_REFS], refs[PROGRAM::N_REFS], strict=True))
        programs.pop("", None)
        start_ns, end_ns = min(ints[4::N_INTS]), max(ints[5::N_INTS])
        index = {"jobs": sorted(jobs), "programs": programs, "start_ns": start_ns, "end_ns": end_ns, "count": count}
        body = json.dumps({"refs": refs, "ints": ints}, separators=(",", ":"))
        data = (json.dumps(index, separators=(",", ":")) + "\n" + body + "\n").encode()
        path = self.directory / f"{next(self._numbers):012d}.trace"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_bytes(data)
            tmp.replace(path)
        except OSError as e:
            log.warning("cannot keep %d node runs for traces in %s: %s", count, self.directory, e)
            return None
        return Segment(path, frozenset(jobs), frozenset(programs), programs, start_ns, end_ns, count, len(data))

    def add(self, seg: Segment) -> None:
        """A written segment joins the store; the oldest go while the store is over its retention."""
        self.segments.append(seg)
        self._trim()

    def _trim(self) -> None:
        total = sum(s.nbytes for s in self.segments)
        while self.segments and total > self.retention_bytes:
            seg = self.segments.pop(0)
            total -= seg.nbytes
            seg.path.unlink(missing_ok=True)

    def job_ids(self) -> set[str]:
        return set().union(*(s.jobs for s in self.segments)) if self.segments else set()

    def program_names(self) -> dict[str, str]:
        """Program id -> name, of every program with node runs kept."""
        out: dict[str, str] = {}
        for s in self.segments:
            out.update(s.programs)
        return out

    def select(self, job: str = "", program_ids: set[str] | None = None) -> list[Segment]:
        """The segments that may hold node runs of `job` (id) and/or `program_ids`."""
        return [s for s in self.segments if (not job or job in s.jobs)
                and (program_ids is None or not program_ids.isdisjoint(s.program_ids))]

    @staticmethod
    def read(segs: list[Segment], job: str = "", program_ids: set[str] | None = None) -> list[NodeRun]:
        """The node runs of `job` and/or `program_ids` in `segs`, in order (runs in a thread)."""
        out: list[NodeRun] = []
        for seg in segs:
            try:
                with open(seg.path, "rb") as f:
                    f.readline()
                    cols = json.loads(f.readline())
            except (OSError, ValueError):
                continue  # trimmed meanwhile, or cut short by a crash: that segment is gone
            refs, ints = cols["refs"], cols["ints"]
            for i in range(len(refs) // N_REFS):
                r = refs[i * N_REFS:(i + 1) * N_REFS]
                if (job and r[JOB] != job) or (program_ids is not None and r[PROGRAM_ID] not in program_ids):
                    continue
                n = ints[i * N_INTS:(i + 1) * N_INTS]
                out.append(NodeRun(r[0], r[1], tuple(r[2]), n[0], n[1], n[2], n[3], r[3], r[4], r[5], r[6], r[7],
                                   n[4], n[5], bool(n[6]), r[8]))
        return out


def _read_index(path: Path) -> Segment | None:
    try:
        with open(path, "rb") as f:
            index = json.loads(f.readline())
        return Segment(path, frozenset(index["jobs"]), frozenset(index["programs"]), dict(index["programs"]),
                       int(index["start_ns"]), int(index["end_ns"]), int(index["count"]), path.stat().st_size)
    except (OSError, ValueError, KeyError, TypeError):
        log.warning("trace segment %s is unreadable; removing it", path)
        path.unlink(missing_ok=True)
        return None
