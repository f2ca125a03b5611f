"""The dispatch probe (server/controller/dispatch_probe.py) on real worker links: what it writes
per run, and that it lets go of what it kept once the runs are over."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb
from server.controller import links
from server.controller.dispatch_probe import DispatchProbe
from server.controller.links import WorkerLink

pytestmark = pytest.mark.timeout(30)


def enqueue(*run_ids: int) -> cpb.ControllerToWorker:
    return cpb.ControllerToWorker(enqueue=wpb.Enqueue(tasks=[wpb.Task(run_id=r, seq=1) for r in run_ids]))


async def take(link: WorkerLink, count: int) -> list[cpb.ControllerToWorker]:
    out = []
    async for msg in link.messages():
        out.append(msg)
        if len(out) == count:
            return out
    return out


def test_the_probe_records_each_runs_last_hand_off_and_keeps_nothing_after() -> None:
    out = io.StringIO()
    probe = DispatchProbe(out)

    async def run() -> None:
        links.on_handed = probe.handed
        try:
            a, b = WorkerLink("a"), WorkerLink("b")
            readers = [asyncio.create_task(take(a, 2)), asyncio.create_task(take(b, 2))]
            await asyncio.sleep(0)  # both streams wait on their links
            probe.arrived(7)
            probe.arrived(8)
            a.send(enqueue(7))
            b.send(enqueue(7, 8))
            a.send(cpb.ControllerToWorker(heartbeat=cpb.HeartbeatSettings(heartbeat_interval_s=2.0)))
            probe.flushed()
            await asyncio.sleep(0.01)
            b.send(enqueue(8))  # run 8's last one, a later pass of the loop
            await asyncio.gather(*readers)
            await asyncio.sleep(0)  # the pass's CPU mark
            probe.finished(7, True, 2)
            assert len(probe._taken) == 2  # run 8 still reads them
            probe.finished(8, True, 2)
        finally:
            links.on_handed = None

    asyncio.run(run())
    recs = {r["run"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert [recs[7]["tasks"], recs[8]["tasks"]] == [2, 2]
    for r in recs.values():
        assert r["arrived"] <= r["queued"] <= r["handed"] and r["cpu"] >= r["queued_cpu"] >= 0
    assert recs[8]["handed"] - recs[7]["handed"] >= 0.009  # run 8's last message left a pass later
    assert probe._taken == [] and probe._marks == {}
