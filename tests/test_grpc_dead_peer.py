"""A worker whose controller's host vanishes (no FIN, no RST) finds out within ~20 s.

Separate hosts (tests/hosts.py): the controller on host 0, a worker on host 1. Host 0 is cut off
(its link down, then its processes killed -9). The worker's heartbeats then go unanswered; its
channel's keepalive options make gRPC set TCP_USER_TIMEOUT (20 s, pwctl/transport.py) on the
socket, so the stream fails and the worker says so and tries to reconnect, instead of retransmitting
for the kernel's ~15 minutes (a gRPC client socket without keepalive carries no TCP_USER_TIMEOUT:
docs/facts.md, "Peers that vanish")."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest
from hosts import hosts, start_controller  # noqa: F401  (the fixture)

from pwctl.transport import KEEPALIVE_TIMEOUT_MS

pytestmark = pytest.mark.timeout(120)

HEARTBEAT_TIMEOUT_S = 3.0  # beats every 1.5 s
SLACK_S = 6.0  # the next beat, gRPC noticing the socket's error, a loaded machine


def test_a_worker_finds_its_controller_host_vanished(hosts: Any) -> None:  # noqa: F811
    ctl_host, w_host = hosts(2)
    address, token = start_controller(ctl_host, HEARTBEAT_TIMEOUT_S)
    r = w_host.pwctl("worker", "start", "--island", "pod", "--devices", "1", "--name", "w1",
                     "--listen", f"{w_host.ip}:0", "--server", address, PWCTL_TOKEN=token)
    assert r.returncode == 0, f"worker start: {r.stdout}{r.stderr}"
    log = w_host.home / "logs" / "worker-w1.log"

    def text() -> str:
        return log.read_text(errors="replace") if log.exists() else ""

    deadline = time.monotonic() + 60
    while "registered as host" not in text():
        assert time.monotonic() < deadline, f"the worker never registered:\n{text()[-3000:]}"
        time.sleep(0.2)
    time.sleep(2 * HEARTBEAT_TIMEOUT_S)  # a few beats answered on the stream

    subprocess.run(ctl_host.argv(["ip", "link", "set", "eth0", "down"]), check=True, timeout=15)
    cut = time.monotonic()
    ctl_host.kill_all()
    bound = KEEPALIVE_TIMEOUT_MS / 1000 + HEARTBEAT_TIMEOUT_S / 2 + SLACK_S
    while "controller stream ended: UNAVAILABLE" not in text():
        assert time.monotonic() - cut < bound, f"no word of the controller's loss in {bound:g} s:\n{text()[-3000:]}"
        time.sleep(0.2)
    took = time.monotonic() - cut
    assert took >= KEEPALIVE_TIMEOUT_MS / 1000 - 1, (took, text()[-3000:])  # by the timeout, not a FIN or RST
