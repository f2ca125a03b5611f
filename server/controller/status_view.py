"""The status update (`Watch`, `pwctl status`): the cluster now, summarised per island, with one
page of devices and a bounded number of queue entries per island.

Built on the event loop from what the observer, the cluster, the scheduler and the hang reporter
hold in memory (no database). Its cost grows with the hosts (one pass for the island summaries)
and with the page asked for, not with the devices of the whole cluster: devices that never ran a
node have no activity record and count as idle without being visited one by one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb

from ..scheduler import GangScheduler
from ..timeutil import now_iso
from .cluster import READY, Cluster, device_state, host_state
from .errors import InvalidArgument
from .hangs import HangReporter
from .hostviews import _decode, _encode, _hosts_from


class _Running(Protocol):
    label: str
    job: str


class Activity(Protocol):
    """What the status reads of one device's activity (observe.DeviceActivity)."""

    last_end_ns: int
    last_label: str
    last_job: str

    def running(self) -> _Running | None: ...

    def utilization(self, now_ns: int) -> float: ...


class Observer(Protocol):
    """What the status is built from (observe.Observer; a protocol, so that neither module
    imports the other)."""

    cluster: Cluster
    hangs: HangReporter | None
    scheduler: GangScheduler | None
    slices: Callable[[], list[cpb.Slice]] | None
    computations_total: int

    @property
    def devices(self) -> Mapping[tuple[str, int], Activity]: ...

    def recent_jobs(self) -> list[cpb.Job]: ...

    def computations_per_s(self, now_ns: int | None = None) -> float: ...

BUSY_WITHIN_S = 1.0  # a device that finished a node this recently counts as busy


@dataclass(frozen=True, slots=True)
class StatusQuery:
    """What one status update holds: `device_limit` devices from `page_token` on (0: all) and
    at most `queue_limit` entries per island queue (0: all)."""

    device_limit: int = 0
    page_token: str = ""
    queue_limit: int = 0

    @classmethod
    def of(cls, request: cpb.WatchRequest) -> StatusQuery:
        if request.device_limit < 0 or request.queue_limit < 0:
            raise InvalidArgument("device_limit and queue_limit must not be negative")
        query = cls(request.device_limit, request.page_token, request.queue_limit)
        _decode(query.page_token, 3)  # a bad token is refused before the stream starts
        return query


def host_state_name(state: pb.HostState.ValueType) -> str:
    return pb.HostState.Name(state).removeprefix("HOST_STATE_").lower()


def build_status(obs: Observer, query: StatusQuery) -> cpb.ClusterStatus:
    now_ns = time.time_ns()
    cluster = obs.cluster
    stalled = obs.hangs.stalled_hosts() if obs.hangs is not None else {}
    status = cpb.ClusterStatus(at=now_iso(), islands=cluster.island_protos())
    # utilization and busy devices per island, from the devices that ever ran something
    util: dict[str, float] = {}
    busy: dict[str, int] = {}
    for (host_name, _), act in obs.devices.items():
        h = cluster.hosts.get(host_name)
        if h is None or h.state != READY:
            continue
        u = act.utilization(now_ns)
        util[h.island] = util.get(h.island, 0.0) + u
        if act.running() is not None or (act.last_end_ns and now_ns - act.last_end_ns < BUSY_WITHIN_S * 1e9):
            busy[h.island] = busy.get(h.island, 0) + 1
    stalled_per_island: dict[str, int] = {}
    for name in stalled:
        h = cluster.hosts.get(name)
        if h is not None:
            stalled_per_island[h.island] = stalled_per_island.get(h.island, 0) + 1
    for isl in status.islands:
        ready = sum(1 for h in cluster.hosts_of(isl.name) if h.state == READY)
        status.island_status.add(
            name=isl.name, hosts=isl.hosts, hosts_ready=ready, hosts_stalled=stalled_per_island.get(isl.name, 0),
            devices=isl.devices, devices_available=isl.available_devices, devices_busy=busy.get(isl.name, 0),
            utilization=round(util.get(isl.name, 0.0) / isl.devices, 4) if isl.devices else 0.0)
    status.hosts_total = len(cluster.hosts)
    status.devices_total = sum(i.devices for i in status.islands)
    _devices(obs, query, status, stalled, now_ns)
    status.slices.extend(obs.slices() if obs.slices is not None else [])
    status.queues.extend(_queues(obs, query.queue_limit))
    jobs = obs.recent_jobs()
    status.jobs.extend(jobs)
    status.jobs_running = sum(1 for j in jobs if j.state in (cpb.JOB_STATE_PENDING, cpb.JOB_STATE_RUNNING))
    status.computations_per_s = round(obs.computations_per_s(now_ns), 2)
    status.computations_total = obs.computations_total
    return status


def _devices(obs: Observer, query: StatusQuery, status: cpb.ClusterStatus, stalled: dict[str, str],
             now_ns: int) -> None:
    """One page of devices, in (island, host, local index) order, each with what runs on it."""
    after = _decode(query.page_token, 3)
    limit = query.device_limit
    out = status.devices
    for h in _hosts_from(obs.cluster, "", after):
        first = int(after[2]) + 1 if after is not None and [h.island, h.name] == after[:2] else 0
        state = host_state_name(host_state(h.state))
        if h.name in stalled and h.state == READY:
            state = "stalled"
        for local in range(first, len(h.device_ids)):
            if limit and len(out) == limit:
                last = out[-1]
                status.next_page_token = _encode([last.island, last.host, last.local_index])
                return
            d = out.add(device_id=h.device_ids[local], island=h.island, host=h.name, local_index=local,
                        state=device_state(h.state), host_state=state, idle_s=-1.0)
            act = obs.devices.get((h.name, local))
            if act is None:
                continue
            d.utilization = round(act.utilization(now_ns), 4)
            head = act.running() if h.state == READY else None
            if head is not None:
                d.running, d.job, d.idle_s = head.label, head.job, 0.0
            elif act.last_label and act.last_end_ns:
                idle = max(0.0, (now_ns - act.last_end_ns) / 1e9)
                d.idle_s = round(idle, 2)
                if d.utilization > 0 or idle < BUSY_WITHIN_S:  # it ran this within the utilization window
                    d.running, d.job = act.last_label, act.last_job


def _queues(obs: Observer, limit: int) -> list[cpb.IslandQueue]:
    """Each island's queue: counts over every gang, and the entries (every one, or the `limit`
    most telling: held back by a host, then the longest waiting, then the oldest running)."""
    sched = obs.scheduler
    if sched is None:
        return []
    snap = sched.snapshot()
    views = {v.island: v for v in snap.islands}
    stalls = {s.run_id: s for s in obs.hangs.stalls()} if obs.hangs is not None else {}
    mono = time.monotonic()
    out = []
    for island in sorted(set(obs.cluster.islands) | set(views)):
        v = views.get(island)
        policy = v.policy if v is not None else str(sched.policy(island))
        q = cpb.IslandQueue(island=island, policy=policy)
        entries: list[cpb.QueueEntry] = []
        if v is not None:
            for state, runs in (("running", v.running), ("waiting", v.waiting)):
                for r in runs:
                    since = r.admitted_at if state == "running" and r.admitted_at is not None else r.submitted_at
                    e = cpb.QueueEntry(
                        program=r.program, client=r.client, job=r.job or "", state=state, priority=r.priority,
                        weight=r.weight, reason=r.wait_reason, run_id=r.run_id,
                        waiting_s=round(max(0.0, mono - since), 1))
                    stall = stalls.get(r.run_id)
                    if stall is not None:
                        e.reason, e.stalled_host, e.stalled_s = stall.message, stall.host, round(stall.for_s, 1)
                    entries.append(e)
            q.running, q.waiting = len(v.running), len(v.waiting)
            q.stalled = sum(1 for e in entries if e.stalled_host)
            q.longest_wait_s = max((e.waiting_s for e in entries if e.state == "waiting"), default=0.0)
        if limit:
            entries.sort(key=lambda e: (not e.stalled_host, e.state != "waiting", -e.waiting_s))
            entries = entries[:limit]
        q.entries.extend(entries)
        out.append(q)
    return out
