"""`SliceService.current` and `address`: where a slice runs, kept between calls (the IFRT proxy
asks on every execute) and always what `placement` gives, however the slice or its host moved.
A real cluster registry and slice service over a real SQLite file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas.pathways.v1 import controller_pb2 as cpb
from server.controller.cluster import Cluster
from server.controller.errors import NotFound
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
    cluster = Cluster(db, w.submit, 1.0, 5.0)
    slices = SliceService(db, w.submit, cluster.hosts, lambda name: None)
    cluster.on_host_up.append(slices.host_up)
    cluster.on_host_lost.append(slices.host_lost)
    slices.load()
    cluster.load()
    yield cluster, slices
    assert w.close(10)


def register(cluster: Cluster, name: str, address: str) -> None:
    cluster.register(cpb.RegisterWorker(name=name, island="i", address=address, pid=1, device_kind="cpu",
                                        device_count=1, machine_id="m"), WorkerLink(name))


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

    assert slices.address("s") == host.address
    assert slices.address("s") == host.address
    assert placed == ["s"]  # the second answer was the kept one
    kept = slices.current("s")
    assert kept == placement("s") and slices.current("s") is kept and placed == ["s"]

    # the host registers again at another address: a new record, so the kept answer is stale
    register(cluster, host.name, f"{host.name}:2")
    assert slices.address("s") == f"{host.name}:2" == placement("s").host.address
    assert placed == ["s", "s"]
    assert slices.current("s") == placement("s") and slices.current("s").host is cluster.hosts[host.name]

    # the host is lost: the slice is remapped onto the other host (the slices' epoch moves)
    cluster.mark_lost(host.name, "killed")
    assert slices.address("s") == f"{other}:1" == placement("s").host.address
    assert slices.current("s") == placement("s")

    # the slice is deleted: nothing kept answers for it
    slices.delete("s")
    with pytest.raises(NotFound):
        slices.address("s")
    with pytest.raises(NotFound):
        slices.address("never")
