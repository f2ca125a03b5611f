"""The session manager in-process, over a real dispatcher, scheduler and program registry (see
test_dispatcher.py): registration, the release barrier, a session's stream and its end. The
outbox and `broadcast` record what would go to the workers; every test asserts exact messages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb
from server.controller.client_session import ClientSession
from server.controller.errors import GroupForming, InvalidArgument
from server.controller.programs import ProgramRecord
from server.controller.sessions import SessionManager
from server.controller.slices import Placement
from tests.test_dispatcher import FUNCTION, Parts, Slices, events, session, two_step_graph

pytestmark = pytest.mark.timeout(30)


class Sessions(Parts):
    def __init__(self) -> None:
        super().__init__()
        self.broadcasts: list[cpb.ControllerToWorker] = []
        self.manager = SessionManager(self.dispatcher, self.registry, self.slices, self.broadcasts.append)
        self.registered: list[tuple[str, str]] = []
        self.manager.program_listeners.append(lambda s, prog: self.registered.append((s.client_id, prog.program_id)))

    def open(self, client_id: str = "c1") -> ClientSession:
        s = session(client_id)
        self.manager.sessions[s.client_id] = s
        return s

    def send(self, s: ClientSession, *msgs: cpb.ClientMessage) -> None:
        """What the session's reader does with each message: handle it, then flush."""
        for m in msgs:
            self.manager.handle(s, m)
            self.dispatcher.flush()

    def register(self, s: ClientSession) -> ProgramRecord:
        self.send(s, cpb.ClientMessage(register=cpb.RegisterProgram(request_id=1, graph=two_step_graph(),
                                                                    functions=[FUNCTION])))
        (ev,) = events(s)
        return self.registry.programs[ev.registered.program_id]


def run(run_id: int, prog: ProgramRecord, output: int) -> cpb.ClientMessage:
    return cpb.ClientMessage(run=cpb.RunProgram(run_id=run_id, program_id=prog.program_id, input_ids=[100],
                                                output_ids=[output], input_homes=["a:1"]))


def release(*ids: int, address: str = "b:1") -> cpb.ClientMessage:
    return cpb.ClientMessage(release=wpb.ReleaseBuffers(address=address, buffer_ids=list(ids)))


def release_msg(*ids: int, owner: str = "client:c1") -> cpb.ControllerToWorker:
    """A release as the worker gets it: naming its session's owner (a tombstone it leaves is the owner's)."""
    return cpb.ControllerToWorker(release=wpb.ReleaseBuffers(buffer_ids=list(ids), owner=owner))


def test_registration_asks_for_missing_functions_then_registers() -> None:
    p = Sessions()
    s = p.open()
    graph = two_step_graph()
    lazy = cpb.FunctionInfo(function_id=FUNCTION.function_id, name="f")  # no bytes yet
    p.send(s, cpb.ClientMessage(register=cpb.RegisterProgram(request_id=1, graph=graph, functions=[lazy])))
    assert events(s) == [cpb.SessionEvent(registered=cpb.ProgramRegistered(
        request_id=1, missing_functions=[FUNCTION.function_id]))]
    prog = p.register(s)
    assert prog.owners == {"client:c1"} and p.registered == [("c1", prog.program_id)]

    graph.nodes[1].slice = "gone"
    p.send(s, cpb.ClientMessage(register=cpb.RegisterProgram(request_id=3, graph=graph, functions=[FUNCTION])))
    assert events(s) == [cpb.SessionEvent(registered=cpb.ProgramRegistered(
        request_id=3, error="slice 'gone' does not exist (deleted?)"))]
    assert p.outbox.take() == []


def test_a_release_waits_for_every_run_submitted_before_it() -> None:
    p = Sessions()
    s = p.open()
    prog = p.register(s)
    p.send(s, run(1, prog, 201), release(200), run(2, prog, 202))
    # run 1 may still read buffer 200 (its enqueue left, it did not run): the release waits
    assert all(m.WhichOneof("msg") == "enqueue" for _, m in p.outbox.take())
    p.report("a", 1, 0)
    p.report("a", 2, 0)
    p.report("b", 2, 1)  # run 2 is over: it came after the release, which still waits for run 1
    assert p.outbox.take() == []
    p.report("b", 1, 1)  # run 1 is over: now the release goes
    assert p.outbox.take() == [("b", release_msg(200))]
    assert events(s)[-1] == cpb.SessionEvent(runs_done=cpb.RunsDone(count=2, last_run=2))

    # with no run open a release goes at once; one to an unknown address goes nowhere
    p.send(s, release(300, 301), release(5, address="nowhere:1"))
    assert p.outbox.take() == [("b", release_msg(300, 301))]


def test_a_batch_is_one_scheduler_pass_and_releases_keep_their_place() -> None:
    p = Sessions()
    s = p.open()
    prog = p.register(s)
    p.send(s, cpb.ClientMessage(batch=cpb.ClientBatch(messages=[run(1, prog, 201), release(7), run(2, prog, 202)])))
    sent = p.outbox.take()
    assert [(h, [t.run_id for t in m.enqueue.tasks]) for h, m in sent] == [("a", [1, 2]), ("b", [1, 2])]
    for host, seg in (("a", 0), ("b", 1)):
        for r in (1, 2):
            p.report(host, r, seg)
    assert p.outbox.take() == [("b", release_msg(7))]


def test_a_cancel_in_a_batch_reaches_the_runs_before_it_in_the_batch() -> None:
    """A `pw` client's cancel_run (an input upload of the run lost) may leave in the same batch as
    the run: the batch's runs went to the scheduler at its end, after the cancel, which found no
    such run and was lost (the run then waited for its input until the hang timeout)."""
    p = Sessions()
    s = p.open()
    prog = p.register(s)
    cancel = cpb.ClientMessage(cancel_run=cpb.CancelRun(run_id=2, reason="input lost"))
    p.send(s, cpb.ClientMessage(batch=cpb.ClientBatch(messages=[run(1, prog, 201), run(2, prog, 202), cancel,
                                                                run(3, prog, 203)])))
    assert p.finished == [(2, False, "input lost")]
    for host, msgs in p.outbox.by_host().items():  # in order on each worker: 1 and 2, 2 dropped, then 3
        assert [m.WhichOneof("msg") for m in msgs] == ["enqueue", "drop", "enqueue"], host
        assert [[t.run_id for t in m.enqueue.tasks] for m in msgs] == [[1, 2], [], [3]], host
        drop = msgs[1].drop
        assert (list(drop.run_ids), drop.reason, list(drop.skipped_seqs)) == ([2], "input lost", []), host


def test_closing_a_session_frees_what_its_client_owned() -> None:
    p = Sessions()
    s = p.open()
    prog = p.register(s)
    p.send(s, run(1, prog, 201))
    run_state = p.dispatcher.runs[1]
    p.outbox.take()
    p.manager.close(s)
    # its run is over, its buffers go everywhere, its program leaves the workers, its slices go
    assert p.dispatcher.runs == {} and p.finished == [(1, False, "cancelled: client c1 disconnected")]
    assert p.broadcasts == [cpb.ControllerToWorker(release=wpb.ReleaseBuffers(owner="client:c1"))]
    ids = [seg.definition.segment_id for seg in run_state.plan.segments]
    drop = cpb.ControllerToWorker(drop=cpb.Drop(run_ids=[1], reason="cancelled: client c1 disconnected"))
    drop_b = cpb.ControllerToWorker()  # b's also frees the copy a sends there for its reader
    drop_b.CopyFrom(drop)
    drop_b.drop.routed_ids[:] = run_state.buffers[0]
    drop_b.drop.unread_ids[:] = run_state.buffers[0]  # an intermediate: a later copy is not kept
    assert p.outbox.by_host() == {  # each worker's messages in order (workers in no particular one)
        "a": [drop, cpb.ControllerToWorker(enqueue=wpb.Enqueue(forget_segments=[ids[0]]))],
        "b": [drop_b, cpb.ControllerToWorker(enqueue=wpb.Enqueue(forget_segments=[ids[1]]))],
    }
    assert p.registry.programs == {} and p.slices.released == ["client:c1"]
    assert p.manager.sessions == {}


def test_slice_changes_reach_every_session() -> None:
    p = Sessions()
    a, b = p.open("c1"), p.open("c2")
    info = cpb.Slice(name="sa", generation=2)
    p.manager.slice_changed(info)
    notice = cpb.SessionEvent(slice_changed=cpb.SliceChanged(slice=info))
    assert events(a) == [notice] and events(b) == [notice]


async def _stream(msgs: list[cpb.ClientMessage], hold: asyncio.Event) -> AsyncIterator[cpb.ClientMessage]:
    for m in msgs:
        yield m
    await hold.wait()  # the client keeps its stream open until told


def test_the_stream_welcomes_serves_and_closes() -> None:
    p = Sessions()
    p.manager.default_dispatch = "parallel"

    async def scenario() -> list[Any]:
        hold = asyncio.Event()
        hello = cpb.ClientMessage(hello=cpb.Hello(client_name="t"))
        register = cpb.ClientMessage(register=cpb.RegisterProgram(request_id=4, graph=two_step_graph(),
                                                                  functions=[FUNCTION]))
        stream = p.manager.serve(_stream([cpb.ClientMessage(batch=cpb.ClientBatch(messages=[hello, register]))],
                                         hold), None)  # type: ignore[arg-type]
        got = [await anext(stream), await anext(stream)]
        assert list(p.manager.sessions) == [got[0].welcome.client_id]
        p.manager.end_all("the controller is shutting down")
        got += [ev async for ev in stream]
        hold.set()
        return got

    welcome, registered, error = asyncio.run(scenario())
    assert welcome.welcome.client_id.startswith("c") and welcome.welcome.id_prefix > 0
    assert welcome.welcome.worker_credential.startswith(f"{welcome.welcome.id_prefix}|client:c")
    assert registered.registered.request_id == 4 and registered.registered.program_id
    assert error == cpb.SessionEvent(error="the controller is shutting down")
    assert p.manager.sessions == {} and p.registry.programs == {}  # closed: its program is gone


def test_a_stream_without_hello_or_with_an_unknown_mode_is_refused() -> None:
    p = Sessions()

    async def first(msgs: list[cpb.ClientMessage]) -> list[cpb.SessionEvent]:
        hold = asyncio.Event()
        hold.set()
        return [ev async for ev in p.manager.serve(_stream(msgs, hold), None)]  # type: ignore[arg-type]

    with pytest.raises(InvalidArgument, match=r"^a session starts with a hello message$"):
        asyncio.run(first([]))
    bad = cpb.ClientMessage(hello=cpb.Hello(client_name="t", dispatch="eager"))
    with pytest.raises(InvalidArgument, match=r"^unknown dispatch mode 'eager': use parallel or sequential$"):
        asyncio.run(first([bad]))
    assert p.manager.sessions == {}


class FormingSlices(Slices):
    """Slice "sb" spans hosts whose island group is forming until `form()`; `settled` waits for
    that at most `wait_s`, as SliceService.settled does, and counts its calls."""

    def __init__(self, hosts: dict[str, Any], wait_s: float) -> None:
        super().__init__(hosts)
        self.wait_s = wait_s
        self.formed = asyncio.Event()
        self.waits = 0

    def form(self) -> None:
        self.formed.set()
        self.epoch += 1

    def placement(self, name: str) -> Any:
        if name == "sb" and not self.formed.is_set():
            raise GroupForming("slice sb spans hosts b, c: island i's group is forming (waiting for c)", "sb")
        return super().placement(name)

    async def settled(self, name: str) -> Any:
        self.waits += 1
        try:
            await asyncio.wait_for(self.formed.wait(), self.wait_s)
        except TimeoutError:
            raise GroupForming(f"slice {name}: group is forming; waited {self.wait_s:g} s for it", name) from None
        return self.placement(name)


def forming(wait_s: float) -> tuple[Sessions, FormingSlices, ClientSession, ProgramRecord]:
    p = Sessions()
    prog = p.register(s := p.open())  # registered while the group was usable
    p.slices = p.manager.slices = p.dispatcher.plans.placements = FormingSlices(p.hosts, wait_s)  # type: ignore[assignment]
    return p, p.slices, s, prog  # type: ignore[return-value]


def test_runs_and_registrations_wait_while_their_slices_group_forms_then_go_in_order() -> None:
    p, slices, s, prog = forming(wait_s=20)

    async def main() -> None:
        gave_up: dict[str, tuple[int, str]] = {}
        batch = cpb.ClientMessage(batch=cpb.ClientBatch(messages=[run(1, prog, 201), release(7), run(2, prog, 202)]))
        taking = asyncio.ensure_future(p.manager._take(s, batch, gave_up))
        await asyncio.sleep(0.2)
        assert not taking.done() and p.outbox.take() == [] and events(s) == []  # waits: nothing refused
        slices.form()
        await asyncio.wait_for(taking, 5)
        sent = p.outbox.take()
        assert [(h, [t.run_id for t in m.enqueue.tasks]) for h, m in sent] == [("a", [1, 2]), ("b", [1, 2])]
        # a registration waits likewise, then registers
        reg = cpb.ClientMessage(register=cpb.RegisterProgram(request_id=5, graph=two_step_graph("q"),
                                                             functions=[FUNCTION]))
        slices.formed.clear()
        taking = asyncio.ensure_future(p.manager._take(s, reg, gave_up))
        await asyncio.sleep(0.2)
        assert not taking.done() and events(s) == []
        slices.form()
        await asyncio.wait_for(taking, 5)
        (ev,) = events(s)
        assert ev.registered.request_id == 5 and ev.registered.program_id and not ev.registered.error
        assert slices.waits == 2 and gave_up == {}

    asyncio.run(main())


def test_a_group_that_does_not_form_within_the_bound_refuses_the_waiting_calls_naming_why() -> None:
    p, slices, s, prog = forming(wait_s=0.3)

    async def main() -> None:
        gave_up: dict[str, tuple[int, str]] = {}
        reg = cpb.ClientMessage(register=cpb.RegisterProgram(request_id=5, graph=two_step_graph("q"),
                                                             functions=[FUNCTION]))
        batch = cpb.ClientMessage(batch=cpb.ClientBatch(messages=[run(1, prog, 201), reg, run(2, prog, 202)]))
        await asyncio.wait_for(p.manager._take(s, batch, gave_up), 5)
        # one wait for the three: after it ran out, the others (waiting behind it) go at once
        assert slices.waits == 1 and p.outbox.take() == []
        why = "slice sb: group is forming; waited 0.3 s for it"
        assert [e for e in events(s) if e.WhichOneof("msg") != "runs_done"] == [
            cpb.SessionEvent(finished=cpb.RunFinished(run_id=1, error=why)),
            cpb.SessionEvent(registered=cpb.ProgramRegistered(request_id=5, error=why)),
            cpb.SessionEvent(finished=cpb.RunFinished(run_id=2, error=why))]
        assert p.finished == []  # refused: never started
        # the group forms: the next run goes
        slices.form()
        await asyncio.wait_for(p.manager._take(s, run(3, prog, 203), gave_up), 5)
        assert [(h, [t.run_id for t in m.enqueue.tasks]) for h, m in p.outbox.take()] == [("a", [3]), ("b", [3])]

    asyncio.run(main())


class MovingSlices(Slices):
    """The dispatcher tests' slices, whose generations a test moves on (a new epoch each)."""

    def __init__(self, hosts: dict[str, Any]) -> None:
        super().__init__(hosts)
        self.generation = {"sa": 0, "sb": 0}

    def placement(self, name: str) -> Placement:
        return replace(super().placement(name), generation=self.generation[name])

    def move(self, name: str) -> None:
        self.generation[name] += 1
        self.epoch += 1


def planned(run_id: int, prog: ProgramRecord, output: int, generations: list[int], input_id: int = 100,
            home: str = "a:1") -> cpb.ClientMessage:
    """A run planned on these generations of the program's slices (sa, sb)."""
    return cpb.ClientMessage(run=cpb.RunProgram(run_id=run_id, program_id=prog.program_id, input_ids=[input_id],
                                                output_ids=[output], input_homes=[home],
                                                slice_generations=generations))


def enqueued(p: Sessions) -> list[int]:
    return sorted({t.run_id for _, m in p.outbox.take() if m.HasField("enqueue") for t in m.enqueue.tasks})


def test_a_run_planned_on_an_older_generation_is_refused_before_anything_of_it_and_so_are_its_readers() -> None:
    p = Sessions()
    moving = MovingSlices(p.hosts)
    p.slices = p.manager.slices = p.dispatcher.plans.placements = moving  # type: ignore[assignment]
    s = p.open()
    prog = p.register(s)
    moving.move("sa")  # before the client heard of it: it plans on generation 0
    p.send(s, cpb.ClientMessage(batch=cpb.ClientBatch(messages=[
        planned(1, prog, 201, [0, 0]),
        planned(2, prog, 202, [1, 0], input_id=201, home="b:1")])))  # planned anew, but reads run 1's output
    assert p.outbox.take() == []  # nothing of either dispatched
    first, second, done = events(s)
    assert first.finished.replan and list(first.finished.slice_generations) == [1, 0], first
    assert "'sa' (generation 0 -> 1)" in first.finished.error and not first.finished.ok
    assert second.finished.replan and not second.finished.slice_generations, second
    assert "will never be computed" in second.finished.error
    assert done == cpb.SessionEvent(runs_done=cpb.RunsDone(count=2, last_run=2))  # both over, handled
    # sent again, planned on generation 1, with the same outputs: admitted, and the reader too
    p.send(s, planned(3, prog, 201, [1, 0]), planned(4, prog, 202, [1, 0], input_id=201, home="b:1"))
    assert enqueued(p) == [3, 4] and events(s) == []  # (that they were handled is told with the next over)
    # an older client's run (no generations) is admitted as before
    p.send(s, run(5, prog, 205))
    assert enqueued(p) == [5] and events(s) == []
    p.report("a", 3, 0)
    p.report("b", 3, 1)
    assert events(s)[-1] == cpb.SessionEvent(runs_done=cpb.RunsDone(count=3, last_run=5))


def test_a_run_with_the_wrong_number_of_slice_generations_is_refused_in_one_short_line() -> None:
    """A hostile or broken client's `slice_generations` (not one per slice of the program: here two
    slices, sa and sb, and a million generations, huge values) cost it its run, refused with a short
    line and not to be sent again (no `replan`: planning anew gives the same wrong list), and
    nothing else. Before, a list whose first two matched was refused as planned on an older
    placement with every generation in the error (megabytes, on the controller's event loop, in the
    client's event), and the client told to send it again."""
    p = Sessions()
    moving = MovingSlices(p.hosts)
    p.slices = p.manager.slices = p.dispatcher.placements = moving  # type: ignore[assignment]
    s = p.open()
    prog = p.register(s)
    for run_id, gens in [(1, [0, 0] + [2**64 - 1] * 1_000_000), (2, [0]), (3, [2**64 - 1] * 3)]:
        p.send(s, planned(run_id, prog, 200 + run_id, gens))
        finished, done = events(s)
        assert not finished.finished.ok and not finished.finished.replan, finished.finished.replan
        assert finished.finished.error == (f"run {run_id:#x} carries {len(gens)} slice generations; its program "
                                           f"runs on 2 slices ('sa', 'sb')"), finished.finished.error[:300]
        assert done.runs_done.last_run == run_id
    assert p.outbox.take() == []
    # huge values of the right number: planned on an older placement (sent again), in one short line
    p.send(s, planned(4, prog, 204, [2**64 - 1, 0]))
    finished, _ = events(s)
    assert finished.finished.replan and len(finished.finished.error) < 200, finished.finished.error
    # and the session goes on: a run planned on the slices as they are is admitted
    p.send(s, planned(5, prog, 205, [0, 0]))
    assert enqueued(p) == [5]
