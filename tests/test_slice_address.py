"""`SliceService.current` and `holders`: where a slice runs and which worker holds each of its
devices, kept between calls (the IFRT proxy asks on every execute and upload) and always what
`placement` gives, however the slice or its host moved; the holders of a slice spanning hosts
are known while its island's group forms, and `settled` waits for the group. A real cluster
registry, slice service over a real SQLite file, and island groups whose coordination services
are real processes (`sleep`, as in test_groups.py); the workers' joins are told by hand."""

from __future__ import annotations

import asyncio
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_db_writer import controller_parts

from schemas.pathways.v1 import controller_pb2 as cpb
from server.controller import groups as gm
from server.controller.cluster import Cluster
from server.controller.errors import GroupForming, NotFound, Rejected
from server.controller.links import WorkerLink
from server.controller.slices import SliceService
from server.db.engine import make_engine, session_factory
from server.db.models import Base
from server.db.writer import DbWriter

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[Cluster, SliceService]]:
    engine = make_engine(f"sqlite:///{tmp_path / 'a.db'}")
    Base.metadata.create_all(engine)
    db = session_factory(engine)
    w = DbWriter(db)
    cluster, slices = controller_parts(db, w)
    yield cluster, slices
    assert w.close(10)


def register(cluster: Cluster, name: str, address: str) -> None:
    cluster.register(cpb.RegisterWorker(name=name, island="i", address=address, pid=1, device_kind="cpu",
                                        device_count=1, machine_id="m"), WorkerLink(name))


Joins = list[tuple[str, cpb.JoinGroup]]


def island_groups(cluster: Cluster, slices: SliceService,
                  start: Callable[[str, int], subprocess.Popen[bytes]]) -> tuple[gm.IslandGroups, Joins]:
    """Real island groups wired to `cluster` and `slices` as the controller wires them, their
    coordination services started by `start`; with the JoinGroup messages they send (to be
    answered by hand: `groups.joined`)."""
    sent: Joins = []
    groups = gm.IslandGroups(cluster.hosts, cluster.hosts_of, lambda host, msg: sent.append((host, msg.join)),
                             "127.0.0.1", start_service=start)
    cluster.on_host_up.append(groups.host_up)
    cluster.on_host_lost.append(groups.host_lost)
    groups.listeners.append(slices.group_changed)
    slices.groups = groups
    return groups, sent


def test_the_kept_placement_is_the_placement_until_the_slice_or_its_host_changes(
        parts: tuple[Cluster, SliceService], monkeypatch: pytest.MonkeyPatch) -> None:
    cluster, slices = parts
    register(cluster, "w1", "w1:1")
    register(cluster, "w2", "w2:1")
    made = slices.create(cpb.SliceSpec(name="s", devices=1), False, "client:c").slice
    host = next(h for h in cluster.hosts.values() if made.devices[0].device_id in h.device_ids)
    other = "w2" if host.name == "w1" else "w1"
    placed: list[str] = []
    placement = slices.placement
    monkeypatch.setattr(slices, "placement", lambda name: placed.append(name) or placement(name))

    assert slices.current("s").host.address == host.address
    assert slices.current("s").host.address == host.address
    assert placed == ["s"]  # the second answer was the kept one
    assert slices.holders("s").first is host and slices.holders("s") is slices.holders("s")
    kept = slices.current("s")
    assert kept == placement("s") and slices.current("s") is kept and placed == ["s"]

    # the host registers again at another address: a new process, so the old one is lost first
    # (as when its stream ends: the slice may move) and the kept answer is stale
    register(cluster, host.name, f"{host.name}:2")
    now = slices.current("s")
    assert placed == ["s", "s"] and now == placement("s") and slices.current("s") is now
    assert now.host.address in (f"{host.name}:2", f"{other}:1")
    assert slices.holders("s").first.address == now.host.address

    # the host is lost: the slice is remapped onto the other host (the slices' epoch moves)
    cluster.mark_lost(host.name, "killed")
    assert slices.current("s").host.address == f"{other}:1" == placement("s").host.address
    assert slices.current("s") == placement("s")
    assert slices.holders("s").first.address == f"{other}:1"

    # the slice is deleted: nothing kept answers for it
    slices.delete("s")
    with pytest.raises(NotFound):
        slices.current("s")
    with pytest.raises(NotFound):
        slices.holders("never")
    with pytest.raises(NotFound):
        slices.holders("s")


def test_the_holders_of_a_slice_spanning_hosts_are_known_while_its_group_forms(
        parts: tuple[Cluster, SliceService], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice over two hosts has no placement until the island's group formed (a computation
    needs it), but its holders (what an upload needs) are known at once, in the order of the
    group's members; `settled` waits for the group, or fails after its timeout naming why."""
    cluster, slices = parts
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(gm, "SETTLE_S", 0.0)
    services: list[subprocess.Popen[bytes]] = []

    def start(address: str, n: int) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        services.append(proc)
        return proc

    async def main() -> None:
        groups, sent = island_groups(cluster, slices, start)
        register(cluster, "w2", "w2:1")
        register(cluster, "w1", "w1:1")
        made = slices.create(cpb.SliceSpec(name="s", devices=2), False, "client:c").slice
        on = [d.host for d in made.devices]
        assert sorted(on) == ["w1", "w2"]
        with pytest.raises(Rejected, match="spans hosts"):
            slices.current("s")
        held = slices.holders("s")
        assert [h.name for h in held.hosts] == ["w1", "w2"] and held.first is cluster.hosts["w1"]
        assert [held.hosts[k].name for k in held.host_of] == on

        waiting = asyncio.ensure_future(slices.settled("s", 20))
        for _ in range(200):  # the group's service starts (a thread), then the joins go out
            if len(sent) == 2:
                break
            await asyncio.sleep(0.01)
        assert sorted(h for h, _ in sent) == ["w1", "w2"] and not waiting.done()
        with pytest.raises(Rejected, match="group is forming"):
            slices.current("s")
        for host, join in sent:
            groups.joined(host, join.generation, "")
        placed = await asyncio.wait_for(waiting, 5)
        assert placed.gang is not None and placed.host is held.first
        assert [m.name for m in placed.gang.members] == [h.name for h in slices.holders("s").hosts]
        assert [placed.gang.members[k].name for k in placed.gang.member_of] == on

        # a third host registers: a new generation forms, which never completes here
        sent.clear()
        register(cluster, "w3", "w3:1")
        for _ in range(200):
            if sent:
                break
            await asyncio.sleep(0.01)
        assert slices.holders("s").hosts == held.hosts
        with pytest.raises(Rejected, match="group is forming"):
            await slices.settled("s", 0.3)
        groups.close()

    try:
        asyncio.run(main())
    finally:
        for proc in services:
            gm.stop_service(proc)


def test_a_kept_gang_placement_goes_as_soon_as_its_group_does(
        parts: tuple[Cluster, SliceService], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`current` never answers with a group that is gone: a member lost (before the next
    generation is even due), or the group retired while the next one's service starts, moves
    the slices' epoch; `settled` then waits, and says how long it waited when it gives up."""
    cluster, slices = parts
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(gm, "SETTLE_S", 0.0)
    services: list[subprocess.Popen[bytes]] = []
    hold = threading.Event()
    hold.set()

    def start(address: str, n: int) -> subprocess.Popen[bytes]:
        assert hold.wait(20)  # runs in a thread: while it waits, the island's next service "starts"
        proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        services.append(proc)
        return proc

    async def formed(sent: list[tuple[str, cpb.JoinGroup]], groups: gm.IslandGroups, n: int) -> None:
        for _ in range(300):
            if len(sent) == n:
                break
            await asyncio.sleep(0.01)
        assert len(sent) == n, sent
        for host, join in sent:
            groups.joined(host, join.generation, "")
        sent.clear()

    async def main() -> None:
        groups, sent = island_groups(cluster, slices, start)
        for name in ("w1", "w2", "w3"):
            register(cluster, name, f"{name}:1")
        slices.create(cpb.SliceSpec(name="s", devices=2), False, "client:c")
        with pytest.raises(GroupForming):
            slices.current("s")
        await formed(sent, groups, 3)
        kept = slices.current("s")
        assert kept.gang is not None and slices.current("s") is kept
        idle = next(m for m in ("w1", "w2", "w3") if m not in {h.name for h in kept.gang.members})

        # the member holding none of the slice is lost: its group is not usable from now on
        hold.clear()  # ... and the next generation's service takes its time to start
        cluster.mark_lost(idle, "killed")
        with pytest.raises(GroupForming, match=f"{idle}: lost"):
            slices.current("s")
        await asyncio.sleep(0.1)  # the old generation retired; the next one's service is starting
        with pytest.raises(GroupForming, match="group is forming"):
            slices.current("s")
        with pytest.raises(GroupForming, match=r"waited 0\.2 s for it"):
            await slices.settled("s", 0.2)
        waiting = asyncio.ensure_future(slices.settled("s", 20))
        hold.set()
        await formed(sent, groups, 2)
        placed = await asyncio.wait_for(waiting, 5)
        assert placed.gang is not None and placed.gang.generation != kept.gang.generation
        assert slices.current("s") is placed
        groups.close()

    try:
        asyncio.run(main())
    finally:
        hold.set()
        for proc in services:
            gm.stop_service(proc)
