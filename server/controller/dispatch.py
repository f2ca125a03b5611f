"""The dispatcher: the I/O around the gang scheduler.

A registered program, once placed, is cut into segments (`segments.py`: consecutive nodes on
one worker); each segment is registered on its worker once (the plans and what each worker
registered of them: plan_cache.py). A run becomes
a scheduler `RunSpec` with one node per segment, and the scheduler's actions become worker
messages: every segment a worker runs, as a `Task` naming the segment and the run's buffer
ids, leaves as ONE batched Enqueue per worker per flush, before any predecessor ran (parallel
asynchronous dispatch). Per-run work is per segment, not per program node. Messages to one
worker keep their order, so a release never overtakes the enqueue that reads the buffer.
A gang node's member tasks are one `Task` per run (its template) and each member's numbers
(outbox.py): a message is made of them only where one is needed.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from ..scheduler import (
    Action,
    Batch,
    CancelRun,
    ClientGone,
    Dispatch,
    DropRun,
    Event,
    GangScheduler,
    HangDetected,
    HostLost,
    HostUp,
    NodeFinished,
    NodeStarted,
    RunFinished,
    RunSpec,
    Submit,
    Tick,
)
from .client_session import TELL_HANDLED_EVERY, ClientSession, Replan, RunRequest, planned_on_older
from .cluster import HostInfo
from .dispatch_probe import DispatchProbe
from .errors import ControllerError, GroupForming
from .outbox import GangEnqueue, Outbox, WorkerOutbox, add_member, materialized
from .plan_cache import PlanCache
from .plans import Placements, check_spread_inputs, input_hosts
from .programs import ProgramRegistry
from .release_acks import ReleaseAcks
from .runs import RunState, never_reading, peer_inputs_by_host, task_fields, unmade_inputs_elsewhere
from .segments import PROGRAM_INPUT, same_machine

log = logging.getLogger(__name__)

RECENT_RUNS = 4_000  # finished runs kept to attribute their late node events


class Dispatcher:
    """Turns runs into scheduler events and the scheduler's actions into worker messages.

    Collaborators: the scheduler, the program registry, where slices run (`placements`, which
    its plans follow: `plans`, plan_cache.py), the hosts by name (the cluster's live dict) and by
    address, and the outbox a flush sends to.
    `gang_fast_path=False` sends every Dispatch the general way (`_dispatch`), without
    `_dispatch_all`'s inlined gang members: the same messages, the reference tests compare with.
    """

    def __init__(self, scheduler: GangScheduler, registry: ProgramRegistry, placements: Placements,
                 hosts: Mapping[str, HostInfo], host_by_address: Callable[[str], HostInfo | None],
                 outbox: WorkerOutbox, gang_fast_path: bool = True) -> None:
        self.scheduler = scheduler
        self.registry = registry
        self.hosts = hosts
        self.host_by_address = host_by_address
        self.sink = outbox
        self.runs: dict[int, RunState] = {}
        self.plans = PlanCache(placements, self._forgotten)
        self._plan = self.plans.plan
        # what each worker registered (the cache's: `_dispatch` adds to them)
        self._host_functions, self._host_segments = self.plans.host_functions, self.plans.host_segments
        self._ids = itertools.count(1)
        self._id_base = random.getrandbits(20) << 40 | (1 << 62)  # controller ids never meet client ids
        self._outbox = Outbox()
        self._last_end: dict[tuple[str, int], int] = {}
        self.node_listeners: list[Callable[[str, cpb.NodeEvent, RunState | None], None]] = []
        self.run_listeners: list[Callable[[RunState, bool, str], None]] = []
        self.hang_listeners: list[Callable[[HangDetected], None]] = []
        self._recent: OrderedDict[int, RunState] = OrderedDict()
        self._progressed: set[ClientSession] = set()  # sessions with runs finished since the last flush
        # outputs of runs failed before they started, whose session's runs reading them are yet
        # to be failed (`_fail_readers`): session -> buffer id -> why it will never be computed
        self._unmade: dict[ClientSession, dict[int, str]] = {}
        self.probe = DispatchProbe.from_env()  # None unless benchmarking (dispatch_probe.py)
        self.release_acks = ReleaseAcks(host_by_address)  # which releases reached their workers (release_acks.py)
        self._dispatches: Callable[[list[Action], int], None] = (
            self._dispatch_all if gang_fast_path else self._dispatch_each)

    # ---- runs ----
    def submit(self, session: ClientSession, run: RunRequest, batch: list[Submit] | None = None,
               wait: bool = False, prompt: bool = False) -> None:
        """Starts a run; with `batch`, its Submit is collected for one scheduler pass. With
        `wait`, a run on a slice whose island group is forming raises GroupForming (nothing
        done: the caller waits for the group and submits it again) instead of being refused.
        `prompt`: its workers report its end at once (someone here waits for it)."""
        if self.probe is not None:
            self.probe.arrived(run.run_id)
        lost = session.uncomputable(run.input_ids)
        if lost is not None:  # pipelined behind a run refused a moment ago
            k, b, why = lost
            error = f"input {k} (buffer {b:#x}) will never be computed: {why}"
            self.refuse(session, run.run_id, Replan(error) if isinstance(why, Replan) else error, run.output_ids, why)
            return
        prog = self.registry.programs.get(run.program_id)
        try:
            if prog is None:
                raise ControllerError(session.unknown_program(run.program_id))
            graph = prog.graph
            if len(run.input_ids) != graph.num_inputs or len(run.output_ids) != len(prog.outputs):
                raise ControllerError(
                    f"program {prog.name!r} takes {graph.num_inputs} inputs and gives {len(prog.outputs)} outputs; "
                    f"the run has {len(run.input_ids)} and {len(run.output_ids)}"
                )
            plan = self._plan(prog, session.sequential)
            if run.slice_generations and len(run.slice_generations) != len(plan.generations):
                raise ControllerError(  # not its client's plan (not to be sent again): a short line
                    f"run {run.run_id:#x} carries {len(run.slice_generations)} slice generations; its program "
                    f"runs on {len(plan.generations)} slices ({', '.join(map(repr, sorted(prog.slices)))})")
            if run.slice_generations and run.slice_generations != plan.generations:  # a slice moved since
                self.refuse(session, run.run_id, planned_on_older(run, sorted(prog.slices), plan.generations),
                            run.output_ids, generations=plan.generations)
                return
            check_spread_inputs(plan, run.input_homes)
            reads_from = input_hosts(plan, run.input_homes, self.host_by_address)
        except ControllerError as e:
            if wait and isinstance(e, GroupForming):
                raise
            self.refuse(session, run.run_id, str(e), run.output_ids)
            return
        session.run_opened(run.run_id)
        if run.slice_generations:  # its client keeps it until told it was handled (client_session.py)
            session.untold += 1
            if session.untold >= TELL_HANDLED_EVERY:
                self._progressed.add(session)
        if session.never_computed:  # a run sent again (RunFinished.replan) makes what the refused one did not
            for b in run.output_ids:
                session.never_computed.pop(b, None)
        out_ids = list(run.output_ids)
        # one id per program value: the members of a gang node hold their parts of it under one id
        # (and share one list of them: nothing changes a run's lists)
        ids: dict[tuple[int, int], int] = {}
        lists = [[out_ids[k] if k >= 0 else ids.setdefault(key, self._id_base | next(self._ids))
                  for k, key in layout] for layout in plan.layouts]
        buffers = [lists[i] for i in plan.layout_of]
        gathered = [self._id_base | next(self._ids) for _ in range(plan.gathered)]
        self.runs[run.run_id] = RunState(run.run_id, session, prog, plan, list(run.input_ids),
                                         list(run.input_homes), buffers, gathered, prompt=prompt)
        spec = RunSpec(
            run_id=run.run_id,
            program=prog.name,
            client=session.client_id,
            job=session.job_id or None,
            nodes=plan.specs,
            priority=session.priority,
            weight=session.weight,
            sequential=session.sequential,
            reads_from=reads_from,
        )
        event = Submit(spec, time.monotonic())
        if batch is None:
            self.handle(event)
        else:
            batch.append(event)

    def refuse(self, session: ClientSession, run_id: int, why: str, outputs: Sequence[int] = (),
               root: str = "", generations: list[int] | None = None) -> None:
        """Refuses a run before it started: the client hears `why` as the run's error (a
        `Replan`: to plan it anew, its slices' `generations` now). Its `outputs` will never be
        computed: the session's later runs that read one are refused too, naming `root` (the
        first refusal of a chain: by default, this one)."""
        session.run_refused(run_id, why, generations)
        if outputs:
            session.never_made(outputs, root or (Replan(why) if isinstance(why, Replan) else
                                                 f"run {run_id:#x} that computes it was refused: {why}"))
        self._progressed.add(session)
        if self.probe is not None:
            self.probe.finished(run_id, False, 0)

    def forget_programs(self, program_ids: list[str]) -> None:
        """Programs no client uses any more: their segments leave the workers."""
        self.plans.forget(program_ids)
        self.flush()

    def _forgotten(self, host: str, segment_id: int) -> None:
        """The plan cache's: the worker `host` is to forget a segment (at the next flush)."""
        self._outbox.enqueue(host).forget_segments.append(segment_id)

    # ---- scheduler I/O ----
    def handle(self, event: Event) -> None:
        self.apply(self.scheduler.handle(event))

    def apply(self, actions: list[Action]) -> None:
        self._apply(actions)
        while self._unmade:
            self._fail_readers()

    def _apply(self, actions: list[Action]) -> None:
        for i, a in enumerate(actions):
            if type(a) is Dispatch:  # the scheduler gives them last
                self._dispatches(actions, i)
                return
            self._other(a)

    def _dispatch_each(self, actions: list[Action], start: int) -> None:  # gang_fast_path=False
        for k in range(start, len(actions)):
            self._other(actions[k])

    def _other(self, a: Action) -> None:
        if isinstance(a, Dispatch):
            self._dispatch(a)
        elif isinstance(a, RunFinished):
            self._finished(a)
        elif isinstance(a, DropRun):
            self._drop(a)
        elif isinstance(a, HangDetected):
            if not self.hang_listeners:
                log.error("hang detected: %s", a.message)
            for cb in self.hang_listeners:
                cb(a)

    def _dispatch_all(self, actions: list[Action], start: int) -> None:
        """`actions[start:]` (Dispatches: the scheduler gives them last). A gang member (the only node of its host's
        Dispatch: a gang run's admission makes hundreds) whose host has its segment, nothing else
        in this flush and no program input to fetch is one GangEnqueue (outbox.py) made here, its
        run's things looked up once for all its members; the others go through `_dispatch`.

        That is `_dispatch`'s gang branch where it adds nothing, inlined: every member through
        `_dispatch` costs 0.88 -> 1.91 ms for 512 members, 68 -> 87 lines of server/ per member
        (bench/FINDINGS.md 2026-11-27), on the 5 ms gang-admission path. Change both alike (tests: test_dispatcher)."""
        msgs, runs, known = self._outbox.msgs, self.runs, self._host_segments
        run_id, run, templates, group_of, segment_ids, reads_input = -1, None, {}, [], [], []
        for k in range(start, len(actions)):
            a = actions[k]
            if type(a) is not Dispatch:
                self._other(a)
                continue
            if len(a.nodes) == 1 and a.host not in msgs:
                d = a.nodes[0]
                if d.run_id != run_id:
                    run_id, run = d.run_id, runs.get(d.run_id)
                    if run is not None and not run.session.sequential:
                        plan = run.plan
                        templates, group_of = run.templates, plan.group_of
                        segment_ids, reads_input = plan.segment_ids, plan.reads_input
                    else:
                        templates, group_of = {}, []
                i = d.node_index
                if group_of:
                    group = group_of[i]
                    sid = segment_ids[i]
                    if group >= 0 and not reads_input[i] and (template := templates.get(group)) is not None and (
                            segs := known.get(a.host)) is not None and sid in segs:  # (a lost host has none)
                        msgs[a.host] = [GangEnqueue(((template, i, d.seq, sid),))]
                        continue
            self._dispatch(a)

    def _dispatch(self, action: Dispatch) -> None:
        name = action.host
        host = self.hosts.get(name)
        if host is None:
            return
        outbox, runs = self._outbox, self.runs
        enq: wpb.Enqueue | None = None  # the host's Enqueue as a message, once something needs one
        segments = self._host_segments.get(name)
        if segments is None:
            segments = self._host_segments[name] = set()
        sends: dict[str, list[tuple[int, str]]] = {}
        for d in action.nodes:
            run = runs.get(d.run_id)
            if run is None:
                continue
            seg = run.plan.segments[d.node_index]
            definition = seg.definition
            if definition.segment_id not in segments:
                if enq is None:
                    enq = outbox.enqueue(host.name)
                functions = self._host_functions.setdefault(host.name, set())
                for n in definition.nodes:
                    if n.function_id not in functions:
                        f = self.registry.functions[n.function_id]
                        enq.functions.append(wpb.FunctionBlob(function_id=f.function_id, exported=f.exported,
                                                              name=f.name, donate=list(f.donate)))
                        functions.add(n.function_id)
                enq.segments.append(definition)
                segments.add(definition.segment_id)
            group = run.plan.group_of[d.node_index]
            if group >= 0 and not run.session.sequential:
                # a gang member: the group's task (built for its first member) with this member's
                # segment, seq and id; kept as such until a message is needed (outbox.py); its
                # commonest case is inlined in `_dispatch_all`
                template = run.templates.get(group)
                if template is None:
                    template = run.templates[group] = wpb.Task(**task_fields(run, d, seg, host, sends))
                else:  # its program inputs held elsewhere still go to this member's host
                    for source, k in seg.inputs:
                        if source == PROGRAM_INPUT:
                            home = run.input_homes[k]
                            if home and home != host.address and "|" not in home:
                                sends.setdefault(home, []).append((run.input_ids[k], host.address))
                if enq is None:
                    gang = outbox.gang(name)
                    if gang is not None:
                        gang.append((template, d.node_index, d.seq, definition.segment_id))
                        continue
                    enq = outbox.enqueue(host.name)
                add_member(enq.tasks, template, d.node_index, d.seq, definition.segment_id)
                continue
            if enq is None:
                enq = outbox.enqueue(host.name)
            # built in place (an append would copy it)
            enq.tasks.add(**task_fields(run, d, seg, host, sends))
        for home, items in sends.items():
            src = self.host_by_address(home)
            if src is None:
                continue
            out = outbox.enqueue(src.name)
            for bid, dest in dict.fromkeys(items):
                out.sends.append(wpb.BufferSend(buffer_id=bid, address=dest, same_host=same_machine(src, host)))

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
            if a.unstarted:  # no worker will make or fail its outputs: the runs reading them fail
                outputs = run.all_buffers()
                why = f"run {a.run_id:#x} that computes it failed before it started: {a.error}"
                run.session.never_made(outputs, why)  # those submitted later: refused (`submit`)
                if len(run.session.open_runs) > 1:  # those submitted already: `_fail_readers`
                    self._unmade.setdefault(run.session, {}).update(dict.fromkeys(outputs, why))
        owner = run.session.owner
        for address, ids in run.session.run_closed(a.run_id):
            self.release(address, ids, owner)
            self.release_acks.released(run.session, address)
        self._progressed.add(run.session)
        for address, ids in run.held_ids.items():
            self.release(address, ids, owner)
        for cb in self.run_listeners:
            cb(run, a.ok, a.error)
        if self.probe is not None:
            self.probe.finished(a.run_id, a.ok, len(run.plan.segments))

    def _fail_readers(self) -> None:
        """Fails the runs submitted already (waiting, or admitted: their workers wait for the
        input) reading an output of a run that failed before it started, and the runs reading
        theirs, in one scheduler pass (the admitted ones dropped on their workers: DropRun).
        One look at those sessions' open runs, at the (rare) failure. The workers an admitted
        reader had send it such an input fail it (`Drop.never_ids`): it would stay pending there."""
        unmade, self._unmade = self._unmade, {}
        now = time.monotonic()
        first = {b: why for lost in unmade.values() for b, why in lost.items()}  # before readers join
        doomed = [d for session, lost in unmade.items()
                  for d in never_reading(self.runs, list(session.open_runs), lost)]
        if not doomed:
            return
        self._apply(self.scheduler.handle(Batch(tuple(
            CancelRun(run.session.client_id, run.run_id, error, now) for run, error, _ in doomed), now)))
        for address, ids in unmade_inputs_elsewhere((run for run, _, _ in doomed), first.keys()).items():
            if (host := self.host_by_address(address)) is not None:
                self._outbox.other(host.name, cpb.ControllerToWorker(drop=cpb.Drop(reason=first[ids[0]],
                                                                                  never_ids=ids)))
        for run, _, why in doomed:  # what a later reader of theirs is refused with
            run.session.never_made(run.all_buffers(), why)
        for session, lost in unmade.items():  # their readers were found above
            again = self._unmade.get(session)
            if again is not None:
                for b in lost:
                    again.pop(b, None)
                if not again:
                    del self._unmade[session]

    def _drop(self, a: DropRun) -> None:
        skipped: dict[str, list[int]] = {}
        for s in a.skipped:
            skipped.setdefault(s.host, []).append(s.seq)
        run = self.runs.get(a.run_id) or self._recent.get(a.run_id)
        peer_inputs = peer_inputs_by_host(run) if run is not None else {}
        for h in set(a.hosts) | set(skipped):
            gathered, routed, unread = peer_inputs.get(h, ((), (), ()))
            self._outbox.other(h, cpb.ControllerToWorker(
                drop=cpb.Drop(run_ids=[a.run_id], reason=a.reason, skipped_seqs=skipped.get(h, []),
                              gathered_ids=gathered, routed_ids=routed, unread_ids=unread)))

    def release(self, address: str, ids: list[int], owner: str = "") -> None:
        """`owner`'s buffers `ids` released on the worker at `address` (at the next flush)."""
        host = self.host_by_address(address)
        if host is not None:
            self._outbox.release(host.name, ids, owner)

    def move(self, buffer_id: int, owner: str, source: str, targets: Sequence[str], keep_source: bool) -> bool:
        """Has the worker at address `source` send `owner`'s buffer to each worker of `targets`,
        worker to worker, which keep it for the client as an upload (`BufferKeep`); `source` drops
        its copy once sent unless `keep_source`. Sent at the next flush; False (nothing done) when
        one of them is not a registered worker."""
        src = self.host_by_address(source)
        dests = [self.host_by_address(t) for t in targets]
        if src is None or any(d is None for d in dests):
            return False
        for dest in dests:
            assert dest is not None
            self._outbox.enqueue(dest.name).keeps.add(buffer_id=buffer_id, owner=owner)
        out = self._outbox.enqueue(src.name)
        for dest in dests:
            assert dest is not None
            out.sends.add(buffer_id=buffer_id, address=dest.address, same_host=same_machine(src, dest))
        if not keep_source:  # applied after the sends took their reference
            if out.release_ids and out.release_owner != owner:
                self._outbox.release(src.name, [buffer_id], owner)
            else:
                out.release_owner = owner
                out.release_ids.append(buffer_id)
        return True

    def flush(self) -> None:
        """Sends everything decided since the last flush: one message per host and kind, and to
        each client whose runs finished meanwhile, how many of its runs are over."""
        outbox, self._outbox = self._outbox, Outbox()
        progressed, self._progressed = self._progressed, set()
        for session in progressed:
            session.report_finished()
        send_all = getattr(self.sink, "send_all", None)
        if send_all is not None:
            send_all(outbox.msgs)  # relays.py: through relays where several hosts of a group have messages
        else:
            send = self.sink.send
            for name, msgs in outbox.msgs.items():
                for m in msgs:
                    send(name, materialized(m))
        if self.probe is not None:
            self.probe.flushed()

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
                batch.append(NodeStarted(ev.run_id, ev.segment, now))
                continue
            busy_from = ev.start_ns
            for d in ev.local_devices:
                key = (host, d)
                busy_from = max(busy_from, last_end.get(key, 0))
                last_end[key] = ev.end_ns
            batch.append(NodeFinished(ev.run_id, ev.segment, ev.ok, ev.error,
                                      max(0, ev.end_ns - busy_from) / 1e9, now))
        self.handle(Batch(tuple(batch), now))
        self.flush()

    def host_up(self, host: HostInfo) -> None:
        self.plans.host_changed(host.name)
        self.handle(HostUp(host.name, time.monotonic()))
        self.flush()

    def host_lost(self, host: HostInfo, reason: str) -> None:
        self.plans.host_changed(host.name)
        self.handle(HostLost(host.name, time.monotonic()))
        self.flush()

    def client_gone(self, client_id: str) -> None:
        self.handle(ClientGone(client_id, time.monotonic()))
        self.flush()

    def tick(self) -> None:
        self.handle(Tick(time.monotonic()))
        self.flush()

