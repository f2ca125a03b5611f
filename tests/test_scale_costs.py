"""The control plane's costs grow with what changed, not with the cluster (issue 31).

A real controller core (its components, the database writer, SQLite) in this process, hosts
registering through `Cluster.register` as the WorkerConnect handler calls it. At N = 8 and
N = 32 hosts the test counts, for one registration, one heartbeat, a loss of a quarter of the
hosts and the listings: the SQL statements the database sees (SQLAlchemy's
`before_cursor_execute`) and the Python lines the controller's own code runs on the event loop
(a trace of `server/`): a step per host or device visited. Both must not grow with N. The
same controller served over gRPC to `bench.simworkers` (the benchmark's simulated workers) at 8
and 32 hosts: the statements per registration, heartbeat and flush. Times are the benchmark's
business (`python -m bench --only scale`).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from sqlalchemy import event, func, select

import server
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb
from server.controller.cluster import LOST, READY, RECONNECTING, Cluster, beat_interval, host_state
from server.controller.core import Controller, ControllerConfig
from server.controller.device_rows import rows_of
from server.controller.groups import stop_service
from server.controller.host_rows import host_rows_of
from server.controller.hostviews import list_devices, list_hosts
from server.controller.links import WorkerLink
from server.controller.listing_rows import stamp
from server.db.engine import make_engine
from server.db.models import Base, HostRow
from server.timeutil import iso
from server.worker.relay import Inbox, gang_parts, relayed_message

pytestmark = pytest.mark.timeout(60)

SERVER_DIR = str(Path(server.__file__).parent)
ISLANDS = ("isl-a", "isl-b")  # the island count stays fixed as the hosts grow


@dataclass
class Work:
    statements: int = 0
    lines: int = 0


class Meter:
    """Counts SQL statements on the engine, and (while `measure` runs) the lines of `server/`
    code the calling thread runs."""

    def __init__(self, core: Controller) -> None:
        self.core = core
        self.statements = 0
        event.listen(core.engine, "before_cursor_execute", self._statement)

    def _statement(self, *args: Any) -> None:
        self.statements += 1

    def settle(self) -> None:
        """Waits until every write queued so far has run."""
        self.core.writer.submit(lambda s: None).result(timeout=30)

    @contextmanager
    def measure(self) -> Iterator[Work]:
        self.settle()
        work = Work()

        def local(frame: FrameType, why: str, arg: Any) -> Callable[..., Any] | None:
            if why == "line":
                work.lines += 1
            return local

        def tracer(frame: FrameType, why: str, arg: Any) -> Callable[..., Any] | None:
            return local if frame.f_code.co_filename.startswith(SERVER_DIR) else None

        before = self.statements
        sys.settrace(tracer)
        try:
            yield work
        finally:
            sys.settrace(None)
        self.settle()
        work.statements = self.statements - before


def registration(name: str, island: str, devices: int = 4) -> cpb.RegisterWorker:
    return cpb.RegisterWorker(name=name, island=island, address=f"127.0.0.2:{abs(hash(name)) % 60000 + 1}",
                              pid=1, device_kind="cpu", device_count=devices, machine_id=name)


MakeCore = Callable[..., AbstractContextManager[Controller]]


@pytest.fixture
def make_core(tmp_path: Path) -> MakeCore:
    """`with make_core("x.db", load_slices=True, **config) as core`: a real controller core in this
    process (its components, the database writer) on SQLite database tmp_path/x.db, made with the
    schema when it is new (a second core on the same file is the first one restarted), its state
    loaded as at start (the slices only with `load_slices`); its writer and engine closed after."""

    @contextmanager
    def make(db: str, *, load_slices: bool = True, **config: Any) -> Iterator[Controller]:
        url = f"sqlite:///{tmp_path / db}"
        if not (tmp_path / db).exists():
            engine = make_engine(url)
            Base.metadata.create_all(engine)
            engine.dispose()
        core = Controller(ControllerConfig(listen="127.0.0.1:0", db_url=url, **config))
        if load_slices:
            core.slices.load()
        core.cluster.load()
        try:
            yield core
        finally:
            core.writer.close(30)
            core.engine.dispose()

    return make


async def costs(make_core: MakeCore, n: int) -> dict[str, Work]:
    with make_core(f"c{n}.db") as core:
        meter = Meter(core)
        cluster = core.cluster
        for i in range(n):
            cluster.register(registration(f"h{i:03d}", ISLANDS[i % 2]), WorkerLink(f"h{i:03d}"))
        core.slices.create(cpb.SliceSpec(name="s", devices=4, island=ISLANDS[0]), False, "")
        for h in list(cluster.hosts.values()):  # every device is running something (for the observer)
            core.observer.on_node_event(h.name, cpb.NodeEvent(run_id=1, segment=0, start_ns=1,
                                                              local_devices=range(len(h.device_ids))), None)
        out: dict[str, Work] = {}
        with meter.measure() as out["register"]:
            cluster.register(registration("new", ISLANDS[0]), WorkerLink("new"))
        with meter.measure() as out["re-register"]:
            cluster.register(registration("h001", ISLANDS[1]), WorkerLink("h001"))
        with meter.measure() as out["heartbeat"]:
            cluster.heartbeat("h002", cpb.Heartbeat())
        seen = time.monotonic()
        for h in cluster.hosts.values():  # one second of last-heartbeat strings, whatever the clock
            h.last_seen = seen
        with meter.measure() as out["list islands"]:
            cluster.island_protos()
        with meter.measure() as out["list hosts page"]:
            page = list_hosts(cluster, limit=2)  # both pages inside the first island
            list_hosts(cluster, limit=2, page_token=page.next_page_token)
        with meter.measure() as out["list devices page"]:
            list_devices(cluster, ISLANDS[1], limit=5)
        for h in cluster.hosts.values():
            cluster.heartbeat(h.name, cpb.Heartbeat())
        with meter.measure() as flush:
            cluster.flush_heartbeats()
        out["heartbeat flush (statements)"] = Work(statements=flush.statements)
        # two hosts lost together: the same work whatever the cluster's size
        others = [h for h in cluster.hosts.values() if h.island == ISLANDS[1]]  # not the slice's
        with meter.measure() as out["observer: a host lost"]:
            core.observer.host_lost(others[-1], "test")
        assert [core.observer.devices[(others[-1].name, d)].running() for d in range(4)] == [None] * 4
        assert core.observer.devices[(others[0].name, 0)].running() is not None  # the others run on
        with meter.measure() as out["loss of two hosts"]:
            cluster.mark_lost_many([(h.name, "test") for h in others[:2]])
        # a quarter of the hosts go silent: found in one pass (the monitor's scan of every host, a
        # tick's cost), written in one go
        lost = others[2:][: n // 4]
        for h in lost:
            h.last_seen -= 2 * cluster.heartbeat_timeout
        with meter.measure() as loss:
            cluster.check_silence(time.monotonic())
        assert all(h.state == LOST for h in lost)
        out["loss of a quarter (statements)"] = Work(statements=loss.statements)
        return out


def test_work_per_event_does_not_grow_with_the_cluster(make_core: MakeCore) -> None:
    small = asyncio.run(costs(make_core, 8))
    large = asyncio.run(costs(make_core, 32))
    for what, work in small.items():
        assert large[what] == work, f"{what}: {work} at 8 hosts, {large[what]} at 32"
    assert small["heartbeat"] == Work(statements=0, lines=small["heartbeat"].lines)
    assert small["list islands"].statements == 0
    assert small["heartbeat flush (statements)"].statements == 1  # one executemany for every host
    assert small["loss of a quarter (statements)"].statements == 2  # the hosts, then their devices


def test_a_device_listing_rebuilds_only_the_hosts_that_changed(make_core: MakeCore) -> None:
    """ListDevices keeps each host's encoded entries: a listing after one heartbeat encodes that
    host's devices again and no other's; a slice change (device slice counts) rebuilds them all;
    every listing equals one built from scratch."""
    async def run() -> None:
        with make_core("d.db") as core:
            cluster = core.cluster
            for i in range(16):
                cluster.register(registration(f"h{i:02d}", ISLANDS[i % 2]), WorkerLink(f"h{i:02d}"))

            def listing() -> cpb.ListDevicesResponse:
                return list_devices(cluster, slice_count=core.device_slice_count, slice_epoch=core.slices.epoch)

            def built() -> dict[str, int]:
                rows = rows_of(cluster)
                return {h: id(rows._hosts[h].rows) for h in cluster.hosts}

            def fresh() -> cpb.ListDevicesResponse:
                rows_of(cluster)._hosts.clear()
                return listing()

            first = listing()
            assert len(first.devices) == first.total == 64
            before = built()
            again = listing()
            assert built() == before and again == first  # nothing changed: nothing rebuilt
            cluster.heartbeat("h05", cpb.Heartbeat())
            cluster.hosts["h05"].last_seen += 1.0  # a beat a second later, whatever the clock's resolution
            after_beat = listing()
            now = built()
            assert {h for h in now if now[h] != before[h]} == {"h05"}
            keep = {h: rows_of(cluster)._hosts[h].rows for h in cluster.hosts}  # ids stay unique
            assert after_beat == fresh()
            core.slices.create(cpb.SliceSpec(name="s", devices=4, island=ISLANDS[0]), False, "")
            listing()
            now = built()
            assert all(now[h] != id(keep[h]) for h in cluster.hosts)
            with_slice = listing()
            assert sum(d.slices for d in with_slice.devices) == 4 and with_slice == fresh()
            cluster.mark_lost("h03", "test")
            lost = listing()
            assert {d.state for d in lost.devices if d.host == "h03"} == {pb.DEVICE_STATE_LOST} and lost == fresh()

    asyncio.run(run())


def test_a_host_listing_is_exact_and_rebuilds_only_the_hosts_that_changed(make_core: MakeCore) -> None:
    """ListHosts keeps each host's encoded entry: every listing equals the hosts built field by
    field (ready, stalled, lost; a host registered again at a new address), and a listing after
    one heartbeat encodes that host again and no other."""
    async def run() -> None:
        with make_core("h.db", load_slices=False) as core:
            cluster = core.cluster
            for i in range(12):
                cluster.register(registration(f"h{i:02d}", ISLANDS[i % 2]), WorkerLink(f"h{i:02d}"))
            offset = time.time() - time.monotonic()

            def expected(stalled: frozenset[str] = frozenset()) -> list[pb.Host]:
                out = []
                for h in sorted(cluster.hosts.values(), key=lambda h: (h.island, h.name)):
                    state = host_state(h.state)
                    if h.state == READY and h.name in stalled:
                        state = pb.HOST_STATE_STALLED
                    beat = stamp(offset + h.last_seen) if h.state == READY else iso(h.last_heartbeat)
                    out.append(pb.Host(id=h.id, name=h.name, island=h.island, address=h.address, state=state,
                                       pid=h.pid, last_heartbeat=beat, devices=len(h.device_ids),
                                       device_kind=h.kind))
                return out

            def built() -> dict[str, int]:
                return {h: id(row) for h, (_, row) in host_rows_of(cluster)._entries.items()}

            host_rows_of(cluster)._offset = offset  # the test's reading of the clocks
            first = list_hosts(cluster)
            assert list(first.hosts) == expected() and first.total == 12
            before = built()
            assert list_hosts(cluster) == first and built() == before  # nothing changed: nothing rebuilt
            cluster.heartbeat("h05", cpb.Heartbeat())
            cluster.hosts["h05"].last_seen += 1.0  # a beat a second later, whatever the clock's resolution
            after_beat = list_hosts(cluster)
            now = built()
            assert {h for h in now if now[h] != before[h]} == {"h05"}
            assert list(after_beat.hosts) == expected()
            stalled = frozenset({"h02", "h07"})
            assert list(list_hosts(cluster, stalled=stalled).hosts) == expected(stalled)
            cluster.mark_lost("h03", "test")
            lost = list_hosts(cluster)
            assert [h.state for h in lost.hosts if h.name == "h03"] == [pb.HOST_STATE_LOST]
            assert list(lost.hosts) == expected()
            again = registration("h03", ISLANDS[1])
            again.address, again.pid, again.device_count = "127.0.0.3:4242", 77, 2
            cluster.register(again, WorkerLink("h03"))
            back = [h for h in list_hosts(cluster).hosts if h.name == "h03"]
            assert [(h.address, h.pid, h.devices, h.state) for h in back] == [("127.0.0.3:4242", 77, 2,
                                                                               pb.HOST_STATE_READY)]
            assert list(list_hosts(cluster).hosts) == expected()

    asyncio.run(run())


def test_a_burst_of_registrations_is_one_transaction(make_core: MakeCore) -> None:
    """Registrations queued while the writer is busy commit together (the writer's batching),
    and the event loop waits on none of them."""
    async def run() -> int:
        commits = 0

        def commit(conn: Any) -> None:
            nonlocal commits
            commits += 1

        gate = threading.Event()
        with make_core("b.db", load_slices=False) as core:
            event.listen(core.engine, "commit", commit)
            try:
                busy = core.writer.submit(lambda s: gate.wait(30))  # the writer is in a transaction
                for i in range(64):
                    core.cluster.register(registration(f"h{i}", ISLANDS[i % 2]), WorkerLink(f"h{i}"))
                assert not busy.done() and len(core.cluster.hosts) == 64  # registered without the database
                gate.set()
                core.writer.submit(lambda s: None).result(timeout=30)
                with core.db() as s:
                    assert s.scalar(select(func.count()).select_from(HostRow)) == 64
                return commits
            finally:
                gate.set()

    assert asyncio.run(run()) <= 3  # the busy job's, the burst's (and the barrier's)


def test_listings_page_in_order_and_filter(make_core: MakeCore) -> None:
    async def run() -> None:
        with make_core("p.db", load_slices=False) as core:
            cluster = core.cluster
            names = [f"h{i:02d}" for i in range(10)]
            for i, name in enumerate(reversed(names)):
                cluster.register(registration(name, ISLANDS[i % 2], devices=3), WorkerLink(name))
            cluster.mark_lost("h03", "test")
            full = list_hosts(cluster)
            assert full.total == 10 and not full.next_page_token
            expected = sorted((h.island, h.name) for h in full.hosts)
            assert [(h.island, h.name) for h in full.hosts] == expected
            paged, token = [], ""
            while True:
                page = list_hosts(cluster, limit=3, page_token=token)
                assert page.total == 10
                paged += [(h.island, h.name) for h in page.hosts]
                token = page.next_page_token
                if not token:
                    break
            assert paged == expected
            lost = list_hosts(cluster, state=pb.HOST_STATE_LOST)
            assert [h.name for h in lost.hosts] == ["h03"] and lost.total == 1
            devices, token = [], ""
            while True:
                dpage = list_devices(cluster, ISLANDS[0], limit=4, page_token=token)
                assert dpage.total == 15
                devices += [(d.host, d.local_index) for d in dpage.devices]
                token = dpage.next_page_token
                if not token:
                    break
            assert devices == [(d.host, d.local_index) for d in list_devices(cluster, ISLANDS[0]).devices]
            assert len(devices) == 15
            gone = list_devices(cluster, state=pb.DEVICE_STATE_LOST)
            assert {d.host for d in gone.devices} == {"h03"} and gone.total == 3
            islands = {i.name: (i.hosts, i.devices, i.available_devices) for i in cluster.island_protos()}
            lost_island = cluster.hosts["h03"].island
            assert islands[lost_island] == (5, 15, 12)
            from server.controller.errors import InvalidArgument
            with pytest.raises(InvalidArgument, match="invalid page token"):
                list_hosts(cluster, page_token="not-a-token")

    asyncio.run(run())


def test_heartbeat_interval_grows_with_the_cluster_and_workers_hear_of_it(make_core: MakeCore) -> None:
    assert [beat_interval(1.0, n) for n in (1, 256, 257, 512, 513, 1024, 1025, 2048, 100_000)] == [
        1, 1, 2, 2, 4, 4, 7, 7, 7]
    assert beat_interval(0.2, 600) == 0.8 and beat_interval(8.0, 5000) == 8.0

    async def run() -> None:
        with make_core("h.db", load_slices=False, heartbeat_timeout=5.0) as core:
            cluster = core.cluster
            links = []
            for i in range(513):
                link = WorkerLink(f"h{i}")
                links.append(link)
                cluster.register(registration(f"h{i}", ISLANDS[i % 2], devices=1), link)
            assert cluster.heartbeat_interval == 4.0 and cluster.heartbeat_timeout == 8.0
            first: list[cpb.ControllerToWorker] = []
            while not links[0]._queue.empty():
                first.append(links[0]._queue.get_nowait())  # type: ignore[arg-type]
            assert [m.heartbeat.heartbeat_interval_s for m in first if m.HasField("heartbeat")] == [2.0, 4.0]
            assert links[-2]._queue.qsize() == 1  # one notice each, at a step

    asyncio.run(run())


def test_after_a_restart_hosts_have_a_window_that_grows_with_the_cluster(make_core: MakeCore) -> None:
    async def run(register: int) -> Cluster:
        with make_core("r.db", load_slices=False, heartbeat_timeout=2.0) as core:
            for i in range(register):
                core.cluster.register(registration(f"h{i}", ISLANDS[0]), WorkerLink(f"h{i}"))
            return core.cluster

    asyncio.run(run(400))

    async def restarted() -> None:
        with make_core("r.db", heartbeat_timeout=2.0) as core:  # the same database: a restart
            cluster = core.cluster
            assert {h.state for h in cluster.hosts.values()} == {RECONNECTING}
            start = 1000.0
            closes = cluster.open_reconnect_window(start)
            assert closes == pytest.approx(start + 2.0 + 400 * 0.005)
            cluster.check_silence(start + 3.5)  # past the plain timeout, inside the window
            assert {h.state for h in cluster.hosts.values()} == {RECONNECTING}
            cluster.register(registration("h0", ISLANDS[0]), WorkerLink("h0"))
            cluster.check_silence(closes + 0.1)
            states = {h.name: h.state for h in cluster.hosts.values()}
            assert states.pop("h0") == READY and set(states.values()) == {LOST}

    asyncio.run(restarted())


@pytest.mark.cluster(islands=2, devices=2)
def test_cli_lists_filter_and_limit(cluster: Any) -> None:
    """`host list` and `device list` against a real controller: --island, --state, --limit (the
    rest counted on stderr), and every page read back in order."""
    hosts = cluster.pwctl_json("host", "list")["items"]
    assert [h["name"] for h in hosts] == ["w-a", "w-b"]
    r = cluster.pwctl("host", "list", "--limit", "1", "-o", "json")
    assert r.returncode == 0, r.stderr
    assert [h["name"] for h in json.loads(r.stdout)["items"]] == ["w-a"]
    assert "1 of 2 hosts shown" in r.stderr
    assert cluster.pwctl_json("host", "list", "--state", "lost")["items"] == []
    assert len(cluster.pwctl_json("host", "list", "--state", "ready")["items"]) == 2
    devices = cluster.pwctl_json("device", "list", "--island", "b", "--state", "available")["items"]
    assert [(d["host"], d["local_index"]) for d in devices] == [("w-b", 0), ("w-b", 1)]
    r = cluster.pwctl("device", "list", "--limit", "3")
    assert r.returncode == 0 and "3 of 4 devices shown" in r.stderr
    bad = cluster.pwctl("device", "list", "--state", "sleepy")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


async def _simulated(make_core: MakeCore, tmp_path: Path, hosts: int) -> dict[str, int]:
    """A controller core served over real gRPC in this process (no monitor: its scan of every
    host each tick is a tick's cost, not an event's), `hosts` simulated workers registering and
    heartbeating through `bench.simworkers`: the SQL statements their registrations and a
    heartbeat flush cost."""
    from grpc import aio

    from bench.simworkers import SimWorkers
    from schemas.pathways.v1 import controller_pb2_grpc as cgrpc
    from server.controller.servicer import ControllerServicer

    with make_core(f"s{hosts}.db", heartbeat_interval=0.2) as core:
        meter = Meter(core)
        server = aio.server()
        cgrpc.add_ControllerServicer_to_server(ControllerServicer(core), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        sim = SimWorkers(f"127.0.0.1:{port}", hosts, (4,), 4, log=tmp_path / f"sim{hosts}.log")
        try:
            reg = await asyncio.to_thread(sim.wait_registered, None, 0.0, 30.0)
            assert reg["ok"], reg
            await asyncio.to_thread(meter.settle)
            islands = len(core.cluster.islands)  # one INSERT each, with its first host
            out = {"per registration": (meter.statements - islands) // hosts,
                   "left over": (meter.statements - islands) % hosts}
            beats = sim.status()["heartbeats"]
            while sim.status()["heartbeats"] < beats + 2 * hosts:  # every host beats twice more
                await asyncio.sleep(0.05)
            await asyncio.to_thread(meter.settle)
            out["heartbeats"] = meter.statements - islands - hosts * out["per registration"] - out["left over"]
            before = meter.statements
            core.cluster.flush_heartbeats()
            await asyncio.to_thread(meter.settle)
            out["flush"] = meter.statements - before
            return out
        finally:
            await asyncio.to_thread(sim.close)
            core.cluster.closing = True
            core.end_streams()
            await server.stop(0.5)


def test_simulated_workers_cost_the_same_statements_per_host_at_8_and_32(make_core: MakeCore,
                                                                        tmp_path: Path) -> None:
    small = asyncio.run(_simulated(make_core, tmp_path, 8))
    large = asyncio.run(_simulated(make_core, tmp_path, 32))
    assert small == large, f"8 hosts: {small}, 32 hosts: {large}"
    assert small["left over"] == 0 and small["heartbeats"] == 0 and small["flush"] == 1


async def _gang_program(core: Controller, links: dict[str, WorkerLink]) -> tuple[Any, str]:
    """Registers `links`' hosts in island "big" (and one elsewhere), a slice over all of their
    devices with its group formed, and a one-node program on it: (the session, the program id)."""
    from bench.gang import FUNCTION, one_node_graph
    from server.controller.client_session import ClientSession

    for name, link in links.items():
        core.cluster.register(registration(name, "big"), link)
    core.cluster.register(registration("other", "small"), WorkerLink("other"))
    core.slices.create(cpb.SliceSpec(name="gang", devices=4 * len(links), island="big"), False, "")
    core.groups.want("big")
    deadline = time.monotonic() + 30
    while (g := core.groups.current.get("big")) is None:
        assert time.monotonic() < deadline, "the island's group did not start forming"
        await asyncio.sleep(0.05)
    for member in g.members:
        core.groups.joined(member, g.number, "")
    assert core.groups.usable("big") is g and len(g.members) == len(links)
    session = ClientSession(client_id="c1", id_prefix=1, name="t", job_id="", priority=0, weight=1.0,
                            sequential=False)
    registered = core.sessions.register_program(
        session, cpb.RegisterProgram(request_id=1, graph=one_node_graph(), functions=[FUNCTION]))
    assert registered.program_id, registered.error
    return session, registered.program_id


async def _gang_costs(make_core: MakeCore, n: int) -> dict[str, Work]:
    """A controller core (as `costs`), `n` hosts of 4 devices in one island, a slice over all
    of them (their group formed: a real coordination service, and each member's GroupJoined
    handed to the groups as the WorkerConnect handler hands it), a one-node program on it: the
    work of one run's admission and dispatch (submit, then the flush into the worker links), of
    its completion (each member's report), and of the next run's after a host elsewhere
    registered (the cached cut re-checked against the placement)."""
    with make_core(f"g{n}.db") as core:
        meter = Meter(core)
        links = {f"h{i:03d}": WorkerLink(f"h{i:03d}") for i in range(n)}
        try:
            session, program_id = await _gang_program(core, links)
            runs = iter(range(1, 100))

            def submit() -> None:
                r = next(runs)
                core.dispatcher.submit(session, cpb.RunProgram(run_id=r, program_id=program_id,
                                                               output_ids=[1000 + r]))
                core.dispatcher.flush()

            def taken() -> list[tuple[str, Any]]:
                """The tasks the flush put on the links (what the streams would hand to gRPC)."""
                tasks = []
                for name, link in links.items():
                    while not link._queue.empty():
                        msg = link._queue.get_nowait()
                        if isinstance(msg, cpb.ControllerToWorker) and msg.WhichOneof("msg") == "enqueue":
                            tasks += [(name, t) for t in msg.enqueue.tasks]
                return tasks

            def complete(tasks: list[tuple[str, Any]]) -> None:
                for name, t in tasks:
                    core.dispatcher.node_events(name, cpb.NodeEvents(events=[cpb.NodeEvent(
                        run_id=t.run_id, segment=t.segment, seq=t.seq, start_ns=1, end_ns=2, ok=True)]))

            taken()  # the JoinGroups
            submit()  # the first run also registers the segments and the function on every member
            complete(taken())
            out: dict[str, Work] = {}
            with meter.measure() as out["gang run: admit and dispatch"]:
                submit()
            tasks = taken()
            assert sorted(name for name, _ in tasks) == sorted(links)  # one task per member host
            with meter.measure() as out["gang run: completion"]:
                complete(tasks)
            assert not core.dispatcher.runs
            core.cluster.register(registration("other", "small"), WorkerLink("other"))  # elsewhere
            with meter.measure() as out["gang run after a host event"]:
                submit()
            assert len(taken()) == n
            return out
        finally:
            for gen in core.groups.current.values():
                stop_service(gen.service)


@pytest.mark.timeout(120)
def test_a_gang_runs_work_is_linear_in_its_members(make_core: MakeCore) -> None:
    """Admission and dispatch of a node over an island's hosts (issue 31's 512-host island):
    the controller's work per run is a constant per member host, the same at 4, 8 and 16
    members, and small; no database statement on the way."""
    works = {n: asyncio.run(_gang_costs(make_core, n)) for n in (4, 8, 16)}
    lines = {what: {n: w[what].lines for n, w in works.items()} for what in works[4]}
    for what, by_n in lines.items():
        per_member = (by_n[8] - by_n[4]) / 4
        assert by_n[16] - by_n[8] == 8 * per_member, f"{what}: not linear in the members: {lines}"
        assert all(w[what].statements == 0 for w in works.values()), what
    per = {what: (by_n[8] - by_n[4]) / 4 for what, by_n in lines.items()}
    # lines of server/ per member host: today 68, 134 and 105 (135 for completion before h/ctlproxy's
    # observer and scheduler trims, bench/FINDINGS.md 2026-11-27; 99, 134 and 131 before a gang
    # node's admission took its nodes' checks once per plan and its members' tasks were kept as
    # their numbers, outbox.py; 90, 128 and 130 before each message was numbered in its host's
    # order and looked up in the relay groups, relays.py; before bench/FINDINGS.md's 2026-11-25
    # gang entry: 103, 128, and a re-check quadratic in the members). Below the relay threshold
    # (these islands) every host is still one write.
    assert per["gang run: admit and dispatch"] <= 80, per
    assert per["gang run: completion"] <= 135, per
    assert per["gang run after a host event"] <= 115, per


def _opened(part: Any, link: WorkerLink) -> cpb.ControllerToWorker:
    """A relayed part as its host's worker reads it (its signature checked: server/relaysig.py)."""
    inbox = Inbox()
    inbox.link, inbox.key = link.link_id, link.relay_key
    msg = relayed_message(part, inbox)
    assert msg is not None, part.host
    return msg


async def _relay_writes(make_core: MakeCore, n: int, **config: Any) -> tuple[int, dict[str, int]]:
    """A controller core (as `_gang_costs`) with `config` (the relay settings), `n` hosts whose
    links acknowledged their registration: one gang run's admission and dispatch, and what it put
    on the links: (the writes, one per message queued on a worker's stream; each host's tasks,
    whichever way they went)."""
    with make_core(f"r{n}-{len(config)}-{config.get('relay_min_hosts')}.db", **config) as core:
        links = {f"h{i:03d}": WorkerLink(f"h{i:03d}") for i in range(n)}
        try:
            session, program_id = await _gang_program(core, links)

            def drain() -> list[tuple[str, cpb.ControllerToWorker]]:
                out = []
                for name, link in links.items():
                    while not link._queue.empty():
                        msg = link._queue.get_nowait()
                        assert isinstance(msg, cpb.ControllerToWorker)
                        out.append((name, msg))
                return out

            for run in (1, 2):  # the first run also carries the definitions; the second is measured
                drain()
                for link in links.values():
                    link.ack(link.next_seq - 1)  # the workers handled everything so far
                core.dispatcher.submit(session, cpb.RunProgram(run_id=run, program_id=program_id,
                                                               output_ids=[1000 + run]))
                core.dispatcher.flush()
            written = drain()
            tasks: dict[str, int] = {}
            for name, msg in written:
                inner = [(name, msg)] if msg.WhichOneof("msg") != "relay" else [
                    (p.host, _opened(p, links[p.host]))
                    for p in [*msg.relay.messages, *(x for g in msg.relay.gangs for x in gang_parts(g))]]
                for host, m in inner:
                    assert m.seq > 0, "every message for a host is numbered in its host's order"
                    tasks[host] = tasks.get(host, 0) + len(m.enqueue.tasks)
            return len(written), tasks
        finally:
            for gen in core.groups.current.values():
                stop_service(gen.service)


@pytest.mark.timeout(120)
def test_a_gang_node_over_a_large_island_costs_one_write_per_relay(make_core: MakeCore) -> None:
    """With relays (server/controller/relays.py), one gang node's dispatch writes one message per
    relay group to the streams, not one per member host: 2, 4 and 8 writes for 16, 32 and 64
    hosts in groups of 8, every member still getting its one task; without relays, one write
    per host."""
    for n in (16, 32, 64):
        writes, tasks = asyncio.run(_relay_writes(make_core, n, relay_min_hosts=4, relay_group=8))
        assert writes == n // 8, f"{n} hosts: {writes} writes"
        assert tasks == {f"h{i:03d}": 1 for i in range(n)}, tasks
    writes, tasks = asyncio.run(_relay_writes(make_core, 16, relay_min_hosts=0))
    assert writes == 16 and tasks == {f"h{i:03d}": 1 for i in range(16)}
