"""A proxy session's flushes held while its requests keep coming (server/proxy/corking.py).

The cork alone, on a hand-driven event loop and clock; then a proxy session (`SliceSession`) on
the real dispatcher, gang scheduler, program registry and session manager, with an outbox that
records what each worker would get: a burst of executes leaves as one `Enqueue` whose tasks keep
the order of the calls, and a call that waits (a readiness check) sends what is held first."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any

import pytest
from test_proxy_protocol import P

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb
from server.controller.cluster import HostInfo
from server.controller.dispatch import Dispatcher
from server.controller.holders import Holders
from server.controller.programs import ProgramRegistry
from server.controller.sessions import SessionManager
from server.controller.slices import Placement
from server.proxy import protocol as proto_mod
from server.proxy import shardings as sh
from server.proxy.answers import Encoder
from server.proxy.arrays import Buf, release_all, whole
from server.proxy.backend import BackendError
from server.proxy.cluster_backend import Controls, SliceSession
from server.proxy.corking import MAX_HELD, FlushCork
from server.proxy.service import Session
from server.scheduler import GangScheduler, Policy

pytestmark = pytest.mark.timeout(30)


class Loop:
    """`call_soon` and a clock, driven by the test: `run_pass` runs what the last pass scheduled."""

    def __init__(self) -> None:
        self.ready: list[Callable[[], None]] = []
        self.now = 100.0

    def call_soon(self, cb: Callable[[], None]) -> None:
        self.ready.append(cb)

    def run_pass(self) -> None:
        ready, self.ready = self.ready, []
        for cb in ready:
            cb()


def cork(**kw: Any) -> tuple[FlushCork, Loop, list[int]]:
    loop, flushed = Loop(), []
    c = FlushCork(lambda: flushed.append(1), loop.call_soon, lambda: loop.now, **kw)
    return c, loop, flushed


def test_decisions_are_held_until_the_loop_makes_quiet_passes() -> None:
    c, loop, flushed = cork(quiet_passes=3)
    c.decided()
    c.decided()
    assert c.held == 2 and not flushed
    loop.run_pass()
    loop.run_pass()
    c.decided()  # a new one: the quiet passes count from here
    loop.run_pass()
    loop.run_pass()
    loop.run_pass()
    assert not flushed
    loop.run_pass()
    assert flushed == [1] and c.held == 0
    assert not loop.ready  # nothing left spinning once it flushed
    loop.run_pass()
    assert flushed == [1]


def test_the_hold_is_bounded_by_count_and_by_time() -> None:
    c, loop, flushed = cork(quiet_passes=3, max_held=4, max_delay_s=0.002)
    for _ in range(4):
        c.decided()
    assert flushed == [1] and c.held == 0  # the fourth flushed at once
    c.decided()
    loop.now += 0.0021  # requests keep coming, but the first held is due
    c.decided()
    loop.run_pass()
    assert flushed == [1, 1] and c.held == 0


def test_after_a_wait_the_next_decision_goes_at_once() -> None:
    c, loop, flushed = cork(quiet_passes=3)
    c.decided()
    c.waiting()  # a blocking call: what is held goes first
    assert flushed == [1]
    c.decided()  # its next call (op-by-op): not held
    assert flushed == [1, 1] and c.held == 0
    c.decided()  # then held again while the calls keep coming
    assert flushed == [1, 1] and c.held == 1
    for _ in range(4):
        loop.run_pass()
    assert flushed == [1, 1, 1]


def test_after_a_wait_releases_are_held_for_the_next_run() -> None:
    """An op-by-op client drops the previous call's arrays before its next call: those
    releases wait (armed as usual) and leave with the next run, which goes at once."""
    c, loop, flushed = cork(quiet_passes=3)
    c.waiting()
    c.decided(run=False)
    c.decided(run=False)
    assert flushed == [] and c.held == 2
    c.decided()  # the next call: it and the releases, in one flush
    assert flushed == [1] and c.held == 0
    c.decided(run=False)  # no wait since: held, then flushed by the quiet passes
    assert flushed == [1] and c.held == 1
    for _ in range(4):
        loop.run_pass()
    assert flushed == [1, 1] and c.held == 0


def test_an_explicit_flush_sends_at_once_and_stops_the_pending_passes() -> None:
    c, loop, flushed = cork(quiet_passes=2)
    c.flush()
    assert not flushed  # nothing held: no flush of the dispatcher
    c.decided()
    c.flush()
    assert flushed == [1]
    c.decided()  # armed again: one chain of passes, not two
    for _ in range(2):
        loop.run_pass()
        assert len(loop.ready) <= 1
    loop.run_pass()
    assert flushed == [1, 1] and not loop.ready


# ---- a proxy session on the real dispatcher ----

F = hashlib.sha256(b"inc").hexdigest()


class Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[str, cpb.ControllerToWorker]] = []

    def send(self, host: str, msg: cpb.ControllerToWorker) -> None:
        self.sent.append((host, msg))


class Slices:
    """One slice, "s", on device 0 of host a."""

    def __init__(self, host: HostInfo) -> None:
        self.host = host
        self.epoch = 0

    def placement(self, name: str) -> Placement:
        return Placement(name, self.host, [0], 0, self.host.island)

    def current(self, name: str) -> Placement:
        return self.placement(name)

    def holders(self, name: str) -> Holders:
        return Holders(name, (self.host,), (0,), 0)

    async def settled(self, name: str, timeout: float) -> Placement:
        return self.placement(name)

    def release_owner(self, owner: str) -> None:
        pass


def parts() -> tuple[SliceSession, Outbox, HostInfo]:
    a = HostInfo(id=1, name="a", island="i", address="a:1", pid=1, kind="cpu", machine_id="m", device_ids=[10],
                 state="ready")
    outbox = Outbox()
    slices = Slices(a)
    registry = ProgramRegistry()
    dispatcher = Dispatcher(GangScheduler(hang_timeout_s=None, default_policy=Policy("fifo"),
                                          max_inflight_nodes=256),
                            registry, slices, {"a": a}, lambda addr: a if addr == a.address else None, outbox)
    dispatcher.host_up(a)
    manager = SessionManager(dispatcher, registry, slices, lambda msg: None)
    controls = Controls(release_buffers=None, release_owner=lambda owner: None,
                        new_id_prefix=manager.new_id_prefix, token=None, sessions=manager)
    sl = cpb.Slice(name="s", devices=[cpb.VirtualDevice(index=0, kind="cpu", host="a")])
    session = SliceSession(slices, controls, sl, "client:proxy-test", False)  # type: ignore[arg-type]
    outbox.sent.clear()
    return session, outbox, a


def enqueues(outbox: Outbox) -> list[wpb.Enqueue]:
    out = [m.enqueue for _, m in outbox.sent if m.WhichOneof("msg") == "enqueue"]
    outbox.sent.clear()
    return out


async def passes(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_burst_of_executes_leaves_in_one_enqueue_in_call_order() -> None:
    async def main() -> None:
        session, outbox, a = parts()
        program = session.register("inc", b"inc", F, 1, 1, ())
        x = 7 | session._client.id_prefix << 40
        session.adopt(x, a.address)
        outputs = []
        for _ in range(10):  # a pipelined loop: each call reads the previous one's output
            (x,) = session.execute(program, [x])
            outputs.append(x)
        assert enqueues(outbox) == []  # held while the calls keep coming
        await passes(8)
        (enq,) = enqueues(outbox)
        assert [t.output_ids[0] for t in enq.tasks] == outputs
        assert [t.input_ids[0] for t in enq.tasks[1:]] == outputs[:-1]
        assert [t.seq for t in enq.tasks] == sorted(t.seq for t in enq.tasks)
        assert len(enq.functions) == 1 and len(enq.segments) == 1  # registered once, before the tasks
        # a call that waits sends what is held before it waits (here the worker is not there)
        (x,) = session.execute(program, [x])
        with pytest.raises(BackendError):
            await asyncio.wait_for(session.ready([outputs[-1]]), 5)
        (enq,) = enqueues(outbox)
        assert len(enq.tasks) == 1
        session.execute(program, [x])  # the call after a wait leaves at once (op-by-op)
        (enq,) = enqueues(outbox)
        assert len(enq.tasks) == 1
        await session.close()

    asyncio.run(main())


def test_an_idle_session_sends_its_call_within_a_few_passes() -> None:
    async def main() -> None:
        session, outbox, a = parts()
        program = session.register("inc", b"inc", F, 1, 1, ())
        x = 7 | session._client.id_prefix << 40
        session.adopt(x, a.address)
        session.execute(program, [x])
        await passes(6)
        (enq,) = enqueues(outbox)
        assert len(enq.tasks) == 1
        await session.close()

    asyncio.run(main())


def test_held_runs_reach_the_scheduler_in_one_pass_and_a_release_waits_behind_them() -> None:
    """The runs the cork holds are handed to the scheduler at its flush, together and in call
    order; the release of an input they read, made meanwhile, is held behind them (it leaves only
    once they are over), not sent ahead of their tasks."""
    async def main() -> None:
        session, outbox, a = parts()
        dispatcher = session._controls.sessions.dispatcher
        passes_seen: list[int] = []
        handle = dispatcher.handle
        dispatcher.handle = lambda event: passes_seen.append(len(getattr(event, "events", (event,)))) or handle(event)
        program = session.register("inc", b"inc", F, 1, 1, ())
        x0 = x = 7 | session._client.id_prefix << 40
        session.adopt(x, a.address)
        for _ in range(5):
            (x,) = session.execute(program, [x])
        session.free([x0])  # the client drops the first input at once
        assert passes_seen == [] and enqueues(outbox) == []  # nothing decided while held
        await passes(8)
        assert passes_seen == [5]  # one scheduler pass for the five runs
        sent = list(outbox.sent)
        (enq,) = enqueues(outbox)
        assert len(enq.tasks) == 5 and enq.tasks[0].input_ids[0] == x0
        assert x0 not in enq.release_ids  # its reader is not over: the release is held
        assert not any(m.WhichOneof("msg") == "release" for _, m in sent)
        await session.close()

    asyncio.run(main())


def test_held_runs_the_scheduler_fails_on_fail_their_outputs() -> None:
    """A scheduler pass that raises (a bug) at the cork's flush fails the runs it held: a wait on
    their outputs reports the error instead of waiting for buffers that will never exist."""
    async def main() -> None:
        session, outbox, a = parts()
        dispatcher = session._controls.sessions.dispatcher

        def broken(event: Any) -> None:  # a fault put into the real scheduler's entry
            raise RuntimeError("scheduler bug")

        dispatcher.handle = broken
        program = session.register("inc", b"inc", F, 1, 1, ())
        x = 7 | session._client.id_prefix << 40
        session.adopt(x, a.address)
        (y,) = session.execute(program, [x])
        await passes(8)
        with pytest.raises(BackendError, match="scheduler bug"):
            await asyncio.wait_for(session.ready([y]), 5)
        assert y not in [t.output_ids[0] for e in enqueues(outbox) for t in e.tasks]
        del dispatcher.handle  # the class's again, for the session's end
        await session.close()

    asyncio.run(main())


def test_a_destruct_of_a_step_s_arrays_leaves_in_one_release_and_waits_for_their_readers() -> None:
    """A DestructArray's list (a training step drops ~80 arrays at once: more than MAX_HELD, so
    freed one by one they left in two messages) frees its arrays' buffers in one release to their
    worker. Handles that a request read earlier still uses, or whose op is still running, are
    not freed with them: only once that request is done (a free never overtakes a use), and
    then together."""
    async def main() -> None:
        backend, outbox, a = parts()
        session = Session(1, proto_mod.MAX_PROTOCOL_VERSION, backend, Encoder(P))  # type: ignore[arg-type]
        one = sh.Sharding((0,))
        ids = [(i + 1) | backend._client.id_prefix << 40 for i in range(MAX_HELD + 36)]
        for h, b in enumerate(ids, start=1000):
            backend.adopt(b, a.address)
            session.handles.put(h, whole(Buf(b, "float32", (2,)), one))
        shared = whole(session.handles.peek(1000).parts[0].buf, one)  # a second array of the first's buffer
        session.handles.put(999, shared)
        used = [997 + len(ids), 998 + len(ids), 999 + len(ids)]  # the last three, read by a request
        session.handles.claim(used)  # still running
        session.handles.reserve(998)  # an op's result not made yet
        handles = [*range(1000, 1000 + len(ids)), 998, 1000, 5]  # and a repeated and an unknown one
        release = asyncio.ensure_future(release_all(session, handles))
        await passes(8)
        (msg,) = [m for _, m in outbox.sent]
        outbox.sent.clear()
        assert msg.WhichOneof("msg") == "release" and msg.release.owner == backend._owner
        assert list(msg.release.buffer_ids) == ids[1:-3]  # ids[0] is still read by 999, the last by the request
        assert not release.done()
        session.handles.unclaim(used)  # they go together
        await passes(8)
        assert [list(m.release.buffer_ids) for _, m in outbox.sent] == [ids[-3:]]
        outbox.sent.clear()
        assert not release.done()  # 998 still pending
        b = ids[-1] + 1  # its op's result
        backend.adopt(b, a.address)
        session.handles.settle(998, whole(Buf(b, "float32", (2,)), one))
        await asyncio.wait_for(release, 5)
        await passes(8)
        assert [list(m.release.buffer_ids) for _, m in outbox.sent] == [[b]]
        assert session.handles.peek(999) is shared and len(session.handles) == 1
        await backend.close()

    asyncio.run(main())
