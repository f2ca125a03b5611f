"""Pydantic models of the documented `-o json` views and the user-facing specs.

Every JSON document pwctl prints is `{"apiVersion": "pathways/v1", "kind": ..., ...}`:
lists carry `items`, single objects carry `item`. Timestamps are UTC ISO-8601.
Field names are stable; new fields may be added, none renamed or removed within v1.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb

API_VERSION = "pathways/v1"

T = TypeVar("T", bound=BaseModel)


class View(BaseModel):
    model_config = ConfigDict(frozen=True)


class ListDocument(BaseModel, Generic[T]):
    api_version: str = Field(default=API_VERSION, serialization_alias="apiVersion")
    kind: str
    items: list[T]


class ItemDocument(BaseModel, Generic[T]):
    api_version: str = Field(default=API_VERSION, serialization_alias="apiVersion")
    kind: str
    item: T


def dump(doc: BaseModel) -> str:
    return doc.model_dump_json(by_alias=True, indent=2)


def _enum_name(value: str, prefix: str) -> str:
    return value.removeprefix(prefix).lower()


class ServerInfoView(View):
    version: str
    address: str
    database: str
    uptime_s: float
    started_at: str
    pid: int
    dispatch: str
    islands: int
    hosts: int
    devices: int
    slices: int
    jobs: int  # pending and running
    jobs_total: int  # every job the controller remembers
    policy: str  # the islands' default policy: fifo | priority | fair
    metrics_url: str  # Prometheus metrics, "" when off

    @classmethod
    def of(cls, m: cpb.ServerInfo) -> ServerInfoView:
        return cls(version=m.version, address=m.address, database=m.database, uptime_s=round(m.uptime_s, 3),
                   started_at=m.started_at, pid=m.pid, dispatch=m.dispatch, islands=m.islands,
                   hosts=m.hosts, devices=m.devices, slices=m.slices, jobs=m.jobs, jobs_total=m.jobs_total,
                   policy=m.policy, metrics_url=m.metrics_url)


class IslandView(View):
    name: str
    hosts: int
    devices: int
    available_devices: int
    created_at: str
    group: str = ""  # of an island spanning hosts: its jax.distributed group

    @classmethod
    def of(cls, m: pb.Island) -> IslandView:
        return cls(name=m.name, hosts=m.hosts, devices=m.devices, available_devices=m.available_devices,
                   created_at=m.created_at, group=m.group)


class HostView(View):
    id: int
    name: str
    island: str
    address: str
    state: str
    pid: int
    devices: int
    device_kind: str
    last_heartbeat: str

    @classmethod
    def of(cls, m: pb.Host) -> HostView:
        return cls(id=m.id, name=m.name, island=m.island, address=m.address,
                   state=_enum_name(pb.HostState.Name(m.state), "HOST_STATE_"), pid=m.pid,
                   devices=m.devices, device_kind=m.device_kind, last_heartbeat=m.last_heartbeat)


class DeviceView(View):
    id: int
    island: str
    host: str
    local_index: int
    kind: str
    state: str
    slices: int
    last_heartbeat: str

    @classmethod
    def of(cls, m: pb.Device) -> DeviceView:
        return cls(id=m.id, island=m.island, host=m.host, local_index=m.local_index, kind=m.kind,
                   state=_enum_name(pb.DeviceState.Name(m.state), "DEVICE_STATE_"), slices=m.slices,
                   last_heartbeat=m.last_heartbeat)


class SliceSpecView(View):
    """What was asked for; `mesh` is [] for a 1-D mesh, `island`/`kind` "" when left open."""

    devices: int
    mesh: list[int]
    island: str
    kind: str
    exclusive: bool

    @classmethod
    def of(cls, m: cpb.SliceSpec) -> SliceSpecView:
        return cls(devices=m.devices, mesh=list(m.mesh), island=m.island, kind=m.kind, exclusive=m.exclusive)


class VirtualDeviceView(View):
    """Virtual device `index` of a slice and the physical device it maps to now."""

    index: int
    device_id: int
    island: str
    host: str
    address: str
    local_index: int
    kind: str

    @classmethod
    def of(cls, m: cpb.VirtualDevice) -> VirtualDeviceView:
        return cls(index=m.index, device_id=m.device_id, island=m.island, host=m.host, address=m.address,
                   local_index=m.local_index, kind=m.kind)


class RemapView(View):
    at: str
    reason: str
    old_devices: list[int]
    new_devices: list[int]

    @classmethod
    def of(cls, m: cpb.Remap) -> RemapView:
        return cls(at=m.at, reason=m.reason, old_devices=list(m.old_devices), new_devices=list(m.new_devices))


class SliceView(View):
    """A virtual slice. `state` is ready | remapped | degraded, or "preview" for a dry-run answer."""

    name: str
    state: str
    reason: str
    owner: str
    created_at: str
    generation: int
    programs: int
    spec: SliceSpecView
    devices: list[VirtualDeviceView]
    history: list[RemapView]

    @classmethod
    def of(cls, m: cpb.Slice) -> SliceView:
        state = "preview" if m.state == cpb.SLICE_STATE_UNSPECIFIED else _enum_name(
            cpb.SliceState.Name(m.state), "SLICE_STATE_"
        )
        return cls(name=m.name, state=state, reason=m.reason, owner=m.owner, created_at=m.created_at,
                   generation=m.generation, programs=m.programs, spec=SliceSpecView.of(m.spec),
                   devices=[VirtualDeviceView.of(d) for d in m.devices],
                   history=[RemapView.of(r) for r in m.history])


class JobView(View):
    """A job (`pwctl jobs list/describe -o json`, kinds "JobList" / "Job").

    `state` is pending | running | succeeded | failed | cancelled; `exit_code` is null until the
    driver exited by itself (a driver killed by a signal has none: `reason` names the signal).
    Times are UTC ISO-8601, "" when not reached yet. `slices` are the slices the job owned or
    used, `programs` the programs it registered, `runs` the runs of those that finished;
    `pending_reason` says why its programs wait ("" when nothing waits); `held_back` what holds
    back one of its runs now (a stalled host, before the hang timeout fails it) and `last_hang`
    the last "hang detected" message of its runs ("" when none)."""

    id: str
    name: str
    state: str
    entrypoint: str
    args: list[str]
    exit_code: int | None
    reason: str
    submitted_at: str
    started_at: str
    ended_at: str
    priority: int
    weight: float
    pid: int | None
    slices: list[str]
    programs: int
    runs: int
    pending_reason: str
    held_back: str
    last_hang: str

    @classmethod
    def of(cls, m: cpb.Job) -> JobView:
        return cls(id=m.id, name=m.name, state=_enum_name(cpb.JobState.Name(m.state), "JOB_STATE_"),
                   entrypoint=m.entrypoint, args=list(m.args),
                   exit_code=m.exit_code if m.has_exit_code else None, reason=m.reason,
                   submitted_at=m.submitted_at, started_at=m.started_at, ended_at=m.ended_at,
                   priority=m.priority, weight=m.weight, pid=m.pid or None, slices=list(m.slices),
                   programs=m.programs, runs=m.runs, pending_reason=m.pending_reason, held_back=m.held_back,
                   last_hang=m.last_hang)


def as_jsonable(doc: BaseModel) -> Any:
    return doc.model_dump(by_alias=True, mode="json")


# ---- live status (`pwctl status`, the Watch stream) ----


class DeviceStatusView(View):
    """A device now: `utilization` is its busy fraction over the last ~5 s, `running` the label
    ("program/node function") of the node on it now or, when none, of the last one that ran
    within that window ("" when it ran nothing there), `job` that node's job; `idle_s` is 0 while
    a node runs, else the seconds since its last node ended (-1: never); `host_state` is its
    host's state as `host list` shows it (ready, stalled, reconnecting, lost)."""

    device_id: int
    island: str
    host: str
    local_index: int
    state: str
    utilization: float
    running: str
    job: str
    idle_s: float
    host_state: str

    @classmethod
    def of(cls, m: cpb.DeviceStatus) -> DeviceStatusView:
        return cls(device_id=m.device_id, island=m.island, host=m.host, local_index=m.local_index,
                   state=_enum_name(pb.DeviceState.Name(m.state), "DEVICE_STATE_"),
                   utilization=round(m.utilization, 4), running=m.running, job=m.job, idle_s=m.idle_s,
                   host_state=m.host_state)


class QueueEntryView(View):
    """A run in an island's queue: `state` running | waiting; `reason` why it waits, or for a
    running gang held back by a host, what that host has not done; then `stalled_host` names the
    host and `stalled_s` says for how long ("" and 0 otherwise)."""

    run_id: int
    program: str
    client: str
    job: str
    state: str
    priority: int
    weight: float
    reason: str
    stalled_host: str
    stalled_s: float
    waiting_s: float  # waiting: since submitted; running: since admitted

    @classmethod
    def of(cls, m: cpb.QueueEntry) -> QueueEntryView:
        return cls(run_id=m.run_id, program=m.program, client=m.client, job=m.job, state=m.state,
                   priority=m.priority, weight=m.weight, reason=m.reason, stalled_host=m.stalled_host,
                   stalled_s=m.stalled_s, waiting_s=m.waiting_s)


class IslandQueueView(View):
    """An island's queue: `running`/`waiting`/`stalled` count every gang, `entries` may hold fewer
    (with a queue limit: held back by a host first, then the longest waiting)."""

    island: str
    policy: str  # fifo | priority | fair
    running: int
    waiting: int
    stalled: int
    longest_wait_s: float
    entries: list[QueueEntryView]

    @classmethod
    def of(cls, m: cpb.IslandQueue) -> IslandQueueView:
        return cls(island=m.island, policy=m.policy, running=m.running, waiting=m.waiting, stalled=m.stalled,
                   longest_wait_s=m.longest_wait_s, entries=[QueueEntryView.of(e) for e in m.entries])


class IslandStatusView(View):
    """An island now, over all its devices: hosts (ready, stalled), devices (available, busy:
    running a node now or within the last second) and mean utilization."""

    name: str
    hosts: int
    hosts_ready: int
    hosts_stalled: int
    devices: int
    devices_available: int
    devices_busy: int
    utilization: float

    @classmethod
    def of(cls, m: cpb.IslandStatus) -> IslandStatusView:
        return cls(name=m.name, hosts=m.hosts, hosts_ready=m.hosts_ready, hosts_stalled=m.hosts_stalled,
                   devices=m.devices, devices_available=m.devices_available, devices_busy=m.devices_busy,
                   utilization=round(m.utilization, 4))


class JobStatusView(View):
    """A job as the status view shows it (running and recent ones); `exit_code` null until it ends."""

    id: str
    name: str
    state: str
    submitted_at: str
    started_at: str
    ended_at: str
    exit_code: int | None
    reason: str
    priority: int
    weight: float

    @classmethod
    def of(cls, m: cpb.Job) -> JobStatusView:
        return cls(id=m.id, name=m.name, state=_enum_name(cpb.JobState.Name(m.state), "JOB_STATE_"),
                   submitted_at=m.submitted_at, started_at=m.started_at, ended_at=m.ended_at,
                   exit_code=m.exit_code if m.has_exit_code else None, reason=m.reason or m.pending_reason,
                   priority=m.priority, weight=m.weight)


class ClusterStatusView(BaseModel):
    """`pwctl status -o json` (and each line of `--watch -o json`): the cluster at `at` (UTC).

    `computations_per_s` counts node runs finished per second over the last few seconds;
    `computations_total` those since the controller started. `island_status` summarises each
    island over all its devices; `devices` is every device, or one page of `devices_total` with
    `--limit` (`next_page_token` continues: `--page-token`). `jobs` holds the pending and
    running ones (`jobs_running` of them) and the most recent that ended."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)

    api_version: str = Field(default=API_VERSION, serialization_alias="apiVersion")
    kind: str = "ClusterStatus"
    at: str
    islands: list[IslandView]
    devices: list[DeviceStatusView]
    slices: list[SliceView]
    queues: list[IslandQueueView]
    jobs: list[JobStatusView]
    computations_per_s: float
    computations_total: int
    island_status: list[IslandStatusView]
    hosts_total: int
    devices_total: int
    next_page_token: str
    jobs_running: int

    @classmethod
    def of(cls, m: cpb.ClusterStatus) -> ClusterStatusView:
        return cls(at=m.at, islands=[IslandView.of(i) for i in m.islands],
                   devices=[DeviceStatusView.of(d) for d in m.devices],
                   slices=[SliceView.of(s) for s in m.slices],
                   queues=[IslandQueueView.of(q) for q in m.queues],
                   jobs=[JobStatusView.of(j) for j in m.jobs],
                   computations_per_s=round(m.computations_per_s, 2),
                   computations_total=m.computations_total,
                   island_status=[IslandStatusView.of(i) for i in m.island_status], hosts_total=m.hosts_total,
                   devices_total=m.devices_total, next_page_token=m.next_page_token, jobs_running=m.jobs_running)
