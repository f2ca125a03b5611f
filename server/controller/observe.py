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

Nothing here touches the database: the hot path never waits on it, and per-node events are
not persisted (docs/architecture.md, "State"). Times are the workers' wall clocks (time.time_ns); hosts
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
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from schemas.pathways.v1 import controller_pb2 as cpb

from ..timeutil import now_iso
from .cluster import READY, Cluster, device_state
from .dispatch import segment_size
from .errors import InvalidArgument, NotFound
from .trace import DeviceKey, NodeRun, TraceBuilder, chrome_trace

if TYPE_CHECKING:
    from ..scheduler import GangScheduler
    from .dispatch import RunState
    from .hangs import HangReporter

log = logging.getLogger(__name__)

RING_SIZE = 20_000  # finished segment runs kept for traces (~0.12 KiB each)
MAX_INFLIGHT_PER_DEVICE = 4096  # started, unfinished nodes remembered per device
UTIL_WINDOW_S = 5.0
RATE_WINDOW_S = 3.0
BUCKET_S = 0.1
MIN_WATCH_INTERVAL_S = 0.1
SNAPSHOT_REUSE_S = 0.05  # watchers asking within this long share one snapshot
RECENT_JOBS = 20



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

    def column(self, field: int) -> list[Any]:
        """One reference column, by slot (`REFS[field]`)."""
        return self._refs[field::len(self.REFS)]

    def record(self, slot: int) -> NodeRun:
        r, b = self._refs, slot * len(self.REFS)
        i, k = self._ints, slot * len(self.INTS)
        return NodeRun(r[b], r[b + 1], r[b + 2], i[k], i[k + 1], i[k + 2], i[k + 3], r[b + 3], r[b + 4], r[b + 5],
                       r[b + 6], r[b + 7], i[k + 4], i[k + 5], bool(i[k + 6]), r[b + 8])


class Observer:
    """Live status (`Watch`) and traces (`GetTrace`) from node events; see the module doc."""

    def __init__(self, cluster: Cluster, ring_size: int = RING_SIZE, *, scheduler: GangScheduler | None = None,
                 slices: Callable[[], list[cpb.Slice]] | None = None,
                 jobs: Callable[[], list[cpb.Job]] | None = None, hangs: HangReporter | None = None) -> None:
        """`cluster` names hosts and devices; the status view also shows the scheduler's queues,
        the slices and the jobs (each empty when not given), and the gangs `hangs` finds held back."""
        self.cluster = cluster
        self.hangs = hangs
        self.scheduler = scheduler
        self.slices = slices
        self.jobs = jobs
        self.ring_size = ring_size
        self._ring = _Ring(ring_size)
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
        h = self.cluster.hosts.get(host)
        session = run.session if run is not None else None
        program = run.program if run is not None else None
        self._ring.append(
            (host, h.island if h is not None else "", self._ring.shared_devices(tuple(ev.local_devices)),
             program.program_id if program is not None else "", program.name if program is not None else "",
             session.job_id if session is not None else "", session.client_id if session is not None else "",
             label, ev.error),
            (ev.run_id, ev.segment, size, ev.seq, min(busy_from, ev.end_ns), ev.end_ns, int(ev.ok)),
        )

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

    def snapshot(self) -> cpb.ClusterStatus:
        now_ns = time.time_ns()
        devices = []
        for h in sorted(self.cluster.hosts.values(), key=lambda h: (h.island, h.name)):
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
            islands=self.cluster.island_protos(),
            devices=devices,
            slices=self.slices() if self.slices is not None else [],
            queues=self._queues(),
            jobs=self._jobs(),
            computations_per_s=round(self.computations_per_s(now_ns), 2),
            computations_total=self.computations_total,
        )

    def _queues(self) -> list[cpb.IslandQueue]:
        sched = self.scheduler
        if sched is None:
            return []
        snap = sched.snapshot()
        views = {v.island: v for v in snap.islands}
        stalls = {s.run_id: s for s in self.hangs.stalls()} if self.hangs is not None else {}
        out = []
        for island in sorted(set(self.cluster.islands) | set(views)):
            v = views.get(island)
            policy = v.policy if v is not None else str(sched.policy(island))
            q = cpb.IslandQueue(island=island, policy=policy)
            if v is not None:
                for state, runs in (("running", v.running), ("waiting", v.waiting)):
                    for r in runs:
                        e = cpb.QueueEntry(
                            program=r.program, client=r.client, job=r.job or "", state=state,
                            priority=r.priority, weight=r.weight, reason=r.wait_reason, run_id=r.run_id,
                        )
                        stall = stalls.get(r.run_id)
                        if stall is not None:
                            e.reason, e.stalled_host, e.stalled_s = stall.message, stall.host, round(stall.for_s, 1)
                        q.entries.append(e)
            out.append(q)
        return out

    def _jobs(self) -> list[cpb.Job]:
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
        ring = self._ring
        slots = ring.slots()
        kept = f"(only the last {self.ring_size} node runs are kept)"
        if job:
            jobs = ring.column(ring.JOB)
            jid = _resolve(job, sorted({j for j in jobs if j}), "job")
            if jid is None:
                raise NotFound(f"no events recorded for job {job!r} {kept}")
            slots = [s for s in slots if jobs[s] == jid]
        if program:
            pids = self._program_ids(program)
            if not pids:
                raise NotFound(f"no events recorded for program {program!r} {kept}")
            ids = ring.column(ring.PROGRAM_ID)
            slots = [s for s in slots if ids[s] in pids]
        if not slots:
            what = " and ".join(f"{k} {v!r}" for k, v in (("job", job), ("program", program)) if v)
            raise NotFound(f"no events recorded{' for ' + what if what else ''} {kept}")
        return [ring.record(s) for s in slots]

    def _program_ids(self, name: str) -> set[str]:
        """Program ids `name` selects: an id, a name (every signature registered under it),
        a unique prefix of an id, or else of a name."""
        ring = self._ring
        names = {pid: n for pid, n in zip(ring.column(ring.PROGRAM_ID), ring.column(ring.PROGRAM), strict=True)
                 if pid}
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

    def trace(self, job: str = "", program: str = "") -> str:
        """The Chrome trace JSON of the selected node runs (see `TraceBuilder`)."""
        return json.dumps(chrome_trace(self.select(job, program), self._device_ids()), separators=(",", ":"))

    async def trace_async(self, job: str = "", program: str = "") -> str:
        """`trace`, encoded in chunks between which the event loop runs: a trace of the whole
        ring takes seconds to encode, and the dispatcher must not stall meanwhile."""
        return await TraceBuilder(self.select(job, program), self._device_ids()).encode()

    def _device_ids(self) -> dict[DeviceKey, int]:
        return {(h.name, i): d for h in self.cluster.hosts.values() for i, d in enumerate(h.device_ids)}


def _label(ev: cpb.NodeEvent, run: RunState | None) -> str:
    if run is not None and 0 <= ev.segment < len(run.plan.segments):
        return run.plan.segments[ev.segment].spec.label  # one str shared by every run of the plan
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
