"""Chrome/Perfetto traces of finished node runs (what `pwctl trace` downloads)."""

from __future__ import annotations

import asyncio
import json
from array import array
from typing import Any, NamedTuple

TRACE_CHUNK = 2000  # records encoded between yields to the event loop

DeviceKey = tuple[str, int]  # (host name, local device index)


class NodeRun(NamedTuple):
    """One finished node run, as read from the ring for a trace."""

    host: str
    island: str
    devices: tuple[int, ...]  # local device indexes on `host`
    run_id: int
    segment: int  # the run's segment (one or more consecutive program nodes on one worker)
    size: int  # program nodes in it
    seq: int
    program_id: str
    program: str
    job: str
    client: str
    label: str
    start_ns: int  # busy start: max(launch, previous end on its devices)
    end_ns: int
    ok: bool
    error: str


class TraceBuilder:
    """The Chrome trace format (Perfetto, chrome://tracing): one process per (island, host),
    one thread per device ("device N", N its local index), one complete event ("ph": "X")
    per node run on each device it used. Times in µs from the earliest event; the absolute
    origin is in `otherData.origin_unix_ns`. Events come chunk by chunk (`events`) so a big
    trace can be encoded without holding the event loop; metadata follows them."""

    def __init__(self, records: list[NodeRun], device_ids: dict[DeviceKey, int] | None = None) -> None:
        self.records = records
        self.device_ids = device_ids or {}
        self.origin = min((r.start_ns for r in records), default=0)
        self.pids: dict[tuple[str, str], int] = {}
        self.threads: set[tuple[int, int, str]] = set()

    def events(self, records: list[NodeRun]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        origin = self.origin
        for r in records:
            pid = self.pids.setdefault((r.island, r.host), len(self.pids) + 1)
            ts = round((r.start_ns - origin) / 1000, 3)
            dur = round(max(0, r.end_ns - r.start_ns) / 1000, 3)
            args: dict[str, Any] = {"run_id": r.run_id, "segment": r.segment, "nodes": r.size, "program": r.program,
                                    "program_id": r.program_id, "job": r.job, "client": r.client,
                                    "seq": r.seq, "ok": r.ok}
            if r.error:
                args["error"] = r.error
            cat = "node" if r.ok else "node,failed"
            for d in r.devices:
                self.threads.add((pid, d, r.host))
                out.append({"name": r.label, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": d,
                            "args": args})
        return out

    def metadata(self) -> list[dict[str, Any]]:
        meta: list[dict[str, Any]] = []
        for (island, host), pid in self.pids.items():
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                         "args": {"name": f"{island}/{host}" if island else host}})
            meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                         "args": {"sort_index": pid}})
        for pid, d, host in sorted(self.threads):
            dev_id = self.device_ids.get((host, d))
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": d,
                         "args": {"name": f"device {d}" + (f" (id {dev_id})" if dev_id is not None else "")}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": d, "args": {"sort_index": d}})
        return meta

    def tail(self) -> dict[str, Any]:
        return {"displayTimeUnit": "ms",
                "otherData": {"origin_unix_ns": self.origin, "node_runs": len(self.records),
                              "devices": len(self.threads)}}

    async def encode(self, chunk: int = TRACE_CHUNK) -> str:
        """The whole trace as compact JSON, yielding to the event loop between chunks."""
        parts = []
        for i in range(0, len(self.records), chunk):
            parts.append(json.dumps(self.events(self.records[i:i + chunk]), separators=(",", ":"))[1:-1])
            await asyncio.sleep(0)
        meta = json.dumps(self.metadata(), separators=(",", ":"))[1:-1]
        if meta:
            parts.append(meta)
        tail = json.dumps(self.tail(), separators=(",", ":"))[1:]
        return '{"traceEvents":[' + ",".join(p for p in parts if p) + "]," + tail


def chrome_trace(records: list[NodeRun], device_ids: dict[DeviceKey, int] | None = None) -> dict[str, Any]:
    """The trace of `records` as a dict (see `TraceBuilder`)."""
    b = TraceBuilder(records, device_ids)
    events = b.events(records)
    return {"traceEvents": events + b.metadata(), **b.tail()}


class _Ring:
    """The last `size` finished node runs, stored column by column: the integers in one array,
    the strings and device tuples as references to objects shared with the run's program,
    session and plan (~0.12 KiB a record; as `NodeRun` objects with their integers and an
    index by job and program they took ~0.5 KiB). Records become `NodeRun`s when read."""

    REFS = ("host", "island", "devices", "program_id", "program", "job", "client", "label", "error")
    INTS = ("run_id", "segment", "size", "seq", "start_ns", "end_ns", "ok")
    PROGRAM_ID, PROGRAM, JOB = REFS.index("program_id"), REFS.index("program"), REFS.index("job")

    def __init__(self, size: int) -> None:
        self.size = size
        self.count = 0  # records ever appended: record p is at slot p % size while p >= count - size
        self._refs: list[Any] = [None] * (len(self.REFS) * size)
        self._ints = array("q", bytes(8 * len(self.INTS) * size))
        self._devices: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple per device set

    def append(self, refs: tuple[Any, ...], ints: tuple[int, ...]) -> None:
        slot = self.count % self.size
        nr, ni = len(self.REFS), len(self.INTS)
        self._refs[slot * nr:(slot + 1) * nr] = refs
        self._ints[slot * ni:(slot + 1) * ni] = array("q", ints)
        self.count += 1

    def shared_devices(self, devices: tuple[int, ...]) -> tuple[int, ...]:
        d = self._devices.get(devices)
        if d is None:
            if len(self._devices) >= 4096:
                return devices
            d = self._devices[devices] = devices
        return d

    def slots(self) -> list[int]:
        """Slots holding records, oldest first."""
        if self.count <= self.size:
            return list(range(self.count))
        head = self.count % self.size
        return list(range(head, self.size)) + list(range(head))

    def columns(self, start: int, end: int) -> tuple[list[Any], list[int]]:
        """Records at positions [start, end) (all still in the ring), column by column, in order."""
        nr, ni, size = len(self.REFS), len(self.INTS), self.size
        refs: list[Any] = []
        ints: list[int] = []
        while start < end:
            slot = start % size
            stop = min(end - start, size - slot) + slot
            refs += self._refs[slot * nr:stop * nr]
            ints += self._ints[slot * ni:stop * ni].tolist()
            start += stop - slot
        return refs, ints

    def column(self, field: int) -> list[Any]:
        """One reference column, by slot (`REFS[field]`)."""
        return self._refs[field::len(self.REFS)]

    def record(self, slot: int) -> NodeRun:
        r, b = self._refs, slot * len(self.REFS)
        i, k = self._ints, slot * len(self.INTS)
        return NodeRun(r[b], r[b + 1], r[b + 2], i[k], i[k + 1], i[k + 2], i[k + 3], r[b + 3], r[b + 4], r[b + 5],
                       r[b + 6], r[b + 7], i[k + 4], i[k + 5], bool(i[k + 6]), r[b + 8])
