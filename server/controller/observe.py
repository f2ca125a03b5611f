"""Live status and traces: what the cluster is doing now and did in the last moments.

The observer listens to every node event the workers report (through the dispatcher) and
keeps, in memory only and bounded whatever the load:

- per device (host, local index): the nodes started there and not yet finished (the oldest
  is the one running: a worker executes a device's nodes in gang order), and busy time in
  100 ms buckets over the last ~5 s, from which utilization is read;
- a ring of the last `ring_size` finished node runs, with per-job and per-program indexes of
  their positions, for Chrome/Perfetto traces;
- finished-node counts in buckets, for computations per second.

Nothing here touches the database: the hot path never waits on it, and per-node events are
not persisted (DESIGN.md, "State"). Times are the workers' wall clocks (time.time_ns); hosts
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
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from schemas.pathways.v1 import controller_pb2 as cpb

from ..timeutil import now_iso
from .cluster import READY, device_state
from .dispatch import segment_size
from .errors import InvalidArgument, NotFound

if TYPE_CHECKING:
    from .core import Controller
    from .dispatch import RunState

log = logging.getLogger(__name__)

RING_SIZE = 20_000  # finished segment runs kept for traces (~0.6 KiB each with their index entries)
MAX_INDEX_KEYS = 4096  # jobs / programs with an index into the ring
MAX_INFLIGHT_PER_DEVICE = 4096  # started, unfinished nodes remembered per device
UTIL_WINDOW_S = 5.0
RATE_WINDOW_S = 3.0
BUCKET_S = 0.1
MIN_WATCH_INTERVAL_S = 0.1
SNAPSHOT_REUSE_S = 0.05  # watchers asking within this long share one snapshot
RECENT_JOBS = 20
TRACE_CHUNK = 2000  # records encoded between yields to the event loop

DeviceKey = tuple[str, int]  # (host name, local device index)


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

    def _add(self, bucket: int, value: float) -> None:
        i = bucket % self.n
        if self._ids[i] != bucket:
            if self._ids[i] > bucket:
                return  # older than the window: already forgotten
            self._ids[i] = bucket
            self._vals[i] = 0.0
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
        return sum(v for b, v in zip(self._ids, self._vals, strict=True) if lo <= b <= hi)

    def span_ns(self, now_ns: int) -> int:
        return max(1, now_ns - self.first_bucket(now_ns) * self.bucket_ns)


@dataclass(slots=True)
class _Running:
    label: str
    start_ns: int


class DeviceActivity:
    """One device: its started-but-unfinished nodes (in start order) and recent busy time."""

    def __init__(self) -> None:
        self.inflight: OrderedDict[tuple[int, int], _Running] = OrderedDict()
        self.busy = BucketWindow(UTIL_WINDOW_S)
        self.last_end_ns = 0

    def started(self, key: tuple[int, int], label: str, start_ns: int) -> None:
        self.inflight[key] = _Running(label, start_ns)
        while len(self.inflight) > MAX_INFLIGHT_PER_DEVICE:
            self.inflight.popitem(last=False)

    def finished(self, key: tuple[int, int], busy_from_ns: int, end_ns: int) -> None:
        self.inflight.pop(key, None)
        self.busy.add_span(busy_from_ns, end_ns)
        self.last_end_ns = max(self.last_end_ns, end_ns)

    def running(self) -> _Running | None:
        return next(iter(self.inflight.values()), None)

    def utilization(self, now_ns: int) -> float:
        busy = self.busy.total(now_ns)
        head = self.running()
        if head is not None:  # the node on the device now counts up to this instant
            since = max(head.start_ns, self.last_end_ns, self.busy.first_bucket(now_ns) * self.busy.bucket_ns)
            busy += max(0, now_ns - since)
        return min(1.0, busy / self.busy.span_ns(now_ns))


@dataclass(frozen=True, slots=True)
class NodeRun:
    """One finished node run, as kept for traces."""

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


class _Index:
    """key -> ring positions of its records, ascending. Positions leave as the ring overwrites
    them (`forget`), so all keys together never hold more than the ring; keys are capped too."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self.keys: OrderedDict[str, deque[int]] = OrderedDict()

    def add(self, key: str, pos: int) -> None:
        if not key:
            return
        q = self.keys.get(key)
        if q is None:
            q = self.keys[key] = deque()
            while len(self.keys) > self.max_keys:
                self.keys.popitem(last=False)
        else:
            self.keys.move_to_end(key)
        q.append(pos)

    def forget(self, key: str, pos: int) -> None:
        """The ring overwrote position `pos` (the oldest of all, so the left end of its key)."""
        q = self.keys.get(key)
        if q is not None and q and q[0] == pos:
            q.popleft()
            if not q:
                del self.keys[key]


class Observer:
    """Live status (`Watch`) and traces (`GetTrace`) from node events; see the module doc."""

    def __init__(self, core: Controller, ring_size: int = RING_SIZE) -> None:
        self.core = core
        self.ring_size = ring_size
        self._ring: list[NodeRun | None] = [None] * ring_size
        self._next = 0  # position of the next record; record p lives at _ring[p % ring_size]
        self._by_job = _Index(MAX_INDEX_KEYS)
        self._by_program = _Index(MAX_INDEX_KEYS)
        self.devices: dict[DeviceKey, DeviceActivity] = {}
        self._rate = BucketWindow(RATE_WINDOW_S)
        self.computations_total = 0
        self._cached: tuple[float, cpb.ClusterStatus] | None = None

    # ------------------------------------------------------------------ events in
    def on_node_event(self, host: str, ev: cpb.NodeEvent, run: RunState | None) -> None:
        """Dispatcher node listener: `ev.end_ns == 0` is a start, anything else a finish.
        Never raises: observing must not break the dispatcher's handling of the event."""
        try:
            self._node_event(host, ev, run)
        except Exception:
            log.exception("observer: cannot record node event %s/%s from %s", ev.run_id, ev.segment, host)

    def _node_event(self, host: str, ev: cpb.NodeEvent, run: RunState | None) -> None:
        key = (ev.run_id, ev.segment)
        label = _label(ev, run)
        acts = [self._device(host, d) for d in ev.local_devices]
        if ev.end_ns == 0:
            for a in acts:
                a.started(key, label, ev.start_ns)
            return
        busy_from = max([ev.start_ns] + [a.last_end_ns for a in acts])
        for a in acts:
            a.finished(key, busy_from, ev.end_ns)
        size = segment_size(run, ev.segment)
        self.computations_total += size
        self._rate.add_point(ev.end_ns, size)
        h = self.core.cluster.hosts.get(host)
        session = run.session if run is not None else None
        rec = NodeRun(
            host=host,
            island=h.island if h is not None else "",
            devices=tuple(ev.local_devices),
            run_id=ev.run_id,
            segment=ev.segment,
            size=size,
            seq=ev.seq,
            program_id=run.program.program_id if run is not None else "",
            program=run.program.name if run is not None else "",
            job=session.job_id if session is not None else "",
            client=session.client_id if session is not None else "",
            label=label,
            start_ns=min(busy_from, ev.end_ns),
            end_ns=ev.end_ns,
            ok=ev.ok,
            error=ev.error,
        )
        self._append(rec)

    def host_lost(self, host: object, reason: str = "") -> None:
        """Cluster listener: a lost host runs nothing any more."""
        name = getattr(host, "name", host)
        for (h, _), act in self.devices.items():
            if h == name:
                act.inflight.clear()

    def _device(self, host: str, local: int) -> DeviceActivity:
        act = self.devices.get((host, local))
        if act is None:
            act = self.devices[(host, local)] = DeviceActivity()
        return act

    def _append(self, rec: NodeRun) -> None:
        pos = self._next
        slot = pos % self.ring_size
        old = self._ring[slot]
        if old is not None:
            self._by_job.forget(old.job, pos - self.ring_size)
            self._by_program.forget(old.program_id, pos - self.ring_size)
        self._ring[slot] = rec
        self._next += 1
        self._by_job.add(rec.job, pos)
        self._by_program.add(rec.program_id, pos)

    def records(self, positions: Iterable[int] | None = None) -> list[NodeRun]:
        """Records still in the ring, oldest first (all of them, or those at `positions`)."""
        oldest = max(0, self._next - self.ring_size)
        if positions is None:
            positions = range(oldest, self._next)
        out = []
        for p in positions:
            if p >= oldest:
                rec = self._ring[p % self.ring_size]
                if rec is not None:
                    out.append(rec)
        return out

    # ------------------------------------------------------------------ live status
    def utilization(self, host: str, local: int, now_ns: int | None = None) -> float:
        act = self.devices.get((host, local))
        return act.utilization(now_ns if now_ns is not None else time.time_ns()) if act else 0.0

    def computations_per_s(self, now_ns: int | None = None) -> float:
        now = now_ns if now_ns is not None else time.time_ns()
        return self._rate.total(now) / (self._rate.span_ns(now) / 1e9)

    def snapshot(self) -> cpb.ClusterStatus:
        core = self.core
        now_ns = time.time_ns()
        devices = []
        for h in sorted(core.cluster.hosts.values(), key=lambda h: (h.island, h.name)):
            for local, dev_id in enumerate(h.device_ids):
                act = self.devices.get((h.name, local))
                head = act.running() if act is not None and h.state == READY else None
                devices.append(cpb.DeviceStatus(
                    device_id=dev_id, island=h.island, host=h.name, local_index=local,
                    state=device_state(h.state),
                    utilization=round(act.utilization(now_ns), 4) if act is not None else 0.0,
                    running=head.label if head is not None else "",
                ))
        return cpb.ClusterStatus(
            at=now_iso(),
            islands=core.cluster.island_protos(),
            devices=devices,
            slices=core.slices.list(""),
            queues=self._queues(),
            jobs=self._jobs(),
            computations_per_s=round(self.computations_per_s(now_ns), 2),
            computations_total=self.computations_total,
        )

    def _queues(self) -> list[cpb.IslandQueue]:
        sched = self.core.scheduler
        snap = sched.snapshot()
        views = {v.island: v for v in snap.islands}
        out = []
        for island in sorted(set(self.core.cluster.islands) | set(views)):
            v = views.get(island)
            policy = v.policy if v is not None else str(sched.policy(island))
            q = cpb.IslandQueue(island=island, policy=policy)
            if v is not None:
                for state, runs in (("running", v.running), ("waiting", v.waiting)):
                    for r in runs:
                        q.entries.append(cpb.QueueEntry(
                            program=r.program, client=r.client, job=r.job or "", state=state,
                            priority=r.priority, weight=r.weight, reason=r.wait_reason, run_id=r.run_id,
                        ))
            out.append(q)
        return out

    def _jobs(self) -> list[cpb.Job]:
        jobs = getattr(self.core, "jobs", None)
        if jobs is None:
            return []
        try:
            listed = list(jobs.list("", False))
        except Exception:  # the status view must not fail because one component did
            log.exception("listing jobs for the status view failed")
            return []
        running = [j for j in listed if j.state in (cpb.JOB_STATE_PENDING, cpb.JOB_STATE_RUNNING)]
        ended = [j for j in listed if j.state not in (cpb.JOB_STATE_PENDING, cpb.JOB_STATE_RUNNING)]
        ended.sort(key=lambda j: j.ended_at or j.submitted_at, reverse=True)
        return running + ended[: max(0, RECENT_JOBS - len(running))]

    def _shared_snapshot(self) -> cpb.ClusterStatus:
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < SNAPSHOT_REUSE_S:
            return self._cached[1]
        snap = self.snapshot()
        self._cached = (now, snap)
        return snap

    async def watch(self, interval_s: float = 1.0) -> AsyncIterator[cpb.ClusterStatus]:
        """A snapshot now, then one every `interval_s` (at least 0.1 s) until cancelled."""
        interval = max(MIN_WATCH_INTERVAL_S, interval_s)
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            yield self._shared_snapshot()
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - loop.time()))

    # ------------------------------------------------------------------ traces
    def select(self, job: str = "", program: str = "") -> list[NodeRun]:
        """Records of a job (id or unique prefix) and/or a program (id, name, or a unique
        prefix of either); everything kept when both are empty. Raises NotFound."""
        positions: set[int] | None = None
        if job:
            jid = _resolve(job, list(self._by_job.keys), "job")
            if jid is None:
                raise NotFound(f"no events recorded for job {job!r} (only the last {self.ring_size} "
                               "node runs are kept)")
            positions = set(self._by_job.keys[jid])
        if program:
            pids = self._program_ids(program)
            if not pids:
                raise NotFound(f"no events recorded for program {program!r} (only the last {self.ring_size} "
                               "node runs are kept)")
            ppos = {p for pid in pids for p in self._by_program.keys.get(pid, ())}
            positions = ppos if positions is None else positions & ppos
        recs = self.records(sorted(positions) if positions is not None else None)
        if not recs:
            what = " and ".join(f"{k} {v!r}" for k, v in (("job", job), ("program", program)) if v)
            raise NotFound(f"no events recorded{' for ' + what if what else ''} (only the last "
                           f"{self.ring_size} node runs are kept)")
        return recs

    def _program_ids(self, name: str) -> list[str]:
        """Program ids `name` selects: an id, a name (every signature registered under it),
        a unique prefix of an id, or else of a name."""
        index = self._by_program.keys
        if name in index:
            return [name]
        names = {pid: rec.program for pid, q in index.items() if (rec := self._ring[q[-1] % self.ring_size])}
        by_name = [p for p, n in names.items() if n == name]
        if by_name:
            return by_name
        pid = _resolve(name, list(index), "program")
        if pid is not None:
            return [pid]
        full = _resolve(name, sorted({n for n in names.values() if n}), "program")
        return [p for p, n in names.items() if full is not None and n == full]

    def trace(self, job: str = "", program: str = "") -> str:
        """The Chrome trace JSON of the selected node runs (see `TraceBuilder`)."""
        return json.dumps(chrome_trace(self.select(job, program), self._device_ids()), separators=(",", ":"))

    async def trace_async(self, job: str = "", program: str = "") -> str:
        """`trace`, encoded in chunks between which the event loop runs: a trace of the whole
        ring takes seconds to encode, and the dispatcher must not stall meanwhile."""
        return await TraceBuilder(self.select(job, program), self._device_ids()).encode()

    def _device_ids(self) -> dict[DeviceKey, int]:
        return {(h.name, i): d for h in self.core.cluster.hosts.values() for i, d in enumerate(h.device_ids)}


def _label(ev: cpb.NodeEvent, run: RunState | None) -> str:
    if run is not None and 0 <= ev.segment < len(run.plan.segments):
        return run.plan.segments[ev.segment].definition.label
    return f"run {ev.run_id} segment {ev.segment}"


def _resolve(name: str, candidates: list[str], what: str) -> str | None:
    """`name` exactly, or the one candidate it is a prefix of; None when nothing matches."""
    if name in candidates:
        return name
    matches = sorted({c for c in candidates if c.startswith(name)})
    if len(matches) > 1:
        shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
        raise InvalidArgument(f"{name!r} matches several {what}s ({shown}); give more of the id")
    return matches[0] if matches else None


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
