"""A slice's worker moved under a running `pw` program, as the re-planning tests do it: where the
controller says a slice runs, and a worker frozen until its host is declared lost and replaced
by another at a new address (tests/test_replan_*.py, test_slice_generations.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb
from tests.conftest import wait_for

if TYPE_CHECKING:
    from tests.conftest import LocalCluster


def slice_address(cluster: LocalCluster, island: str = "") -> str:
    """Where the slice (the one on `island`, when given; else the only one) runs, as the controller
    says ("" while it is degraded or unplaced)."""
    with cluster.client() as c:
        placed = [s for s in c.slices()
                  if not island or s.spec.island == island or (s.devices and s.devices[0].island == island)]
    assert len(placed) <= 1, placed
    if not placed:  # (its island known by its devices only, and it has none now)
        return ""
    s = placed[0]
    return s.devices[0].address if s.devices and s.state != cpb.SLICE_STATE_DEGRADED else ""


def move(cluster: LocalCluster, frozen: str, worker: str = "w-a", island: str = "a") -> str:
    """Freezes `worker` (kept in the cluster as `frozen`: stopped, not killed) until its host is
    declared lost, starts another of that name on `island` in its place, at a new address, and
    waits until the slice on `island` runs there; returns that address."""
    old = cluster.hosts()[worker].address
    cluster.stop_worker(worker)
    cluster.workers[frozen] = cluster.workers.pop(worker)
    wait_for(lambda: cluster.hosts()[worker].state == pb.HOST_STATE_LOST, 30, f"{worker} declared lost")
    cluster.add_worker(island, 1, name=worker)
    new = cluster.hosts()[worker].address
    assert new != old
    wait_for(lambda: slice_address(cluster, island) == new, 30, f"the slice on {island} on the new worker")
    return new
