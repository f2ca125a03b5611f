"""The controller's island groups (server/controller/groups.py) in process: generations, joins,
and when an old generation's coordination service may stop (never while a member is in it: its
death would abort that member). Services are real processes (`sleep`), started and stopped."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port

from schemas.pathways.v1 import controller_pb2 as cpb
from server.controller import groups as gm
from server.controller.cluster import LOST, READY, HostInfo
from server.controller.links import WorkerLink

pytestmark = pytest.mark.timeout(30)


def _host(name: str, i: int) -> HostInfo:
    info = HostInfo(id=i, name=name, island="pod", address=f"10.0.0.{i}:700{i}", pid=0, kind="cpu",
                    machine_id=f"m{i}", device_ids=[2 * i, 2 * i + 1], state=READY)
    info.link = WorkerLink(name)
    return info


class Harness:
    def __init__(self, tmp_path: Path, monkeypatch: Any) -> None:
        monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path))
        monkeypatch.setattr(gm, "SETTLE_S", 0.0)
        self.hosts = {n: _host(n, i) for i, n in enumerate(("w1", "w2", "w3"), start=1)}
        self.sent: list[tuple[str, cpb.JoinGroup]] = []
        self.services: list[subprocess.Popen[bytes]] = []
        self.groups = gm.IslandGroups(self.hosts, lambda island: self.hosts.values(), self.send, "127.0.0.1",
                                      start_service=self.start)

    def send(self, host: str, msg: cpb.ControllerToWorker) -> None:
        self.sent.append((host, msg.join))

    def start(self, address: str, n: int) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        self.services.append(proc)
        return proc

    async def settle(self) -> None:
        for _ in range(50):
            await asyncio.sleep(0.01)

    def joins(self) -> dict[str, cpb.JoinGroup]:
        out = {h: j for h, j in self.sent}
        self.sent.clear()
        return out


def test_generations_form_and_old_services_stop_only_when_their_members_left(tmp_path: Path, monkeypatch: Any) -> None:
    async def main() -> None:
        h = Harness(tmp_path, monkeypatch)
        del h.hosts["w3"]
        h.groups.want("pod")
        await h.settle()
        first = h.joins()
        assert sorted(first) == ["w1", "w2"] and {j.num_processes for j in first.values()} == {2}
        assert [first["w1"].process_id, first["w2"].process_id] == [0, 1]
        gen1 = first["w1"].generation
        assert h.groups.usable("pod") is None and "waiting for w1, w2" in h.groups.describe("pod")
        h.groups.joined("w1", gen1, "")
        h.groups.joined("w2", gen1, "")
        assert h.groups.usable("pod") is not None and h.groups.summary("pod") == f"gen {gen1}: 2 hosts"

        # a third host joins long after: a new generation; the old service lives on, however old,
        # until both of its members have joined the new one
        h.groups.current["pod"].started -= 10 * gm.RETIRE_AFTER_S
        h.hosts["w3"] = _host("w3", 3)
        h.groups.host_up(h.hosts["w3"])
        await h.settle()
        second = h.joins()
        gen2 = second["w1"].generation
        assert gen2 > gen1 and sorted(second) == ["w1", "w2", "w3"]
        assert h.groups.usable("pod") is None
        old = h.services[0]
        h.groups.joined("w1", gen2, "")
        assert old.poll() is None, "the old service stopped while w2 was still in it"
        h.groups.joined("w2", gen2, "")
        h.groups.joined("w3", gen2, "")
        assert old.wait(timeout=5) is not None  # stopped: nobody is in it any more
        assert h.groups.usable("pod") is not None

        # a member is lost: the two left re-form; one left alone is told to leave its group
        h.hosts["w3"].state = LOST
        h.groups.host_lost(h.hosts["w3"], "gone")
        await h.settle()
        third = h.joins()
        assert sorted(third) == ["w1", "w2"] and third["w1"].num_processes == 2
        h.hosts["w2"].state = LOST
        h.groups.host_lost(h.hosts["w2"], "gone")
        await h.settle()
        alone = h.joins()
        assert list(alone) == ["w1"] and alone["w1"].num_processes == 1
        assert h.groups.summary("pod") == ""
        for p in h.services:
            if p.poll() is None:
                p.kill()
                p.wait()

    asyncio.run(main())


def test_a_failed_join_or_a_re_registration_forms_the_group_again(tmp_path: Path, monkeypatch: Any) -> None:
    async def main() -> None:
        h = Harness(tmp_path, monkeypatch)
        del h.hosts["w3"]
        h.groups.want("pod")
        await h.settle()
        gen = h.joins()["w1"].generation
        h.groups.joined("w1", gen, "")
        h.groups.joined("w2", gen, "RuntimeError: connect timed out")
        assert "failed to form" in h.groups.describe("pod") and "w2" in h.groups.summary("pod")
        await h.settle()
        again = h.joins()
        assert sorted(again) == ["w1", "w2"] and again["w1"].generation > gen
        gen2 = again["w1"].generation
        for w in ("w1", "w2"):
            h.groups.joined(w, gen2, "")
        assert h.groups.usable("pod") is not None
        h.groups.host_up(h.hosts["w2"])  # w2's stream broke and it registered again: it left the group
        why = h.groups.describe("pod")  # a formed group that lost a member, not one that never formed
        assert "lost a member: w2: it registered again" in why and "failed to form" not in why, why
        await h.settle()
        assert h.joins()["w2"].generation > gen2
        for p in h.services:
            if p.poll() is None:
                p.kill()
                p.wait()

    asyncio.run(main())


def _service(home: Path, controller_pid: int, listed: bool) -> subprocess.Popen[bytes]:
    """A real coordination service whose controller record (in `home`) names `controller_pid`
    and lists the service or not; its checks every 0.2 s, an orphan after 1 s."""
    home.mkdir()
    path = home / "island-services.json"
    port = free_port()
    env = dict(os.environ, PATHWAYS_COORDSVC_CHECK_S="0.2", PATHWAYS_COORDSVC_ORPHAN_S="1")
    proc = subprocess.Popen([sys.executable, "-m", "server.controller.coordsvc", f"127.0.0.1:{port}", "2",
                             str(path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    path.write_text(json.dumps({"controller_pid": controller_pid, "pids": [proc.pid] if listed else []}))
    return proc


def test_a_coordination_service_ends_when_orphaned_not_when_its_controller_lives(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan = _service(tmp_path / "a", gone.pid, listed=True)
    assert orphan.wait(timeout=10) == 0  # its controller is gone (and nobody took over): it ends
    unlisted = _service(tmp_path / "b", os.getpid(), listed=False)
    assert unlisted.wait(timeout=10) == 0  # the controller no longer lists it
    kept = _service(tmp_path / "c", os.getpid(), listed=True)
    time.sleep(2.0)  # twice the orphan time, ten checks
    assert kept.poll() is None, "a listed service of a live controller ended"
    kept.terminate()
    assert kept.wait(timeout=10) == 0
