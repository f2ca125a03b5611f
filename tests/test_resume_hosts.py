"""`Resume._wait_hosts` in process (pwctl/api/resume.py): after a controller restart the resuming
client waits for its slices' hosts by name and must leave with their addresses as they are once
the hosts are back. A controller is a real part elsewhere (tests/test_restart_sessions.py); here
a small stand-in answers `hosts()` and `get_slice()` so that the worker registers at a new
address exactly between two of the client's reads, the interleaving that real runs hit about
one time in ten (every later call of the session then went to the old address)."""

from __future__ import annotations

from typing import Any

import pytest

from pwctl.api.resume import Resume
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb

pytestmark = pytest.mark.timeout(30)

OLD, NEW = "127.0.0.1:1001", "127.0.0.1:2002"


class Controller:
    """Host w-a is reconnecting at OLD; it registers at NEW when `hosts()` is asked the
    `registers_at`-th time, before that call answers."""

    def __init__(self, registers_at: int) -> None:
        self.registers_at = registers_at
        self.asked = 0
        self.address, self.state = OLD, pb.HOST_STATE_RECONNECTING

    def hosts(self) -> list[pb.Host]:
        self.asked += 1
        if self.asked == self.registers_at:
            self.address, self.state = NEW, pb.HOST_STATE_READY
        return [pb.Host(name="w-a", address=self.address, state=self.state)]

    def get_slice(self, name: str) -> cpb.Slice:
        return cpb.Slice(name=name, devices=[cpb.VirtualDevice(host="w-a", address=self.address)])


class Slice:
    def __init__(self, info: cpb.Slice) -> None:
        self.info = info

    def _update(self, info: cpb.Slice) -> None:
        self.info = info


class Runtime:
    def __init__(self, client: Controller) -> None:
        self.client = client
        self.closed = False
        self.slices: dict[str, Any] = {"s": Slice(client.get_slice("s"))}


@pytest.mark.parametrize("registers_at", [1, 2, 3])
def test_the_slices_name_the_address_a_host_came_back_at(registers_at: int) -> None:
    rt = Runtime(Controller(registers_at))
    Resume(rt)._wait_hosts(deadline=float("inf"))  # type: ignore[arg-type]
    assert rt.client.state == pb.HOST_STATE_READY
    assert rt.slices["s"].info.devices[0].address == NEW
