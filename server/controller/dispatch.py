"""The dispatcher: the I/O around the gang scheduler.

A run of a registered program becomes a scheduler `RunSpec` (one node per sharded
computation, whatever its number of shards). The scheduler's actions become worker
messages: every node a worker takes part in, with its input and output buffer ids and
where to send its outputs, leaves as ONE batched Enqueue per worker per flush, before
any predecessor ran (parallel asynchronous dispatch). Messages to one worker keep their
order, so a release never overtakes the enqueue that reads the buffer.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from ..scheduler import (
    Action,
    Batch,
    ClientGone,
    Dispatch,
    DropRun,
    Event,
    GangScheduler,
    HangDetected,
    HostLost,
    HostUp,
    NodeFinished,
    NodeSpec,
    NodeStarted,
    RunFinished,
    RunSpec,
    Submit,
    Tick,
)
from .cluster import HostInfo
from .errors import ControllerError
from .programs import ProgramRecord

if TYPE_CHECKING:
    from .core import Controller
    from .sessions import ClientSession

log = logging.getLogger(__name__)

RECENT_RUNS = 10_000


@dataclass
class Plan:
    """Where a program's nodes run for one placement of its slices (cached per program)."""

    key: tuple[Any, ...]
    hosts: list[HostInfo]
    devices: list[list[int]]
    specs: tuple[NodeSpec, ...]
    routes: list[list[wpb.OutputRoute]]
    labels: list[str]
    epoch: tuple[int, int] = (-1, -1)  # (slice epoch, host epoch) it was last checked at


@dataclass
class RunState:
    run_id: int
    session: ClientSession
    program: ProgramRecord
    plan: Plan
    input_ids: list[int]
    input_homes: list[str]
    buffers: list[list[int]]  # node -> its output buffer ids
    visible: list[list[bool]]
    submitted: float = field(default_factory=time.monotonic)
    # sequential dispatch: intermediates a later node on the same host reads are kept by the worker
    # (its reader is not enqueued yet, so the worker would free them); released when the run ends
    held: list[list[bool]] | None = None
    held_ids: dict[str, list[int]] = field(default_factory=dict)  # worker address -> held buffer ids


class Outbox:
    """Per-host ordered messages of one flush; consecutive enqueues/releases merge."""

    def __init__(self) -> None:
        self.msgs: dict[str, list[cpb.ControllerToWorker]] = {}

    def _last(self, host: str, kind: str) -> cpb.ControllerToWorker:
        q = self.msgs.setdefault(host, [])
        if not q or q[-1].WhichOneof("msg") != kind:
            q.append(cpb.ControllerToWorker())
            getattr(q[-1], kind).SetInParent()
        return q[-1]

    def enqueue(self, host: str) -> wpb.Enqueue:
        return self._last(host, "enqueue").enqueue

    def release(self, host: str, ids: list[int]) -> None:
        q = self.msgs.get(host)
        if q and q[-1].WhichOneof("msg") == "enqueue":
            q[-1].enqueue.release_ids.extend(ids)  # applied after that message's nodes
        else:
            self._last(host, "release").release.buffer_ids.extend(ids)

    def other(self, host: str, msg: cpb.ControllerToWorker) -> None:
        self.msgs.setdefault(host, []).append(msg)


class Dispatcher:
    def __init__(self, core: Controller, scheduler: GangScheduler) -> None:
        self.core = core
        self.scheduler = scheduler
        self.runs: dict[int, RunState] = {}
        self._plans: dict[str, Plan] = {}
        self._host_functions: dict[str, set[str]] = {}
        self._ids = itertools.count(1)
        self._id_base = random.getrandbits(20) << 40 | (1 << 62)  # controller ids never meet client ids
        self._outbox = Outbox()
        self._last_end: dict[tuple[str, int], int] = {}
        self.node_listeners: list[Callable[[str, cpb.NodeEvent, RunState | None], None]] = []
        self.run_listeners: list[Callable[[RunState, bool, str], None]] = []
        self.computations = 0
        self._recent: OrderedDict[int, RunState] = OrderedDict()
        self._host_epoch = 0

    # ---- runs ----
    def submit(self, session: ClientSession, run: cpb.RunProgram, batch: list[Submit] | None = None) -> None:
        """Starts a run; with `batch`, its Submit is collected for one scheduler pass."""
        prog = self.core.registry.programs.get(run.program_id)
        try:
            if prog is None:
                raise ControllerError(f"program {run.program_id} is not registered (register it first)")
            graph = prog.graph
            if len(run.input_ids) != graph.num_inputs or len(run.output_ids) != len(prog.outputs):
                raise ControllerError(
                    f"program {prog.name!r} takes {graph.num_inputs} inputs and gives {len(prog.outputs)} outputs; "
                    f"the run has {len(run.input_ids)} and {len(run.output_ids)}"
                )
            plan = self._plan(prog)
        except ControllerError as e:
            session.run_failed(run.run_id, str(e))
            return
        session.run_opened(run.run_id)
        buffers: list[list[int]] = []
        visible: list[list[bool]] = []
        out_index = {key: k for k, key in enumerate(prog.outputs)}
        for i, node in enumerate(graph.nodes):
            ids, vis = [], []
            for o in range(node.num_outputs):
                k = out_index.get((i, o))
                ids.append(run.output_ids[k] if k is not None else self._id_base | next(self._ids))
                vis.append(k is not None)
            buffers.append(ids)
            visible.append(vis)
        state = RunState(
            run.run_id, session, prog, plan, list(run.input_ids), list(run.input_homes), buffers, visible
        )
        if session.sequential:
            state.held = [
                [not visible[i][o] and any(plan.hosts[r].name == plan.hosts[i].name
                                           for r in prog.consumers.get((i, o), ()))
                 for o in range(node.num_outputs)]
                for i, node in enumerate(graph.nodes)
            ]
        self.runs[run.run_id] = state
        prog.runs += 1
        spec = RunSpec(
            run_id=run.run_id,
            program=prog.name,
            client=session.client_id,
            job=session.job_id or None,
            nodes=plan.specs,
            priority=session.priority,
            weight=session.weight,
            sequential=session.sequential,
        )
        event = Submit(spec, time.monotonic())
        if batch is None:
            self.handle(event)
        else:
            batch.append(event)

    def _plan(self, prog: ProgramRecord) -> Plan:
        epoch = (self.core.slices.epoch, self._host_epoch)
        plan = self._plans.get(prog.program_id)
        if plan is not None and plan.epoch == epoch:
            return plan  # nothing about slices or hosts changed since it was made
        graph = prog.graph
        placements = {name: self.core.slices.placement(name) for name in sorted(prog.slices)}
        key = tuple(
            (n, p.generation, p.host.name, p.host.address, tuple(p.local_devices)) for n, p in placements.items()
        )
        if plan is not None and plan.key == key:
            plan.epoch = epoch
            return plan
        hosts = [placements[n.slice].host for n in graph.nodes]
        devices = [list(placements[n.slice].local_devices) for n in graph.nodes]
        specs = []
        routes: list[list[wpb.OutputRoute]] = []
        labels = []
        for i, node in enumerate(graph.nodes):
            label = f"{prog.name}/{i} {node.name}".strip()
            labels.append(label)
            specs.append(NodeSpec(index=i, host=hosts[i].name, island=placements[node.slice].island,
                                  devices=tuple(hosts[i].device_ids[d] for d in devices[i]), collective=node.collective,
                                  deps=prog.deps[i], label=label))
            node_routes = []
            for o in range(node.num_outputs):
                seen = set()
                for reader in prog.consumers.get((i, o), []):
                    h = hosts[reader]
                    if h.name != hosts[i].name and h.name not in seen:
                        seen.add(h.name)
                        node_routes.append(wpb.OutputRoute(output_index=o, address=h.address,
                                                           same_host=_same_machine(h, hosts[i])))
            routes.append(node_routes)
        plan = Plan(key, hosts, devices, tuple(specs), routes, labels, epoch)
        self._plans[prog.program_id] = plan
        return plan

    # ---- scheduler I/O ----
    def handle(self, event: Event) -> None:
        self.apply(self.scheduler.handle(event))

    def apply(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Dispatch):
                self._dispatch(a)
            elif isinstance(a, RunFinished):
                self._finished(a)
            elif isinstance(a, DropRun):
                self._drop(a)
            elif isinstance(a, HangDetected):
                log.error("hang detected: %s", a.message)

    def _dispatch(self, action: Dispatch) -> None:
        host = self.core.cluster.hosts.get(action.host)
        if host is None:
            return
        enq = self._outbox.enqueue(host.name)
        known = self._host_functions.setdefault(host.name, set())
        sends: dict[str, list[tuple[int, str]]] = {}
        for d in action.nodes:
            run = self.runs.get(d.run_id)
            if run is None:
                continue
            graph = run.program.graph
            node = graph.nodes[d.node_index]
            if node.function_id not in known:
                f = self.core.registry.functions[node.function_id]
                enq.functions.append(wpb.FunctionBlob(function_id=f.function_id, exported=f.exported,
                                                      name=f.name, donate=list(f.donate)))
                known.add(node.function_id)
            inputs = []
            for ref in node.inputs:
                if ref.WhichOneof("source") == "program_input":
                    bid = run.input_ids[ref.program_input]
                    home = run.input_homes[ref.program_input]
                    if home and home != host.address:
                        sends.setdefault(home, []).append((bid, host.address))
                    inputs.append(bid)
                else:
                    inputs.append(run.buffers[ref.node_output.node][ref.node_output.output])
            enq.nodes.append(
                wpb.NodeExec(
                    run_id=d.run_id,
                    node_index=d.node_index,
                    seq=d.seq,
                    function_id=node.function_id,
                    local_devices=run.plan.devices[d.node_index],
                    input_ids=inputs,
                    output_ids=run.buffers[d.node_index],
                    routes=run.plan.routes[d.node_index],
                    collective=node.collective,
                    output_visible=_keep(run, d.node_index, host.address),
                    owner=run.session.owner,
                    label=run.plan.labels[d.node_index],
                )
            )
        for home, items in sends.items():
            src = self.core.cluster.host_by_address(home)
            if src is None:
                continue
            out = self._outbox.enqueue(src.name)
            for bid, dest in dict.fromkeys(items):
                out.sends.append(wpb.BufferSend(buffer_id=bid, address=dest, same_host=_same_machine(src, host)))

    def _finished(self, a: RunFinished) -> None:
        run = self.runs.pop(a.run_id, None)
        if run is None:
            return
        # reports of its nodes may still be on their way (a client that exits right after
        # its last fetch cancels runs the workers already ran): keep it for attribution
        self._recent[a.run_id] = run
        if len(self._recent) > RECENT_RUNS:
            self._recent.popitem(last=False)
        if not a.ok:
            run.session.run_failed(a.run_id, a.error)
        for address, ids in run.session.run_closed(a.run_id):
            self.release(address, ids)
        for address, ids in run.held_ids.items():
            self.release(address, ids)
        for cb in self.run_listeners:
            cb(run, a.ok, a.error)

    def _drop(self, a: DropRun) -> None:
        skipped: dict[str, list[int]] = {}
        for s in a.skipped:
            skipped.setdefault(s.host, []).append(s.seq)
        for h in set(a.hosts) | set(skipped):
            self._outbox.other(h, cpb.ControllerToWorker(
                drop=cpb.Drop(run_ids=[a.run_id], reason=a.reason, skipped_seqs=skipped.get(h, []))))

    def release(self, address: str, ids: list[int]) -> None:
        host = self.core.cluster.host_by_address(address)
        if host is not None:
            self._outbox.release(host.name, ids)

    def flush(self) -> None:
        """Sends everything decided since the last flush: one message per host and kind."""
        outbox, self._outbox = self._outbox, Outbox()
        for name, msgs in outbox.msgs.items():
            host = self.core.cluster.hosts.get(name)
            if host is None or host.link is None:
                continue
            for m in msgs:
                host.link.send(m)

    # ---- worker events ----
    def node_events(self, host: str, events: cpb.NodeEvents) -> None:
        """A worker's batch of node reports: one scheduler pass for all of them."""
        now = time.monotonic()
        batch: list[NodeStarted | NodeFinished] = []
        last_end = self._last_end
        for ev in events.events:
            if self.node_listeners:
                run = self.runs.get(ev.run_id) or self._recent.get(ev.run_id)
                for cb in self.node_listeners:
                    cb(host, ev, run)
            if ev.end_ns == 0:
                batch.append(NodeStarted(ev.run_id, ev.node_index, now))
                continue
            busy_from = ev.start_ns
            for d in ev.local_devices:
                key = (host, d)
                busy_from = max(busy_from, last_end.get(key, 0))
                last_end[key] = ev.end_ns
            self.computations += 1
            batch.append(NodeFinished(ev.run_id, ev.node_index, ev.ok, ev.error,
                                      max(0, ev.end_ns - busy_from) / 1e9, now))
        self.handle(Batch(tuple(batch), now))
        self.flush()

    def host_up(self, host: HostInfo) -> None:
        self._host_epoch += 1
        self._host_functions.pop(host.name, None)
        self.handle(HostUp(host.name, time.monotonic()))
        self.flush()

    def host_lost(self, host: HostInfo, reason: str) -> None:
        self._host_epoch += 1
        self._host_functions.pop(host.name, None)
        self.handle(HostLost(host.name, time.monotonic()))
        self.flush()

    def client_gone(self, client_id: str) -> None:
        self.handle(ClientGone(client_id, time.monotonic()))
        self.flush()

    def tick(self) -> None:
        self.handle(Tick(time.monotonic()))
        self.flush()


def _keep(run: RunState, index: int, address: str) -> list[bool]:
    """The outputs the worker keeps after the node ran: the client's, and in sequential dispatch
    those a later node on the same worker reads (recorded, to release when the run ends)."""
    if run.held is None or not any(run.held[index]):
        return run.visible[index]
    held = run.held[index]
    run.held_ids.setdefault(address, []).extend(b for b, h in zip(run.buffers[index], held, strict=True) if h)
    return [v or h for v, h in zip(run.visible[index], held, strict=True)]


def _same_machine(a: HostInfo, b: HostInfo) -> bool:
    return bool(a.machine_id) and a.machine_id == b.machine_id
