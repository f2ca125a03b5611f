"""The database's one writer, against a real SQLite file: submitting never waits, jobs commit in
order (batched), a failing job fails alone, `close` drains the queue."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from server.controller.cluster import Cluster
from server.controller.slices import SliceService
from server.db.engine import make_engine, session_factory
from server.db.models import Base, IslandRow
from server.db.writer import DbWriter, WriterClosed

pytestmark = pytest.mark.timeout(120)
# bounds on the writer's waits: SQLite's commits take milliseconds, but a CI machine's disk under
# other tests' load once stalled 600 inserts past 10 s (close returned False)
WAIT_S = 60


@pytest.fixture
def db(tmp_path: Path) -> sessionmaker[Session]:
    engine = make_engine(f"sqlite:///{tmp_path / 'w.db'}")
    Base.metadata.create_all(engine)
    return session_factory(engine)


def names(db: sessionmaker[Session]) -> list[str]:
    with db() as s:
        return list(s.scalars(select(IslandRow.name).order_by(IslandRow.id)))


def add(name: str):  # type: ignore[no-untyped-def]
    def job(s: Session) -> str:
        s.add(IslandRow(name=name))
        s.flush()
        return name
    return job


def delete(name: str):  # type: ignore[no-untyped-def]
    def job(s: Session) -> None:
        row = s.scalar(select(IslandRow).where(IslandRow.name == name))
        assert row is not None, f"{name} is not there (yet)"
        s.delete(row)
        s.flush()
    return job


def busy(w: DbWriter, gate: threading.Event) -> None:
    """Submits a job that holds the writer until `gate` opens; returns once the writer runs it
    (so what is submitted next waits in the queue, in a later transaction)."""
    running = threading.Event()

    def hold(s: Session) -> bool:
        running.set()
        return gate.wait(10)

    w.submit(hold)
    assert running.wait(10)


def controller_parts(db: sessionmaker[Session], w: DbWriter) -> tuple[Cluster, SliceService]:
    """A controller's host registry (Cluster) and slice service on `db`, writing through `w`,
    the service told of hosts coming and going, both loaded from the database."""
    cluster = Cluster(db, w.submit, 1.0, 5.0)
    slices = SliceService(db, w.submit, cluster.hosts, lambda name: None)
    cluster.on_host_up.append(slices.host_up)
    cluster.on_host_lost.append(slices.host_lost)
    slices.load()
    cluster.load()
    return cluster, slices


def test_submit_returns_at_once_and_jobs_commit_in_order_in_one_transaction(db: sessionmaker[Session]) -> None:
    w = DbWriter(db)
    gate = threading.Event()
    blocked = w.submit(lambda s: gate.wait(10))  # the writer is busy until the gate opens
    futures = [w.submit(add("x")), w.submit(delete("x")), w.submit(add("x")), w.submit(add("y"))]
    assert not any(f.done() for f in futures)  # queued: nobody waited for the database
    gate.set()
    assert blocked.result(WAIT_S) is True
    assert [f.result(WAIT_S) for f in futures] == ["x", None, "x", "y"]
    assert names(db) == ["x", "y"]  # created, deleted, created again: never the other way round
    assert w.close(WAIT_S)


def test_a_failing_job_fails_alone_and_the_others_land_in_order(db: sessionmaker[Session]) -> None:
    w = DbWriter(db)
    gate = threading.Event()
    w.submit(lambda s: gate.wait(10))
    ok1, dup, ok2 = w.submit(add("a")), w.submit(add("a")), w.submit(add("b"))  # one batch, one bad job
    gate.set()
    assert ok1.result(WAIT_S) == "a" and ok2.result(WAIT_S) == "b"
    with pytest.raises(IntegrityError):
        dup.result(WAIT_S)
    assert names(db) == ["a", "b"]
    assert w.close(WAIT_S)


def test_close_runs_what_was_queued_and_refuses_what_comes_after(db: sessionmaker[Session]) -> None:
    w = DbWriter(db)
    futures = [w.submit(add(f"i{n}")) for n in range(600)]  # more than one batch
    assert w.close(WAIT_S)
    assert all(f.done() for f in futures)
    assert names(db) == [f"i{n}" for n in range(600)]
    with pytest.raises(WriterClosed):
        w.submit(add("late"))
    assert w.close(1)  # closing twice is harmless


def test_the_event_loop_awaits_a_write_without_blocking(db: sessionmaker[Session]) -> None:
    w = DbWriter(db)
    gate = threading.Event()

    async def scenario() -> tuple[int, str]:
        w.submit(lambda s: gate.wait(10))
        fut = asyncio.wrap_future(w.submit(add("z")))
        ticks = 0
        while not fut.done():  # the loop keeps running while the writer is busy
            ticks += 1
            if ticks == 5:
                gate.set()
            await asyncio.sleep(0.01)
        return ticks, await fut

    ticks, result = asyncio.run(scenario())
    assert ticks >= 5 and result == "z"
    assert w.close(WAIT_S)


def test_slice_changes_through_the_writer_survive_a_reload_as_they_were_made(
        db: sessionmaker[Session]) -> None:
    """The cluster and the slice service write through one writer; a fresh pair loading the
    database afterwards (a restarted controller) finds exactly the state they had."""
    from schemas.pathways.v1 import controller_pb2 as cpb
    from server.controller.cluster import RECONNECTING
    from server.controller.links import WorkerLink

    w = DbWriter(db)
    cluster, slices = controller_parts(db, w)
    for name in ("w1", "w2"):
        reg = cpb.RegisterWorker(name=name, island="i", address=f"{name}:1", pid=1, device_kind="cpu",
                                 device_count=2, machine_id="m")
        cluster.register(reg, WorkerLink(name))
    assert [h.device_ids for h in cluster.hosts.values()] == [[1, 2], [3, 4]]  # assigned without the database
    slices.create(cpb.SliceSpec(name="s", devices=2), False, "client:c1")
    slices.delete("s")
    slices.create(cpb.SliceSpec(name="s", devices=1), False, "client:c1")
    slices.create(cpb.SliceSpec(name="t", devices=2), False, "job:j1")
    before = {s.name: (list(s.devices), s.owner) for s in slices.list()}
    assert w.close(WAIT_S)

    w2 = DbWriter(db)
    cluster2, slices2 = controller_parts(db, w2)
    assert {n: (h.id, h.device_ids, h.state) for n, h in cluster2.hosts.items()} == {
        "w1": (1, [1, 2], RECONNECTING), "w2": (2, [3, 4], RECONNECTING)}
    after = {s.name: (list(s.devices), s.owner) for s in slices2.list()}
    assert after == before and after["s"][0][0].device_id in (1, 2, 3, 4) and len(after["s"][0]) == 1
    # a host registering again keeps its ids; new hosts get new ones
    cluster2.register(cpb.RegisterWorker(name="w3", island="i", address="w3:1", pid=1, device_kind="cpu",
                                         device_count=1, machine_id="m"), WorkerLink("w3"))
    assert (cluster2.hosts["w3"].id, cluster2.hosts["w3"].device_ids) == (3, [5])
    assert w2.close(WAIT_S)


def test_automatic_slice_names_never_come_back_after_a_restart(db: sessionmaker[Session]) -> None:
    """A deleted slice's automatic name stays given across a controller restart: the highest N
    of "slice-N" lives in the database (`counters`), so a function or script still holding a
    deleted "slice-3" cannot reach a new slice of a later controller. A chosen name like
    "slice-<57 digits>" is past any counter and does not break the write."""
    from schemas.pathways.v1 import controller_pb2 as cpb
    from server.controller.links import WorkerLink

    def parts(w: DbWriter) -> SliceService:
        cluster, slices = controller_parts(db, w)
        cluster.register(cpb.RegisterWorker(name="w1", island="i", address="w1:1", pid=1, device_kind="cpu",
                                            device_count=4, machine_id="m"), WorkerLink("w1"))
        return slices

    w = DbWriter(db)
    slices = parts(w)
    made = [slices.create(cpb.SliceSpec(devices=1), False, "client:c").slice.name for _ in range(3)]
    assert made == ["slice-1", "slice-2", "slice-3"]
    huge = "slice-" + "9" * 57
    slices.create(cpb.SliceSpec(name=huge, devices=1), False, "client:c")
    slices.delete("slice-2")
    slices.delete("slice-3")  # the highest: no row of it is left
    slices.delete(huge)
    assert w.close(WAIT_S)

    w2 = DbWriter(db)
    slices2 = parts(w2)
    assert [s.name for s in slices2.list()] == ["slice-1"]
    assert slices2.create(cpb.SliceSpec(devices=1), False, "client:d").slice.name == "slice-4"
    assert w2.close(WAIT_S)


@pytest.mark.parametrize("close_cancelled", [False, True], ids=["released", "close-cancelled"])
def test_a_slice_name_used_again_after_a_remapped_slice_was_released_reloads_cleanly(
        db: sessionmaker[Session], close_cancelled: bool) -> None:
    """A slice that was remapped, then released with its owner, then a new slice taking the same
    name: the database must hold the new slice alone (no remap of the old one), or a restarted
    controller refuses to load it ("1 remaps but generation 0", seen in the chaos run when a
    proxy session's fresh slice went through exactly this, when automatic names still came back;
    a name chosen by the caller still can). `close_cancelled`: the
    releasing session's close is cancelled while it awaits the write (its client went away), as
    in the chaos run; the write must still land before the name comes back."""
    from schemas.pathways.v1 import controller_pb2 as cpb
    from server.controller.links import WorkerLink

    w = DbWriter(db)
    cluster, slices = controller_parts(db, w)
    for name in ("w1", "w2"):
        cluster.register(cpb.RegisterWorker(name=name, island="i", address=f"{name}:1", pid=1, device_kind="cpu",
                                            device_count=1, machine_id="m"), WorkerLink(name))
    first = slices.create(cpb.SliceSpec(name="reused", devices=1), False, "client:p").slice
    host = next(h.name for h in cluster.hosts.values() if first.devices[0].device_id in h.device_ids)
    cluster.mark_lost(host, "killed")
    assert slices.rm.slices[first.name].generation == 1  # remapped onto the other host
    if close_cancelled:
        gate = threading.Event()

        async def close() -> None:
            busy(w, gate)  # the writer is in a transaction, as under load
            slices.release_owner("client:p")
            closing = asyncio.ensure_future(slices.written())
            await asyncio.sleep(0.01)
            closing.cancel()  # the session's task is cancelled while it awaits the write
            await asyncio.sleep(0.01)
            gate.set()

        asyncio.run(close())
    else:
        slices.release_owner("client:p")
    again = slices.create(cpb.SliceSpec(name="reused", devices=1), False, "client:q").slice
    assert again.name == first.name == "reused"  # the freed name, chosen again
    assert w.close(WAIT_S)

    w2 = DbWriter(db)
    _, slices2 = controller_parts(db, w2)
    reloaded = slices2.rm.slices[first.name]
    assert (reloaded.owner, reloaded.generation, reloaded.history) == ("client:q", 0, ())
    assert w2.close(WAIT_S)


def test_a_write_still_lands_when_the_task_awaiting_it_is_cancelled(db: sessionmaker[Session]) -> None:
    """A request that awaits its write and is then cancelled (its client went away) must not
    take the write with it: `asyncio.wrap_future` cancels the writer's future when its awaiter
    is cancelled, and a cancelled job that the writer skipped lost a slice's delete once (the
    chaos run's restart that failed with '1 remaps but generation 0')."""
    w = DbWriter(db)
    gate = threading.Event()

    async def scenario() -> None:
        busy(w, gate)
        waiter = asyncio.ensure_future(asyncio.wrap_future(w.submit(add("kept"))))
        await asyncio.sleep(0.01)
        waiter.cancel()  # the awaiting request is cancelled while the writer is busy
        await asyncio.sleep(0.01)
        gate.set()

    asyncio.run(scenario())
    assert w.close(WAIT_S)
    assert names(db) == ["kept"]
