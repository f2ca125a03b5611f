"""The dispatcher in-process: a real gang scheduler and program registry, two hosts, and an outbox
that records what would go to each worker. Every test asserts the exact messages."""

from __future__ import annotations

import asyncio
import hashlib
import sys
from typing import Any

import pytest

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb
from server.controller.client_session import ClientSession
from server.controller.cluster import HostInfo
from server.controller.dispatch import Dispatcher, RunState
from server.controller.errors import InvalidArgument, NotFound
from server.controller.links import WorkerLink
from server.controller.outbox import Outbox, materialized
from server.controller.programs import ProgramRecord, ProgramRegistry, check_devices
from server.controller.relays import Relays
from server.controller.release_acks import ReleaseAcks
from server.controller.segments import Gang
from server.controller.slices import Placement
from server.scheduler import CancelRun, GangScheduler, Policy
from server.worker.relay import Inbox, relayed_message
from server.worker.relay import gang_parts as members_of

pytestmark = pytest.mark.timeout(30)

F = hashlib.sha256(b"f-bytes").hexdigest()
FUNCTION = cpb.FunctionInfo(function_id=F, name="f", exported=b"f-bytes")


class RecordingOutbox:
    """Where the dispatcher's flushes go: (host, message) in the order sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, cpb.ControllerToWorker]] = []

    def send(self, host: str, msg: cpb.ControllerToWorker) -> None:
        self.sent.append((host, msg))

    def take(self) -> list[tuple[str, cpb.ControllerToWorker]]:
        out, self.sent = self.sent, []
        return out

    def by_host(self) -> dict[str, list[cpb.ControllerToWorker]]:
        """What was sent, per host in order; forgets it."""
        out: dict[str, list[cpb.ControllerToWorker]] = {}
        for h, m in self.take():
            out.setdefault(h, []).append(m)
        return out


class Slices:
    """Slice "sa" on host a's device 1, "sb" on host b's device 0; unknown names do not exist."""

    def __init__(self, hosts: dict[str, HostInfo]) -> None:
        self.epoch = 0
        self.where = {"sa": (hosts["a"], 1), "sb": (hosts["b"], 0)}
        self.released: list[str] = []

    def placement(self, name: str) -> Placement:
        if name not in self.where:
            raise NotFound(f"slice {name!r} does not exist (deleted?)")
        host, local = self.where[name]
        return Placement(name, host, [local], 0, host.island)

    def release_owner(self, owner: str) -> None:
        self.released.append(owner)


def host(name: str, device_ids: list[int]) -> HostInfo:
    return HostInfo(id=len(name), name=name, island="i", address=f"{name}:1", pid=1, kind="cpu",
                    machine_id=f"m-{name}", device_ids=device_ids, state="ready")


def out(node: int) -> cpb.ValueRef:
    return cpb.ValueRef(node_output=cpb.NodeOutput(node=node, output=0))


def two_step_graph(name: str = "p") -> cpb.ProgramGraph:
    """n0 on slice sa reads the program input; n1 on slice sb reads n0 and is the output."""
    return cpb.ProgramGraph(name=name, num_inputs=1, outputs=[out(1)], nodes=[
        cpb.ProgramNode(function_id=F, slice="sa", inputs=[cpb.ValueRef(program_input=0)], num_outputs=1, name="n0"),
        cpb.ProgramNode(function_id=F, slice="sb", inputs=[out(0)], num_outputs=1, name="n1"),
    ])


class Parts:
    """A dispatcher and its real collaborators (no network, no processes)."""

    def __init__(self, max_inflight_nodes: int = 256, gang_fast_path: bool = True) -> None:
        self.hosts = {"a": host("a", [10, 11]), "b": host("b", [20, 21])}
        self.outbox = RecordingOutbox()
        self.slices = Slices(self.hosts)
        self.registry = ProgramRegistry()
        self.scheduler = GangScheduler(hang_timeout_s=None, default_policy=Policy("fifo"),
                                       max_inflight_nodes=max_inflight_nodes)
        self.dispatcher = Dispatcher(self.scheduler, self.registry, self.slices, self.hosts, self.by_address,
                                     self.outbox, gang_fast_path=gang_fast_path)
        self.finished: list[tuple[int, bool, str]] = []
        self.dispatcher.run_listeners.append(lambda run, ok, error: self.finished.append((run.run_id, ok, error)))
        for h in self.hosts.values():
            self.dispatcher.host_up(h)

    def by_address(self, address: str) -> HostInfo | None:
        return next((h for h in self.hosts.values() if h.address == address), None)

    def program(self, owner: str = "client:c1") -> ProgramRecord:
        assert self.registry.add_functions([FUNCTION]) == []
        return self.registry.register(two_step_graph(), owner)

    def run(self, session: ClientSession, run_id: int, prog: ProgramRecord, output: int,
            prompt: bool = False) -> RunState:
        self.dispatcher.submit(session, cpb.RunProgram(run_id=run_id, program_id=prog.program_id, input_ids=[100],
                                                       output_ids=[output], input_homes=["a:1"]), prompt=prompt)
        self.dispatcher.flush()
        return self.dispatcher.runs[run_id]

    def report(self, host: str, run_id: int, segment: int, ok: bool = True, error: str = "") -> None:
        self.dispatcher.node_events(host, cpb.NodeEvents(events=[cpb.NodeEvent(
            run_id=run_id, segment=segment, seq=1, start_ns=1_000, end_ns=2_000, ok=ok, error=error,
            local_devices=[0])]))


def session(client_id: str = "c1", sequential: bool = False) -> ClientSession:
    return ClientSession(client_id=client_id, id_prefix=0, name="test", job_id="", priority=0, weight=1.0,
                         sequential=sequential)


def events(s: ClientSession) -> list[cpb.SessionEvent]:
    out: list[Any] = []
    while not s.queue.empty():
        out.append(s.queue.get_nowait())
    return out


def test_a_run_leaves_as_one_enqueue_per_worker_before_any_segment_ran() -> None:
    p = Parts()
    prog, s = p.program(), session()
    run = p.run(s, 7, prog, output=200)
    seg0, seg1 = run.plan.segments
    middle = run.buffers[0][0]  # n0's output: the controller's id, never a client's
    assert middle >> 62 == 1 and run.buffers[1] == [200]
    blob = wpb.FunctionBlob(function_id=F, exported=b"f-bytes", name="f")
    assert p.outbox.take() == [
        ("a", cpb.ControllerToWorker(enqueue=wpb.Enqueue(functions=[blob], segments=[seg0.definition], tasks=[
            wpb.Task(run_id=7, segment=0, seq=1, segment_id=seg0.definition.segment_id, input_ids=[100],
                     output_ids=[middle], output_visible=[False], owner="client:c1")]))),
        ("b", cpb.ControllerToWorker(enqueue=wpb.Enqueue(functions=[blob], segments=[seg1.definition], tasks=[
            wpb.Task(run_id=7, segment=1, seq=1, segment_id=seg1.definition.segment_id, input_ids=[middle],
                     output_ids=[200], output_visible=[True], owner="client:c1")]))),
    ]
    assert [r.address for r in seg0.definition.routes] == ["b:1"]  # n0's output goes to b by itself
    assert events(s) == []

    # the next run: the workers have the function and the segments, only the tasks go
    run2 = p.run(s, 8, prog, output=201)
    sent = p.outbox.take()
    assert [(h, m.enqueue.functions, m.enqueue.segments) for h, m in sent] == [("a", [], []), ("b", [], [])]
    assert [t.run_id for _, m in sent for t in m.enqueue.tasks] == [8, 8]
    assert run2.plan is run.plan  # the plan is cached while slices and hosts stay as they are


def test_reports_finish_the_run_and_tell_the_client_how_many_are_over() -> None:
    p = Parts()
    prog, s = p.program(), session()
    p.run(s, 7, prog, output=200)
    p.outbox.take()
    p.report("a", 7, 0)
    assert events(s) == [] and p.finished == [] and 7 in p.dispatcher.runs
    p.report("b", 7, 1)
    assert events(s) == [cpb.SessionEvent(runs_done=cpb.RunsDone(count=1))]
    assert p.finished == [(7, True, "")] and p.dispatcher.runs == {}
    assert p.outbox.take() == []  # nothing for the workers: the outputs stay until the client frees them


def test_a_prompt_run_s_tasks_are_reported_at_once_and_its_end_wakes_who_waits_for_it() -> None:
    """A run submitted `prompt` (an IFRT proxy client blocking on its calls) has every task
    sent `report_promptly`; `when_over` gives a future its end sets, well or not, and None for
    a run that is not open (over already, or never submitted)."""

    async def scenario() -> None:
        p = Parts()
        prog, s = p.program(), session()
        p.run(s, 7, prog, output=200, prompt=True)
        p.run(s, 8, prog, output=201)
        p.run(s, 9, prog, output=202, prompt=True)
        flags = {(t.run_id, t.segment): t.report_promptly for _, m in p.outbox.take() for t in m.enqueue.tasks}
        assert flags == {(7, 0): True, (7, 1): True, (8, 0): False, (8, 1): False, (9, 0): True, (9, 1): True}
        over7, over9 = s.when_over(7), s.when_over(9)
        assert over7 is not None and over9 is not None and s.when_over(7) is over7
        assert s.when_over(5) is None  # never submitted
        p.report("a", 7, 0)
        assert not over7.done()
        p.report("b", 7, 1)
        assert over7.done() and s.when_over(7) is None  # over: nothing to wait for
        p.report("a", 9, 0, ok=False, error="boom")
        assert over9.done()  # over, badly: the session's events say how
        failed = [e.finished for e in events(s) if e.HasField("finished")]
        assert [(f.run_id, f.ok, f.error.endswith("boom")) for f in failed] == [(9, False, True)]

    asyncio.run(scenario())


def test_a_failed_node_fails_the_run_and_drops_it_where_it_waits() -> None:
    p = Parts()
    prog, s = p.program(), session()
    run = p.run(s, 7, prog, output=200)
    p.outbox.take()
    p.report("a", 7, 0, ok=False, error="boom")
    reason = "node 0 (p/0 n0) failed: boom"
    # (b's copy of n0's output, sent there for n1, is no longer held for it: Drop.routed_ids;
    # an intermediate, no client holds it: a copy that comes later is not kept, Drop.unread_ids)
    assert p.outbox.take() == [("b", cpb.ControllerToWorker(drop=cpb.Drop(
        run_ids=[7], reason=reason, routed_ids=run.buffers[0], unread_ids=run.buffers[0])))]
    assert events(s) == [cpb.SessionEvent(finished=cpb.RunFinished(run_id=7, ok=False, error=reason)),
                         cpb.SessionEvent(runs_done=cpb.RunsDone(count=1))]
    assert p.finished == [(7, False, reason)]


def test_a_lost_host_fails_the_runs_it_held_and_new_plans_leave_it() -> None:
    p = Parts()
    prog, s = p.program(), session()
    p.run(s, 7, prog, output=200)
    p.outbox.take()
    p.hosts["b"].state = "lost"
    p.dispatcher.host_lost(p.hosts["b"], "gone")
    reason = "host b lost: it held node 1 (p/1 n1) of program p"
    assert p.outbox.take() == [("a", cpb.ControllerToWorker(drop=cpb.Drop(run_ids=[7], reason=reason)))]
    assert events(s) == [cpb.SessionEvent(finished=cpb.RunFinished(run_id=7, ok=False, error=reason)),
                         cpb.SessionEvent(runs_done=cpb.RunsDone(count=1))]
    # the slice moved (the slice service remaps it): the next run is cut anew for a alone
    p.slices.where["sb"] = (p.hosts["a"], 0)
    p.slices.epoch += 1
    run = p.run(s, 8, prog, output=201)
    assert [seg.host.name for seg in run.plan.segments] == ["a"]
    assert [h for h, _ in p.outbox.take()] == ["a"]


def test_a_run_of_an_unknown_program_or_the_wrong_arity_is_refused() -> None:
    p = Parts()
    prog, s = p.program(), session()
    p.dispatcher.submit(s, cpb.RunProgram(run_id=1, program_id="p-nope", input_ids=[1], output_ids=[2]))
    p.dispatcher.submit(s, cpb.RunProgram(run_id=2, program_id=prog.program_id, input_ids=[], output_ids=[2]))
    # a program whose registration the session was refused: the error says why it is unknown
    s.program_refused("p-refused", "slice 'x' is degraded: host w-a lost")
    p.dispatcher.submit(s, cpb.RunProgram(run_id=3, program_id="p-refused", input_ids=[1], output_ids=[3]))
    p.dispatcher.flush()
    assert events(s) == [
        cpb.SessionEvent(finished=cpb.RunFinished(
            run_id=1, error="program p-nope is not registered with this controller (a controller forgets the "
                            "programs of sessions that ended; register it first)")),
        cpb.SessionEvent(finished=cpb.RunFinished(
            run_id=2, error="program 'p' takes 1 inputs and gives 1 outputs; the run has 0 and 1")),
        cpb.SessionEvent(finished=cpb.RunFinished(
            run_id=3, error="program p-refused is not registered: its registration was refused (slice 'x' is "
                            "degraded: host w-a lost)")),
        cpb.SessionEvent(runs_done=cpb.RunsDone(count=3)),
    ]
    assert p.outbox.take() == [] and p.dispatcher.runs == {}


def test_forgotten_programs_leave_the_workers_that_have_their_segments() -> None:
    p = Parts()
    prog, s = p.program(), session()
    run = p.run(s, 7, prog, output=200)
    p.outbox.take()
    p.dispatcher.forget_programs([prog.program_id])
    ids = [seg.definition.segment_id for seg in run.plan.segments]
    assert p.outbox.take() == [
        ("a", cpb.ControllerToWorker(enqueue=wpb.Enqueue(forget_segments=[ids[0]]))),
        ("b", cpb.ControllerToWorker(enqueue=wpb.Enqueue(forget_segments=[ids[1]]))),
    ]


def test_an_input_held_by_a_worker_that_is_not_ready_is_refused_at_once() -> None:
    """Waiting for it would hold the worker's gang order until the hang timeout (the trust
    issue's finding 6); an input on another live host makes the run fail if that host is lost."""
    p = Parts()
    prog, s = p.program(), session()
    p.dispatcher.submit(s, cpb.RunProgram(run_id=8, program_id=prog.program_id, input_ids=[100],
                                          output_ids=[300], input_homes=["gone:1"]))
    p.dispatcher.flush()
    assert 8 not in p.dispatcher.runs
    refused = [e.finished for e in events(s) if e.HasField("finished")]
    assert [(f.run_id, f.ok) for f in refused] == [(8, False)]
    assert "input 0 is held by the worker at gone:1, which is not ready" in refused[0].error
    p.hosts["c"] = host("c", [30, 31])  # runs nothing of the program, holds its input
    p.dispatcher.host_up(p.hosts["c"])
    p.dispatcher.submit(s, cpb.RunProgram(run_id=9, program_id=prog.program_id, input_ids=[100],
                                          output_ids=[301], input_homes=["c:1"]))
    p.dispatcher.flush()
    assert "c:1" not in p.dispatcher.runs[9].plan.addresses
    p.dispatcher.host_lost(p.hosts["c"], "gone")
    assert (9, False, "host c lost: it held inputs of program p") in p.finished


def test_a_run_reading_an_output_of_a_refused_run_is_refused_at_once() -> None:
    """A client pipelines its calls: x = f(x) sends the next run before it hears that the last
    was refused. Admitted, that run waited on its worker for an input nobody makes, holding the
    worker's gang order until the hang timeout (60 s; a resumed session whose future still named
    its restarted worker's old address). It is refused at once, naming the first refusal; so is
    the rest of the chain, with the same reason, and releasing the buffer forgets it."""
    p = Parts()
    prog, s = p.program(), session()
    p.dispatcher.submit(s, cpb.RunProgram(run_id=8, program_id=prog.program_id, input_ids=[100],
                                          output_ids=[300], input_homes=["gone:1"]))
    for run_id, read, made in ((9, 300, 301), (10, 301, 302)):  # x = f(x), twice, before the refusal came
        p.dispatcher.submit(s, cpb.RunProgram(run_id=run_id, program_id=prog.program_id, input_ids=[read],
                                              output_ids=[made], input_homes=["a:1"]))
    p.dispatcher.flush()
    assert p.outbox.take() == [] and p.dispatcher.runs == {}
    refused = {e.finished.run_id: e.finished.error for e in events(s) if e.HasField("finished")}
    first = "input 0 is held by the worker at gone:1, which is not ready (lost, or reconnecting): compute it again"
    root = f"run 0x8 that computes it was refused: {first}"
    assert refused == {8: first, 9: f"input 0 (buffer 0x12c) will never be computed: {root}",
                       10: f"input 0 (buffer 0x12d) will never be computed: {root}"}
    assert s.finished == 3  # over, for the client's bound on runs in flight
    # a run reading what exists goes on; one of another session is not concerned
    p.run(s, 11, prog, output=303)
    other = session("c2")
    p.dispatcher.submit(other, cpb.RunProgram(run_id=12, program_id=prog.program_id, input_ids=[300],
                                              output_ids=[304], input_homes=["a:1"]))
    p.dispatcher.flush()
    assert {11, 12} <= set(p.dispatcher.runs)
    assert [e for e in events(other) if e.HasField("finished")] == []


def test_a_run_reading_an_output_of_a_run_cancelled_before_admission_is_refused_at_once() -> None:
    """A run failed while it waited for admission (here cancelled: its upload was lost) never
    reached a worker, so no worker fails its outputs either: a run reading one, pipelined behind
    it, would wait on its worker for an input nobody makes until the hang timeout. It is refused
    at once, naming the first failure; a run that failed on its workers is not concerned (they
    fail its outputs, and its readers with them)."""
    p = Parts(max_inflight_nodes=1)  # one node in flight per island: the second run waits
    prog, s = p.program(), session()
    p.run(s, 8, prog, output=300)
    p.dispatcher.submit(s, cpb.RunProgram(run_id=9, program_id=prog.program_id, input_ids=[300],
                                          output_ids=[301], input_homes=["a:1"]))
    p.dispatcher.flush()
    waiting = {r.run_id for i in p.scheduler.snapshot().islands for r in i.waiting}
    assert 9 in p.dispatcher.runs and 9 in waiting  # waits for admission: nothing of it on a worker
    p.dispatcher.handle(CancelRun(s.client_id, 9, "input lost", 0.0))
    assert (9, False, "input lost") in p.finished
    p.dispatcher.submit(s, cpb.RunProgram(run_id=10, program_id=prog.program_id, input_ids=[301],
                                          output_ids=[302], input_homes=["a:1"]))
    p.dispatcher.flush()
    assert 10 not in p.dispatcher.runs
    refused = {e.finished.run_id: e.finished.error for e in events(s) if e.HasField("finished")}
    assert refused[10] == ("input 0 (buffer 0x12d) will never be computed: run 0x9 that computes it failed "
                           "before it started: input lost"), refused


def one_node_graph(name: str, slice_name: str) -> cpb.ProgramGraph:
    return cpb.ProgramGraph(name=name, num_inputs=1, outputs=[out(0)], nodes=[
        cpb.ProgramNode(function_id=F, slice=slice_name, inputs=[cpb.ValueRef(program_input=0)], num_outputs=1,
                        name="n0")])


def test_runs_submitted_already_that_read_an_output_of_a_run_failed_before_it_started_fail_with_it() -> None:
    """A run waiting for admission on a busy island (A) is cancelled; the run reading its output,
    pipelined behind it and placed on an idle island (B), is admitted by that same pass and sent
    to its worker, which would wait for the input until the hang timeout, holding B's gang
    order. It fails at once, naming the first failure, and is dropped on its worker; so does,
    transitively, the run reading its output (still waiting: it never reaches a worker). A run
    of the session reading something else goes on, and later readers are refused at once. The
    worker told to send the producer's output on to the admitted reader fails it (`never_ids`):
    it would keep it pending, with its send, for good."""
    p = Parts(max_inflight_nodes=1)  # one node in flight per island
    p.hosts["b"].island = "j"  # sa on island i (host a), sb on island j (host b)
    assert p.registry.add_functions([FUNCTION]) == []
    on_a = p.registry.register(one_node_graph("pa", "sa"), "client:c1")
    on_b = p.registry.register(one_node_graph("pb", "sb"), "client:c1")
    s = session()

    def submit(run_id: int, prog: ProgramRecord, input_id: int, home: str, output: int) -> None:
        p.dispatcher.submit(s, cpb.RunProgram(run_id=run_id, program_id=prog.program_id, input_ids=[input_id],
                                              output_ids=[output], input_homes=[home]))

    submit(8, on_a, 100, "a:1", 200)  # admitted: island i is full
    submit(9, on_a, 100, "a:1", 300)  # the producer: waits
    submit(10, on_b, 300, "a:1", 301)  # reads 9's output on island j: waits behind 9 (its client's order)
    submit(11, on_a, 301, "b:1", 302)  # reads 10's output
    submit(12, on_a, 200, "a:1", 303)  # reads 8's: not concerned
    p.dispatcher.flush()
    p.outbox.take()
    p.dispatcher.handle(CancelRun(s.client_id, 9, "input lost", 0.0))
    p.dispatcher.flush()
    first = "run 0x9 that computes it failed before it started: input lost"
    err10 = f"input 0 (buffer 0x12c) will never be computed: {first}"
    err11 = f"input 0 (buffer 0x12d) will never be computed: {first}"
    assert p.finished == [(9, False, "input lost"), (10, False, err10), (11, False, err11)]
    assert sorted(p.dispatcher.runs) == [8, 12]
    sent = p.outbox.by_host()
    # 10 was admitted with 9's failure (island j is idle) and sent to b: dropped there, after it
    assert [m.WhichOneof("msg") for m in sent["b"]] == ["enqueue", "drop"]
    assert [t.run_id for t in sent["b"][0].enqueue.tasks] == [10]
    assert sent["b"][1].drop == cpb.Drop(run_ids=[10], reason=err10)
    # 11 never reached a; a was told to send 9's output to b for 10, and waits for it: it fails it
    sends = [(s.buffer_id, s.address) for m in sent["a"] if m.HasField("enqueue") for s in m.enqueue.sends]
    assert sends == [(300, "b:1")]
    assert [m.drop for m in sent["a"] if m.HasField("drop")] == [cpb.Drop(reason=first, never_ids=[300])]
    assert [(e.finished.run_id, e.finished.error) for e in events(s) if e.HasField("finished")] == [
        (9, "input lost"), (10, err10), (11, err11)]
    p.report("a", 8, 0)  # 8 done: 12 goes on
    assert [t.run_id for m in p.outbox.by_host()["a"] for t in m.enqueue.tasks] == [12]
    submit(13, on_a, 302, "a:1", 304)  # reads 11's output: refused at once
    assert 13 not in p.dispatcher.runs
    assert events(s)[-1].finished == cpb.RunFinished(
        run_id=13, ok=False, error=f"input 0 (buffer 0x12e) will never be computed: {first}")


def test_a_session_remembers_a_bounded_number_of_outputs_that_will_never_be_computed() -> None:
    from server.controller import client_session

    s = session()
    s.never_made(range(client_session.MAX_NEVER_COMPUTED + 10), "refused")
    assert len(s.never_computed) == client_session.MAX_NEVER_COMPUTED
    assert s.uncomputable([5]) is None  # the oldest went first
    assert s.uncomputable([1, client_session.MAX_NEVER_COMPUTED + 9]) == (1, client_session.MAX_NEVER_COMPUTED + 9,
                                                                           "refused")


def gang_parts(gang_fast_path: bool = True) -> tuple[Parts, list[HostInfo]]:
    """Parts with slice "sg" over hosts g0, g1, g2 (island p, 2 devices each: a gang)."""
    from server.controller.segments import Gang

    p = Parts(gang_fast_path=gang_fast_path)
    members = [HostInfo(id=100 + m, name=f"g{m}", island="p", address=f"g{m}:1", pid=1, kind="cpu",
                        machine_id=f"m-g{m}", device_ids=[30 + 2 * m, 31 + 2 * m], state="ready") for m in range(3)]
    for h in members:
        p.hosts[h.name] = h
        p.dispatcher.host_up(h)
    p.outbox.take()
    gang = Gang(generation=4, members=tuple(members), devices=tuple(range(6)),
                member_devices=tuple(tuple(h.device_ids) for h in members), member_of=(0, 0, 1, 1, 2, 2))
    where = p.slices.where

    class GangSlices(Slices):
        def placement(self, name: str) -> Placement:
            if name == "sg":
                return Placement("sg", members[0], list(range(6)), 0, "p", gang=gang)
            return Slices.placement(self, name)

    p.slices = GangSlices(p.hosts)
    p.slices.where = where
    p.dispatcher.plans.placements = p.slices
    return p, members


def test_the_tasks_of_a_gang_node_differ_only_in_segment_seq_and_id() -> None:
    """Members of a gang node get the same ids (a program input held elsewhere sent to each, an
    own part read in place, a part gathered elsewhere under one id) whichever way the dispatcher
    builds their tasks, in every run."""
    p, members = gang_parts()
    graph = cpb.ProgramGraph(name="g", num_inputs=1, outputs=[out(2)], nodes=[
        cpb.ProgramNode(function_id=F, slice="sg", inputs=[cpb.ValueRef(program_input=0)], num_outputs=1, name="n0"),
        cpb.ProgramNode(function_id=F, slice="sg", inputs=[out(0)], num_outputs=1, name="n1"),
        cpb.ProgramNode(function_id=F, slice="sb", inputs=[out(1)], num_outputs=1, name="n2"),
    ])
    assert p.registry.add_functions([FUNCTION]) == []
    prog = p.registry.register(graph, "client:c1")
    s = session()
    for run_id, output in ((7, 200), (8, 201)):
        run = p.run(s, run_id, prog, output=output)
        plan = run.plan
        assert plan.group_of == [0, 0, 0, 1, 1, 1, -1]
        sent = p.outbox.by_host()
        assert [t.buffer_id for m in sent["a"] for t in m.enqueue.sends] == [100, 100, 100]
        assert [t.address for m in sent["a"] for t in m.enqueue.sends] == ["g0:1", "g1:1", "g2:1"]
        n0_out, n1_out, gathered = run.buffers[0][0], run.buffers[3][0], run.gathered[0]
        for m, h in enumerate(members):
            tasks = [t for msg in sent[h.name] for t in msg.enqueue.tasks]
            seg0, seg1 = plan.segments[m], plan.segments[3 + m]
            assert seg0.host is h and seg1.host is h
            assert tasks == [
                wpb.Task(run_id=run_id, segment=m, seq=tasks[0].seq, segment_id=seg0.definition.segment_id,
                         input_ids=[100], output_ids=[n0_out], output_visible=[False], owner="client:c1"),
                wpb.Task(run_id=run_id, segment=3 + m, seq=tasks[1].seq, segment_id=seg1.definition.segment_id,
                         input_ids=[n0_out], output_ids=[n1_out], output_visible=[False], owner="client:c1",
                         route_ids=[gathered]),
            ]
            assert tasks[1].seq == tasks[0].seq + 1 == (run_id - 7) * 2 + 2
        assert [t.input_ids for msg in sent["b"] for t in msg.enqueue.tasks] == [[gathered]]
        for m in range(3):
            p.report(f"g{m}", run_id, m)
            p.report(f"g{m}", run_id, 3 + m)
        p.report("b", run_id, 6)
        assert p.finished[-1] == (run_id, True, "")
        p.outbox.take()


@pytest.mark.parametrize("sequential", [True, False])
def test_a_dropped_run_tells_its_readers_hosts_to_forget_what_they_gather_for_it(sequential: bool) -> None:
    """A gang node's output read on host b is gathered there from the members' parts; when the
    run fails, b's Drop names that gathered id (controller.proto Drop.gathered_ids), so b drops
    the parts the members that finished sent: in sequential dispatch b's reader was never sent
    (its seq is skipped) and nothing else would end them before the worker's idle timeout. The
    members' Drops name nothing gathered: nothing is gathered there."""
    p, _ = gang_parts()
    graph = cpb.ProgramGraph(name="g", num_inputs=1, outputs=[out(1)], nodes=[
        cpb.ProgramNode(function_id=F, slice="sg", inputs=[cpb.ValueRef(program_input=0)], num_outputs=1, name="n0"),
        cpb.ProgramNode(function_id=F, slice="sb", inputs=[out(0)], num_outputs=1, name="n1"),
    ])
    assert p.registry.add_functions([FUNCTION]) == []
    prog = p.registry.register(graph, "client:c1")
    run = p.run(session(sequential=sequential), 7, prog, output=200)
    gathered = run.gathered[0]
    sent = p.outbox.by_host()
    assert [t.input_ids for m in sent.get("b", []) for t in m.enqueue.tasks] == ([] if sequential else [[gathered]])
    p.report("g0", 7, 0)  # g0 finished: its part went to b
    p.report("g1", 7, 1, ok=False, error="boom")
    drops = {h: m.drop for h, msgs in p.outbox.by_host().items() for m in msgs if m.HasField("drop")}
    assert sorted(drops) == ["b", "g2"]
    assert list(drops["b"].gathered_ids) == [gathered] and list(drops["g2"].gathered_ids) == []
    assert list(drops["b"].routed_ids) == list(drops["g2"].routed_ids) == []
    assert list(drops["b"].skipped_seqs) == ([1] if sequential else [])
    assert p.finished == [(7, False, drops["b"].reason)]


def test_a_dropped_sequential_run_tells_its_readers_host_to_free_what_was_sent_there_for_them() -> None:
    """Sequential dispatch: n2 on host c reads n0 (host a) and n1 (host b), and is sent only once
    both finished. n0 finished and sent its output to c, where it is held for n2; n1 failed, so
    n2 never comes: c's Drop names n0's and n1's outputs (Drop.routed_ids) to free the copies."""
    p = Parts()
    p.hosts["c"] = host("c", [30, 31])
    p.dispatcher.host_up(p.hosts["c"])
    p.slices.where["sc"] = (p.hosts["c"], 0)
    p.outbox.take()
    assert p.registry.add_functions([FUNCTION]) == []
    graph = cpb.ProgramGraph(name="r", num_inputs=1, outputs=[out(2)], nodes=[
        cpb.ProgramNode(function_id=F, slice="sa", inputs=[cpb.ValueRef(program_input=0)], num_outputs=1, name="n0"),
        cpb.ProgramNode(function_id=F, slice="sb", inputs=[cpb.ValueRef(program_input=0)], num_outputs=1, name="n1"),
        cpb.ProgramNode(function_id=F, slice="sc", inputs=[out(0), out(1)], num_outputs=1, name="n2"),
    ])
    run = p.run(session(sequential=True), 7, p.registry.register(graph, "client:c1"), output=200)
    assert "c" not in p.outbox.by_host()  # n2 waits for n0 and n1
    p.report("a", 7, 0)
    p.report("b", 7, 1, ok=False, error="boom")
    drops = {h: m.drop for h, msgs in p.outbox.by_host().items() for m in msgs if m.HasField("drop")}
    assert sorted(drops) == ["c"]
    assert list(drops["c"].routed_ids) == [run.buffers[0][0], run.buffers[1][0]]
    assert list(drops["c"].gathered_ids) == [] and list(drops["c"].skipped_seqs) == [1]


def test_a_node_on_part_of_its_slice_runs_on_those_devices_only() -> None:
    """ProgramNode.devices: virtual devices of the slice, in order, mapped through its placement
    (slice "w" is host a's devices 1, 0); the scheduler reserves only those devices."""
    p = Parts()
    p.slices.where["w"] = (p.hosts["a"], 0)
    wide = Placement("w", p.hosts["a"], [1, 0], 0, "i")
    plain = p.slices.placement
    p.slices.placement = lambda name: wide if name == "w" else plain(name)  # type: ignore[method-assign]
    assert p.registry.add_functions([FUNCTION]) == []
    graph = cpb.ProgramGraph(name="part", num_inputs=1, outputs=[out(0)], nodes=[
        cpb.ProgramNode(function_id=F, slice="w", inputs=[cpb.ValueRef(program_input=0)], num_outputs=1, name="n0",
                        devices=[1])])
    check_devices(graph, {"w": (2, False)})
    prog = p.registry.register(graph, "client:c1")
    run = p.run(session(), 7, prog, output=200)
    (seg,) = run.plan.segments
    assert list(seg.definition.local_devices) == [0] and list(seg.definition.nodes[0].local_devices) == [0]
    assert seg.spec.devices == (10,)
    reordered = cpb.ProgramGraph()
    reordered.CopyFrom(graph)
    reordered.nodes[0].devices[:] = [1, 0]
    check_devices(reordered, {"w": (2, False)})
    run = p.run(session(), 8, p.registry.register(reordered, "client:c1"), output=201)
    (seg,) = run.plan.segments
    assert list(seg.definition.nodes[0].local_devices) == [0, 1] and seg.spec.devices == (10, 11)
    for devices, error in (([0, 0], "not distinct"), ([2], "not distinct"), ([-1], "not distinct")):
        reordered.nodes[0].devices[:] = devices
        with pytest.raises(InvalidArgument, match=error):
            check_devices(reordered, {"w": (2, False)})
    reordered.nodes[0].devices[:] = [1]
    check_devices(reordered, {"w": (2, True)})  # on a slice spanning hosts too (segments.narrowed)


def test_a_node_on_part_of_a_slice_spanning_hosts_runs_on_the_hosts_holding_them() -> None:
    """ProgramNode.devices on a multi-host slice (g0, g1, g2, two devices each): devices of one
    member run there as a plain computation on its local devices; devices of several run as a gang
    of those members only, each holding only its chosen devices in the scheduler."""
    p, members = gang_parts()
    gang = p.slices.placement("sg").gang
    assert gang is not None
    numbers = tuple(m * 65536 + d for m in range(3) for d in range(2))
    wide = Placement("sg", members[0], list(numbers), 0, "p",
                     gang=Gang(gang.generation, gang.members, numbers, gang.member_devices, (0, 0, 1, 1, 2, 2)))
    p.slices.placement = lambda name: wide  # type: ignore[method-assign]
    assert p.registry.add_functions([FUNCTION]) == []

    def plan(devices: list[int], run_id: int) -> list[tuple[str, list[int], tuple[int, ...], int]]:
        graph = cpb.ProgramGraph(name=f"part{run_id}", num_inputs=1, outputs=[out(0)], nodes=[
            cpb.ProgramNode(function_id=F, slice="sg", inputs=[cpb.ValueRef(program_input=0)], num_outputs=1,
                            name="n0", devices=devices)])
        check_devices(graph, {"sg": (6, True)})
        run = p.run(session(), run_id, p.registry.register(graph, "client:c1"), output=200 + run_id)
        p.outbox.take()
        return [(s.host.name, list(s.definition.nodes[0].local_devices), s.spec.devices,
                 s.definition.group_generation) for s in run.plan.segments]

    assert plan([3], 7) == [("g1", [1], (33,), 0)]  # one device: a plain computation on its host
    assert plan([5, 4], 8) == [("g2", [1, 0], (35, 34), 0)]  # one host's devices, in the node's order
    # devices of two members, in another order: a gang of g1 and g2 over group-wide numbers
    assert plan([5, 2], 9) == [("g1", [numbers[5], numbers[2]], (32,), 4),
                               ("g2", [numbers[5], numbers[2]], (35,), 4)]
    assert plan(list(range(6)), 10) == [(f"g{m}", list(numbers), (30 + 2 * m, 31 + 2 * m), 4) for m in range(3)]


def test_a_gang_member_s_enqueue_stays_one_message_in_order_when_more_goes_to_its_host() -> None:
    """A host's gang-only Enqueue of a flush (outbox.GangEnqueue) becomes a message when more goes
    into it: a release after it rides on that Enqueue, applied after its task, and a later task
    joins it; a release before it keeps its own message first."""
    template = wpb.Task(run_id=7, segment=0, seq=1, segment_id=11, output_ids=[6], owner="client:c1")
    box = Outbox()
    g = box.gang("g0")
    assert g is not None
    g.append((template, 2, 5, 13))
    box.release("g0", [9])
    assert box.gang("g0") is None  # its Enqueue is a message now: the next task goes into it
    box.enqueue("g0").tasks.add(run_id=8, seq=6)
    member = wpb.Task()
    member.CopyFrom(template)
    member.segment, member.seq, member.segment_id = 2, 5, 13
    assert box.msgs["g0"] == [cpb.ControllerToWorker(enqueue=wpb.Enqueue(
        tasks=[member, wpb.Task(run_id=8, seq=6)], release_ids=[9]))]
    box.release("g1", [4])
    g = box.gang("g1")
    assert g is not None
    g.append((template, 0, 2, 11))
    assert box.msgs["g1"][0] == cpb.ControllerToWorker(release=wpb.ReleaseBuffers(buffer_ids=[4]))
    assert box.msgs["g1"][1] is g and materialized(g).enqueue.tasks[0].segment_id == 11


def test_a_release_keeps_its_owner_on_the_wire_and_one_of_no_ids_is_not_sent() -> None:
    """Releases name their owner (a tombstone left for a buffer not there yet is the owner's, and
    goes with it: server/worker/buffers.py): they join the host's Enqueue or release only when it
    is the same owner's. A release of no ids is no message: naming an owner and no ids, the worker
    would free everything the owner has."""
    box = Outbox()
    box.enqueue("h").tasks.add(run_id=1, seq=1)
    box.release("h", [1, 2], "client:a")
    box.release("h", [3], "client:a")
    box.release("h", [4], "client:b")
    box.release("h", [5], "client:b")
    box.release("h", [], "client:c")
    assert box.msgs["h"] == [
        cpb.ControllerToWorker(enqueue=wpb.Enqueue(tasks=[wpb.Task(run_id=1, seq=1)], release_ids=[1, 2, 3],
                                                   release_owner="client:a")),
        cpb.ControllerToWorker(release=wpb.ReleaseBuffers(buffer_ids=[4, 5], owner="client:b"))]
    box.release("g", [], "client:c")
    assert "g" not in box.msgs


def test_a_session_hears_its_releases_arrived_once_every_worker_they_went_to_handled_them() -> None:
    """release_acks.py: the releases a session made before a check count as arrived once each
    worker they went to acknowledged the messages sent to it up to that check (or its stream
    ended), in the session's order; one for a worker that is not there goes nowhere and is over."""
    hosts = {n: host(n, [0]) for n in ("h1", "h2")}
    for h in hosts.values():
        h.link = WorkerLink(h.name)
        h.link.send(cpb.ControllerToWorker())
    by_address = {h.address: h for h in hosts.values()}
    acks = ReleaseAcks(by_address.get)
    session = ClientSession(client_id="c1", id_prefix=1, name="t", job_id="", priority=0, weight=1.0,
                            sequential=False, ack_releases=True)
    for address, _ids in session.hold_release("h1:1", [1]) + session.hold_release("h2:1", [2]):
        acks.released(session, address)
    assert session.releases_out == 2
    for h in hosts.values():
        h.link.send(cpb.ControllerToWorker())  # the flush's messages: seq 2 on each
    acks.check()
    for address, _ids in session.hold_release("h1:1", [3]):
        acks.released(session, address)
    hosts["h1"].link.send(cpb.ControllerToWorker())  # seq 3 on h1
    acks.check()
    assert session.queue.empty()  # nothing acknowledged yet
    hosts["h1"].link.ack(3)
    acks.check()
    assert session.queue.empty()  # h2 has not handled the first check's release
    hosts["h2"].link.close()  # its stream ended: nothing more will come of it
    acks.check()
    assert session.queue.get_nowait() == cpb.SessionEvent(releases_done=3)
    for address, _ids in session.hold_release("nowhere:1", [4]):
        acks.released(session, address)
    acks.check()
    assert session.queue.get_nowait() == cpb.SessionEvent(releases_done=4)
    acks.released(ClientSession(client_id="c2", id_prefix=2, name="t", job_id="", priority=0, weight=1.0,
                                sequential=False), "h1:1")  # it did not ask: nothing recorded
    acks.check()
    assert session.queue.empty()
    acks.forget(session)


def test_a_relayed_gang_node_s_members_each_get_their_task_from_one_shared_body() -> None:
    """The dispatcher with relays (server/controller/relays.py) over a gang of three hosts in one
    relay group: after the first run (which carries the definitions, each member's own message),
    each run's member tasks leave as one body and the members' numbers, and what each member's
    worker reads from the batch is its task: the group's ids, its own segment, seq and segment id."""
    p, members = gang_parts()
    for h in p.hosts.values():
        h.link = WorkerLink(h.name)
        h.link.send(cpb.ControllerToWorker(registered=cpb.Registered(link=h.link.link_id)))
        h.link.ack(1)
    relays = Relays(p.hosts, lambda island: sorted(n for n, h in p.hosts.items() if h.island == island),
                    min_hosts=2, group_size=4)
    p.dispatcher.sink = relays
    graph = cpb.ProgramGraph(name="g", num_inputs=0, outputs=[out(0)], nodes=[
        cpb.ProgramNode(function_id=F, slice="sg", num_outputs=1, name="n0")])
    assert p.registry.add_functions([FUNCTION]) == []
    prog = p.registry.register(graph, "client:c1")
    s = session()

    def read() -> dict[str, list[cpb.ControllerToWorker]]:
        """Each host's messages, batches opened as its relay and the members' workers would."""
        got: dict[str, list[cpb.ControllerToWorker]] = {}
        for h in p.hosts.values():
            assert h.link is not None
            while not h.link._queue.empty():
                msg = h.link._queue.get_nowait()
                assert isinstance(msg, cpb.ControllerToWorker)
                if msg.WhichOneof("msg") != "relay":
                    got.setdefault(h.name, []).append(msg)
                    continue
                for part in [*msg.relay.messages, *(x for g in msg.relay.gangs for x in members_of(g))]:
                    inbox = Inbox()
                    link = p.hosts[part.host].link
                    assert link is not None
                    inbox.link, inbox.key = link.link_id, link.relay_key
                    inner = relayed_message(part, inbox)
                    assert inner is not None
                    got.setdefault(part.host, []).append(inner)
        return got

    read()
    for run_id in (7, 8, 9):
        p.dispatcher.submit(s, cpb.RunProgram(run_id=run_id, program_id=prog.program_id, output_ids=[200 + run_id]))
        batches = relays.batches
        p.dispatcher.flush()
        assert relays.batches == batches + 1  # one write for the three members
        if run_id > 7:  # the members' Enqueues as one body and their numbers
            [batch] = [m for h in p.hosts.values() for m in h.link._queue._queue]  # type: ignore[union-attr]
            assert isinstance(batch, cpb.ControllerToWorker)
            assert not batch.relay.messages and list(batch.relay.gangs[0].hosts) == ["g0", "g1", "g2"]
        run = p.dispatcher.runs[run_id]
        got = read()
        assert sorted(got) == ["g0", "g1", "g2"]
        for m, h in enumerate(members):
            [msg] = got[h.name]
            assert msg.seq == h.link.next_seq - 1  # type: ignore[union-attr]
            assert [(t.run_id, t.segment, t.segment_id, list(t.output_ids)) for t in msg.enqueue.tasks] == [
                (run_id, m, run.plan.segments[m].definition.segment_id, [200 + run_id])]
            assert msg.enqueue.tasks[0].seq == run_id - 6  # the member's place in its gang order
            assert bool(msg.enqueue.segments) == (run_id == 7)  # definitions with the first run only
        for m in range(3):
            p.report(f"g{m}", run_id, m)
        assert p.finished[-1] == (run_id, True, "")
        for h in members:
            h.link.ack(h.link.next_seq - 1)  # type: ignore[union-attr]
        read()


def test_the_gang_fast_path_and_dispatch_build_the_same_messages() -> None:
    """`Dispatcher._dispatch_all` builds a gang member's Enqueue itself where `_dispatch`'s gang
    branch would add nothing (dispatch.py); a dispatcher without it (`gang_fast_path=False`), which
    sends every Dispatch through `_dispatch`, must send the same messages, run after run: a field
    one of them grew and the other lacks fails this."""
    # n1, the gang node, reads no program input (n0's output, sent from b) and is alone in its
    # members' Dispatches: the fast path's case
    graph = cpb.ProgramGraph(name="g", num_inputs=1, outputs=[out(2)], nodes=[
        cpb.ProgramNode(function_id=F, slice="sb", inputs=[cpb.ValueRef(program_input=0)], num_outputs=1, name="n0"),
        cpb.ProgramNode(function_id=F, slice="sg", inputs=[out(0)], num_outputs=1, name="n1"),
        cpb.ProgramNode(function_id=F, slice="sb", inputs=[out(1)], num_outputs=1, name="n2"),
    ])
    fast, slow = gang_parts()[0], gang_parts(gang_fast_path=False)[0]
    slow.dispatcher._id_base = fast.dispatcher._id_base  # the same buffer ids in both
    # the hosts `_dispatch` built an Enqueue for, per side: watched (sys.setprofile), not replaced
    dispatched: dict[int, list[str]] = {id(fast.dispatcher): [], id(slow.dispatcher): []}
    dispatch_code = Dispatcher._dispatch.__code__

    def watch(frame: Any, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code is dispatch_code:
            dispatched[id(frame.f_locals["self"])].append(frame.f_locals["action"].host)

    sent: list[dict[str, list[cpb.ControllerToWorker]]] = []
    for p in (fast, slow):
        assert p.registry.add_functions([FUNCTION]) == []
        prog = p.registry.register(graph, "client:c1")
        s = session()
        by_run = []
        for run_id, output, prompt in ((7, 200, False), (8, 201, True), (9, 202, False)):
            sys.setprofile(watch)
            try:
                p.run(s, run_id, prog, output=output, prompt=prompt)
            finally:
                sys.setprofile(None)
            by_run.append(p.outbox.by_host())
            p.report("b", run_id, 0)
            for m in range(3):
                p.report(f"g{m}", run_id, 1 + m)
            p.report("b", run_id, 4)
            assert p.finished[-1] == (run_id, True, "")
            by_run.append(p.outbox.by_host())
        sent.append({f"{i}/{h}": msgs for i, run in enumerate(by_run) for h, msgs in run.items()})
    # the fast path was taken: in runs 8 and 9 (n1's segment known on its members), the members
    # after the first (whose Dispatch builds the group's task) never reached `_dispatch`; without
    # it, every member did
    assert dispatched[id(fast.dispatcher)] == ["b", "g0", "g1", "g2", "b", "g0", "b", "g0"]
    assert dispatched[id(slow.dispatcher)] == ["b", "g0", "g1", "g2"] * 3
    assert [[t.segment for t in m.enqueue.tasks] for m in sent[0]["2/g1"]] == [[2]]
    assert sent[0] == sent[1]
