"""Live status and traces: what the cluster is doing now and did in the last moments.

The observer listens to every node event the workers report (through the dispatcher) and
keeps, in memory only and bounded whatever the load:

- per device (host, local index): the nodes started there and not yet finished (the oldest
  is the one running: a worker executes a device's nodes in gang order), and busy time in
  100 ms buckets over the last ~5 s, from which utilization is read;
- a ring of the last `ring_size` finished node runs, column by column, for Chrome/Perfetto
  traces (a trace selects its job's or program's records by scanning it: ~50 ms for a full
  ring, once per trace asked for);
- finished-node counts in buckets, for computations per second.

Nothing here touches the database: the hot path never waits on it. Finished node runs outlast
the ring in a `TraceStore` (trace_store.py: segment files in the data directory, written every
0.5 s by a worker thread, size-bounded), so a job's trace is there as long as the retention
keeps it (docs/metrics.md). Times are the workers' wall clocks (time.time_ns); hosts
of one cluster are assumed to keep their clocks in sync (NTP), as every tracing system does.

A node's busy interval starts at max(its launch, the previous end on its devices): workers
launch computations ahead through JAX's async dispatch, so the launch time of a pipelined
node is earlier than the moment its device started on it. Clipping keeps every device's
timeline a sequence, which is both the right utilization and a trace Perfetto draws cleanly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from itertools import compress
from typing import TYPE_CHECKING, Any

from schemas.pathways.v1 import controller_pb2 as cpb

from .cluster import Cluster
from .errors import InvalidArgument, NotFound
from .status_view import StatusQuery, build_status
from .trace import DeviceKey, NodeRun, TraceBuilder, _Ring, chrome_trace
from .trace_store import FLUSH_INTERVAL_S, Segment, TraceStore

if TYPE_CHECKING:
    from ..scheduler import GangScheduler
    from .dispatch import RunState
    from .hangs import HangReporter

log = logging.getLogger(__name__)

RING_SIZE = 20_000  # finished segment runs kept for traces (~0.12 KiB each)
MAX_INFLIGHT_PER_DEVICE = 4096  # started, unfinished nodes remembered per device
MAX_DEVICE_SETS = 4096  # (host, device set)s whose activities are kept at hand (`Observer._activities`)
UTIL_WINDOW_S = 5.0
RATE_WINDOW_S = 3.0
BUCKET_S = 0.1
MIN_WATCH_INTERVAL_S = 0.1
SNAPSHOT_REUSE_S = 0.05  # watchers asking within this long share one snapshot
RECENT_JOBS = 20
MAX_TRACE_RUNS = 200_000  # node runs in one trace without --last (the newest; ~40 MB of JSON)



class BucketWindow:
    """Sums of a quantity over the last `window_s`, in fixed time buckets (O(buckets) memory).

    `add_span` spreads a [start, end) interval's length over the buckets it overlaps (busy
    time); `add_point` adds a value at one instant (counts). `total(now)` sums the buckets of
    the window ending at `now`; `span(now)` is that window's length so far.
    """

    def __init__(self, window_s: float, bucket_s: float = BUCKET_S) -> None:
        self.bucket_ns = int(bucket_s * 1e9)
        self.n = max(1, round(window_s / bucket_s))
        self._ids = [-1] * self.n
        self._vals = [0.0] * self.n
        self._newest = -1  # the newest bucket written: a window ending before it holds nothing

    def _add(self, bucket: int, value: float) -> None:
        i = bucket % self.n
        if self._ids[i] != bucket:
            if self._ids[i] > bucket:
                return  # older than the window: already forgotten
            self._ids[i] = bucket
            self._vals[i] = 0.0
            self._newest = max(self._newest, bucket)
        self._vals[i] += value

    def add_point(self, t_ns: int, value: float = 1.0) -> None:
        self._add(t_ns // self.bucket_ns, value)

    def add_span(self, start_ns: int, end_ns: int) -> None:
        if end_ns <= start_ns:
            return
        start_ns = max(start_ns, end_ns - self.n * self.bucket_ns)  # older parts fall out anyway
        b = start_ns // self.bucket_ns
        while start_ns < end_ns:
            edge = min(end_ns, (b + 1) * self.bucket_ns)
            self._add(b, float(edge - start_ns))
            start_ns = edge
            b += 1

    def first_bucket(self, now_ns: int) -> int:
        return now_ns // self.bucket_ns - self.n + 1

    def total(self, now_ns: int) -> float:
        lo, hi = self.first_bucket(now_ns), now_ns // self.bucket_ns
        if self._newest < lo:  # idle for the whole window (most devices of a large idle cluster)
            return 0.0
        if self._newest <= hi:  # nothing from the future: one pass in C (status reads every device)
            return sum(compress(self._vals, map(lo.__le__, self._ids)))
        return sum(v for b, v in zip(self._ids, self._vals, strict=True) if lo <= b <= hi)

    def span_ns(self, now_ns: int) -> int:
        return max(1, now_ns - self.first_bucket(now_ns) * self.bucket_ns)


@dataclass(slots=True)
class _Running:
    label: str
    start_ns: int
    job: str = ""


class DeviceActivity:
    """One device: its started-but-unfinished nodes (in start order) and recent busy time."""

    def __init__(self) -> None:
        self.inflight: OrderedDict[tuple[int, int], _Running] = OrderedDict()
        self.busy = BucketWindow(UTIL_WINDOW_S)
        self.last_end_ns = 0
        self.last_label = ""  # the node that finished last here, and its job
        self.last_job = ""

    def started(self, key: tuple[int, int], label: str, start_ns: int, job: str = "") -> None:
        self.inflight[key] = _Running(label, start_ns, job)
        while len(self.inflight) > MAX_INFLIGHT_PER_DEVICE:
            self.inflight.popitem(last=False)

    def finished(self, key: tuple[int, int], busy_from_ns: int, end_ns: int, label: str = "",
                 job: str = "") -> None:
        self.inflight.pop(key, None)
        self.busy.add_span(busy_from_ns, end_ns)
        if end_ns >= self.last_end_ns:
            self.last_end_ns, self.last_label, self.last_job = end_ns, label, job

    def running(self) -> _Running | None:
        return next(iter(self.inflight.values()), None)

    def utilization(self, now_ns: int) -> float:
        busy = self.busy.total(now_ns)
        head = self.running()
        if head is not None:  # the node on the device now counts up to this instant
            since = max(head.start_ns, self.last_end_ns, self.busy.first_bucket(now_ns) * self.busy.bucket_ns)
            busy += max(0, now_ns - since)
        return min(1.0, busy / self.busy.span_ns(now_ns))


class Observer:
    """Live status (`Watch`) and traces (`GetTrace`) from node events; see the module doc."""

    def __init__(self, cluster: Cluster, ring_size: int = RING_SIZE, *, scheduler: GangScheduler | None = None,
                 slices: Callable[[], list[cpb.Slice]] | None = None,
                 jobs: Callable[[], list[cpb.Job]] | None = None, hangs: HangReporter | None = None,
                 store: TraceStore | None = None) -> None:
        """`cluster` names hosts and devices; the status view also shows the scheduler's queues,
        the slices and the jobs (each empty when not given), and the gangs `hangs` finds held back;
        traces outlast the ring in `store` when given."""
        self.cluster = cluster
        self.hangs = hangs
        self.scheduler = scheduler
        self.slices = slices
        self.jobs = jobs
        self.ring_size = ring_size
        self._ring = _Ring(ring_size)
        self.store = store
        self._written = 0  # ring position up to which records went to the store
        self.devices: dict[DeviceKey, DeviceActivity] = {}
        self._by_host: dict[str, list[DeviceActivity]] = {}  # the same activities, by host
        # the activities of each (host, device set) events came for (`_node_event`), at most
        # MAX_DEVICE_SETS sets: activities are never removed, so an entry never goes stale
        self._activities: dict[tuple[str, tuple[int, ...]], list[DeviceActivity]] = {}
        self._rate = BucketWindow(RATE_WINDOW_S)
        self.computations_total = 0
        self._cached: dict[StatusQuery, tuple[float, cpb.ClusterStatus]] = {}

    # ------------------------------------------------------------------ events in
    def on_node_event(self, host: str, ev: cpb.NodeEvent, run: RunState | None) -> None:
        """Dispatcher node listener: `ev.end_ns == 0` is a start, anything else a finish.
        Never raises: observing must not break the dispatcher's handling of the event."""
        try:
            self._node_event(host, ev, run)
        except Exception:
            log.exception("observer: cannot record node event %s/%s from %s", ev.run_id, ev.segment, host)

    def _node_event(self, host: str, ev: cpb.NodeEvent, run: RunState | None) -> None:
        # every field read once (each read of a protobuf field builds its value anew), and the
        # event's devices' activities looked up once per device set (`_activities`): a
        # pipelined proxy call costs one finished event here (bench/FINDINGS.md 2026-11-27 h/ctlproxy)
        run_id, segment, start_ns, end_ns = ev.run_id, ev.segment, ev.start_ns, ev.end_ns
        devices = self._ring.shared_devices(tuple(ev.local_devices))
        acts = self._activities.get((host, devices))
        if acts is None:
            acts = [self._device(host, d) for d in devices]
            if len(self._activities) < MAX_DEVICE_SETS:
                self._activities[(host, devices)] = acts
        segments = run.plan.segments if run is not None else ()
        seg = segments[segment] if 0 <= segment < len(segments) else None
        # one str shared by every run of the plan
        label = seg.spec.label if seg is not None else f"run {run_id} segment {segment}"
        session = run.session if run is not None else None
        job = session.job_id if session is not None else ""
        key = (run_id, segment)
        if end_ns == 0:
            for a in acts:
                a.started(key, label, start_ns, job)
            return
        busy_from = max([start_ns] + [a.last_end_ns for a in acts])
        for a in acts:
            a.finished(key, busy_from, end_ns, label, job)
        size = seg.size if seg is not None else 1  # program nodes in the segment (1: the run is gone)
        self.computations_total += size
        self._rate.add_point(end_ns, size)
        h = self.cluster.hosts.get(host)
        program = run.program if run is not None else None
        self._ring.append(
            (host, h.island if h is not None else "", devices,
             program.program_id if program is not None else "", program.name if program is not None else "",
             job, session.client_id if session is not None else "", label, ev.error),
            (run_id, segment, size, ev.seq, min(busy_from, end_ns), end_ns, int(ev.ok)),
        )

    def host_lost(self, host: object, reason: str = "") -> None:
        """Cluster listener: a lost host runs nothing any more. Visits that host's devices only
        (a mass loss at thousands of hosts calls this once per host)."""
        name = getattr(host, "name", host)
        for act in self._by_host.get(str(name), ()):
            act.inflight.clear()

    def _device(self, host: str, local: int) -> DeviceActivity:
        act = self.devices.get((host, local))
        if act is None:
            act = self.devices[(host, local)] = DeviceActivity()
            self._by_host.setdefault(host, []).append(act)
        return act

    def records(self) -> list[NodeRun]:
        """Every record still in the ring, oldest first."""
        return [self._ring.record(slot) for slot in self._ring.slots()]

    # ------------------------------------------------------------------ live status
    def utilization(self, host: str, local: int, now_ns: int | None = None) -> float:
        act = self.devices.get((host, local))
        return act.utilization(now_ns if now_ns is not None else time.time_ns()) if act else 0.0

    def computations_per_s(self, now_ns: int | None = None) -> float:
        now = now_ns if now_ns is not None else time.time_ns()
        return self._rate.total(now) / (self._rate.span_ns(now) / 1e9)

    def snapshot(self, query: StatusQuery | None = None) -> cpb.ClusterStatus:
        """The status update `query` asks for (status_view.py); everything by default."""
        return build_status(self, query or StatusQuery())

    def recent_jobs(self) -> list[cpb.Job]:
        """The pending and running jobs, then the most recent that ended (`RECENT_JOBS` in all)."""
        if self.jobs is None:
            return []
        try:
            listed = self.jobs()
        except Exception:  # the status view must not fail because one component did
            log.exception("listing jobs for the status view failed")
            return []
        running = [j for j in listed if j.state in (cpb.JOB_STATE_PENDING, cpb.JOB_STATE_RUNNING)]
        ended = [j for j in listed if j.state not in (cpb.JOB_STATE_PENDING, cpb.JOB_STATE_RUNNING)]
        ended.sort(key=lambda j: j.ended_at or j.submitted_at, reverse=True)
        return running + ended[: max(0, RECENT_JOBS - len(running))]

    def _shared_snapshot(self, query: StatusQuery) -> cpb.ClusterStatus:
        now = time.monotonic()
        cached = self._cached.get(query)
        if cached is not None and now - cached[0] < SNAPSHOT_REUSE_S:
            return cached[1]
        snap = self.snapshot(query)
        self._cached = {q: c for q, c in self._cached.items() if now - c[0] < SNAPSHOT_REUSE_S}
        self._cached[query] = (now, snap)
        return snap

    async def watch(self, interval_s: float = 1.0, query: StatusQuery | None = None
                    ) -> AsyncIterator[cpb.ClusterStatus]:
        """A snapshot now, then one every `interval_s` (at least 0.1 s) until cancelled."""
        interval = max(MIN_WATCH_INTERVAL_S, interval_s)
        query = query or StatusQuery()
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            yield self._shared_snapshot(query)
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - loop.time()))

    # ------------------------------------------------------------------ traces
    def unwritten(self) -> tuple[list[Any], list[int], int] | None:
        """The ring's records not yet given to the store, as (refs, ints, end position): two
        slices of its columns at most (a copy in C, no Python per record). Records the ring
        overwrote before a flush are gone (more than `ring_size` in one flush interval)."""
        ring = self._ring
        start, end = max(self._written, ring.count - ring.size), ring.count
        if start >= end:
            return None
        return (*ring.columns(start, end), end)

    def written(self, end: int) -> None:
        """The records before ring position `end` are in the store (or could not be kept)."""
        self._written = max(self._written, end)

    async def persist(self, interval_s: float = FLUSH_INTERVAL_S) -> None:
        """Background task: every `interval_s`, the new records go to the store as one segment,
        written by a worker thread. Runs until cancelled; `flush` writes the rest at stop."""
        store = self.store
        if store is None:
            return
        while True:
            await asyncio.sleep(interval_s)
            cols = self.unwritten()
            if cols is None:
                continue
            refs, ints, end = cols
            seg = await asyncio.to_thread(store.write_file, refs, ints)
            if seg is not None:
                store.add(seg)  # on the loop, with `written`: a trace sees each record once
            self.written(end)

    def flush(self) -> None:
        """Writes the records not yet kept, now (the controller stopping)."""
        cols = self.unwritten() if self.store is not None else None
        if self.store is not None and cols is not None:
            seg = self.store.write_file(cols[0], cols[1])
            if seg is not None:
                self.store.add(seg)
            self.written(cols[2])

    def _query(self, job: str, program: str) -> tuple[str, set[str] | None, list[Segment], list[NodeRun]]:
        """On the loop, in one step: the job id and program ids selected, the store's segments
        that may hold them and the matching records only the ring has. Raises NotFound."""
        ring, store = self._ring, self.store
        kept = (f"(node runs are kept up to {store.retention_bytes / 2**20:g} MiB, the oldest go first)"
                if store is not None else f"(only the last {self.ring_size} node runs are kept)")
        first = max(self._written, ring.count - ring.size) if store is not None else ring.count - ring.size
        slots = [p % ring.size for p in range(max(0, first), ring.count)]
        jid, pids = "", None
        if job:
            jobs = ring.column(ring.JOB)
            known = {j for j in jobs if j} | (store.job_ids() if store is not None else set())
            found = _resolve(job, sorted(known), "job")
            if found is None:
                raise NotFound(f"no events recorded for job {job!r} {kept}")
            jid = found
            slots = [s for s in slots if jobs[s] == jid]
        if program:
            pids = self._program_ids(program)
            if not pids:
                raise NotFound(f"no events recorded for program {program!r} {kept}")
            ids = ring.column(ring.PROGRAM_ID)
            slots = [s for s in slots if ids[s] in pids]
        segs = store.select(jid, pids) if store is not None else []
        return jid, pids, segs, [ring.record(s) for s in slots]

    def _window(self, job: str, program: str, records: list[NodeRun], since_ns: int,
                last: int) -> tuple[list[NodeRun], int]:
        """The records of the window asked for (ended at or after `since_ns`; the last `last`,
        or at most `MAX_TRACE_RUNS`), and how many the selection had in all."""
        total = len(records)
        if not records:
            what = " and ".join(f"{k} {v!r}" for k, v in (("job", job), ("program", program)) if v)
            raise NotFound(f"no events recorded{' for ' + what if what else ''}")
        if since_ns:
            records = [r for r in records if r.end_ns >= since_ns]
        records.sort(key=lambda r: r.end_ns)
        keep = min(last, MAX_TRACE_RUNS) if last > 0 else MAX_TRACE_RUNS
        return records[-keep:], total

    def select(self, job: str = "", program: str = "", since_ns: int = 0, last: int = 0) -> list[NodeRun]:
        """Records of a job (id or unique prefix) and/or a program (id, name, or a unique
        prefix of either), kept in the store or still in the ring; everything kept when both
        are empty; windowed by `since_ns`/`last` (see `_window`). Raises NotFound."""
        jid, pids, segs, recent = self._query(job, program)
        return self._window(job, program, TraceStore.read(segs, jid, pids) + recent, since_ns, last)[0]

    def _program_ids(self, name: str) -> set[str]:
        """Program ids `name` selects: an id, a name (every signature registered under it),
        a unique prefix of an id, or else of a name."""
        ring = self._ring
        names = self.store.program_names() if self.store is not None else {}
        names.update({pid: n for pid, n in zip(ring.column(ring.PROGRAM_ID), ring.column(ring.PROGRAM), strict=True)
                      if pid})
        if name in names:
            return {name}
        by_name = {p for p, n in names.items() if n == name}
        if by_name:
            return by_name
        pid = _resolve(name, sorted(names), "program")
        if pid is not None:
            return {pid}
        full = _resolve(name, sorted({n for n in names.values() if n}), "program")
        return {p for p, n in names.items() if full is not None and n == full}

    def trace(self, job: str = "", program: str = "", since_ns: int = 0, last: int = 0) -> str:
        """The Chrome trace JSON of the selected node runs (see `TraceBuilder`)."""
        records = self.select(job, program, since_ns, last)
        return json.dumps(chrome_trace(records, self._device_ids()), separators=(",", ":"))

    async def trace_async(self, job: str = "", program: str = "") -> str:
        """`trace`, built without stalling the event loop (see `trace_window`)."""
        return (await self.trace_window(job, program))[0]

    async def trace_window(self, job: str = "", program: str = "", since_ns: int = 0,
                           last: int = 0) -> tuple[str, int, int]:
        """`trace` as (JSON, node runs selected in all, node runs in it): the store's segments
        read and windowed in a worker thread, the JSON encoded in chunks between which the
        event loop runs (a big trace takes seconds, and the dispatcher must not stall)."""
        jid, pids, segs, recent = self._query(job, program)

        def window() -> tuple[list[NodeRun], int]:
            return self._window(job, program, TraceStore.read(segs, jid, pids) + recent, since_ns, last)

        records, total = await asyncio.to_thread(window)
        return await TraceBuilder(records, self._device_ids()).encode(), total, len(records)

    def _device_ids(self) -> dict[DeviceKey, int]:
        return {(h.name, i): d for h in self.cluster.hosts.values() for i, d in enumerate(h.device_ids)}


def _resolve(name: str, candidates: list[str], what: str) -> str | None:
    """`name` exactly, or the one candidate it is a prefix of; None when nothing matches."""
    if name in candidates:
        return name
    matches = sorted({c for c in candidates if c.startswith(name)})
    if len(matches) > 1:
        shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
        raise InvalidArgument(f"{name!r} matches several {what}s ({shown}); give more of the id")
    return matches[0] if matches else None
