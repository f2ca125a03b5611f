"""A TCP transfer link (server/worker/tcplink.py) whose peer's host vanishes: no FIN, no RST.

Separate hosts (tests/hosts.py), PATHWAYS_TCP_DEAD_PEER_S=3 in every process. A host vanishes as
a host losing power or its network does: its link goes down (its eth0; the bridge then carries
nothing to or from it), then its processes are killed -9, whose closing can no longer leave it.

(a) The receiving end: a sender gone in the middle of a 64 MiB frame (half of it sent) and a
sender gone while idle between frames: the receiver says so for each within the bound, their
threads end and the half-filled array is given back (its resident memory falls); a peer on a live
host that stays idle for twice the bound keeps its connection and then delivers.
(b) The sending end: to a receiver whose host vanished, a send in progress fails within the bound
(ETIMEDOUT, not SEND_TIMEOUT_S's 120 s; transfer.py then falls back to the gRPC stream) and an
idle link is found dead by then, so its next send fails at once.

The programs on the hosts are the link's own classes in a real process each; the test reads what
they print (log lines, thread counts, resident memory) rather than sleeping for an outcome.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest
from hosts import Host, hosts, read_until  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(60)

DEAD_S = 3.0
SLACK_S = 2.5  # the keepalive's one-second ticks and a loaded machine
MiB = 1 << 20

RECEIVER = """
import logging, os, sys, threading
from server.worker.tcplink import TcpReceiver

lock = threading.Lock()

def say(text):
    with lock:  # one write per line: the connections' threads log while the main thread answers
        sys.stdout.write(text + "\\n")
        sys.stdout.flush()

class Say(logging.Handler):
    def emit(self, record):
        say("log " + record.getMessage())

logging.getLogger().addHandler(Say())
logging.getLogger().setLevel(logging.INFO)
rx = TcpReceiver(sys.argv[1], "tok", lambda h, a: say(f"delivered {h.buffer_id:#x} {0 if a is None else a.nbytes}"))
say("address " + rx.start())
for _ in sys.stdin:  # each line asks for the state
    threads = sum(t.name == "pw-tcp-recv" for t in threading.enumerate())
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    say(f"state {threads} {rss}")
"""

SENDER = """
import socket, sys, time
import numpy as np
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb
from server.worker.tcplink import FRAME, FRAME_MAGIC, HELLO, HELLO_MAGIC, TcpPeer

address, mode = sys.argv[1], sys.argv[2]
big = np.arange(16 << 20, dtype=np.float32)  # 64 MiB
small = np.arange(4, dtype=np.float32)

def head(bid, arr):
    return wpb.TransferChunk(buffer_id=bid, array=pb.ArrayProto(dtype="float32", shape=list(arr.shape)))

if mode == "half":  # one frame's prefix, header and half its bytes; then nothing
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    raw = head(0x51, big).SerializeToString()
    s.sendall(HELLO.pack(HELLO_MAGIC, 3) + b"tok" + FRAME.pack(FRAME_MAGIC, len(raw)) + raw)
    s.sendall(big.view(np.uint8)[: big.nbytes // 2])
    print("half", flush=True)
    time.sleep(3600)
peers = [TcpPeer(address, "tok") for _ in range(2 if mode == "two" else 1)]
print("open", flush=True)
for line in sys.stdin:
    if line.strip() == "send":  # a small array on the (first) link
        peers[0].send(head(0x77, small), small)
        print("sent", flush=True)
    elif line.strip() == "go":  # 64 MiB on the first link, then a small array on the second, idle one
        went = time.monotonic()
        for name, peer, arr in (("busy", peers[0], big), ("idle", peers[1], small)):
            if name == "idle":  # the bound and a keepalive tick after the cut, which came before "go"
                time.sleep(max(0.0, went + float(sys.argv[3]) + 1.5 - time.monotonic()))
            started = time.monotonic()
            try:
                peer.send(head(0x88, arr), arr)
                print(name, "sent", flush=True)
            except OSError as e:
                print(name, "failed", f"{time.monotonic() - started:.2f}", e.errno, peer.broken, e, flush=True)
"""


def _vanish(host: Host) -> float:
    """Cuts `host` off (its link down), then kills its processes; the monotonic time of the cut."""
    subprocess.run(host.argv(["ip", "link", "set", "eth0", "down"]), check=True, timeout=15)
    cut = time.monotonic()
    host.kill_all()
    return cut


def _env() -> dict[str, str]:
    return {"PATHWAYS_TCP_DEAD_PEER_S": f"{DEAD_S:g}"}


def _start(host: Host, program: str, *args: str) -> Any:
    return host.popen([sys.executable, "-c", program, *args], stdin=subprocess.PIPE, **_env())


def _line(proc: Any, pattern: str, lines: list[str], within: float = 20.0) -> str:
    line = read_until(proc, pattern, time.monotonic() + within, lines)
    assert line is not None, f"no line {pattern!r}; got:\n{''.join(lines)}"
    return line


class Receiver:
    def __init__(self, host: Host) -> None:
        self.proc = _start(host, RECEIVER, host.ip)
        self.lines: list[str] = []
        self.address = _line(self.proc, "address ", self.lines).split()[1]

    def state(self) -> tuple[int, int]:
        """(its connections' threads, its resident bytes)"""
        self.proc.stdin.write("state\n")
        self.proc.stdin.flush()
        _, threads, rss = _line(self.proc, "state ", self.lines).split()
        return int(threads), int(rss)

    def until(self, want: Any, what: str, within: float = 10.0) -> tuple[int, int]:
        deadline = time.monotonic() + within
        while True:
            state = self.state()
            if want(*state):
                return state
            assert time.monotonic() < deadline, f"{what}: the receiver's state is {state}\n{''.join(self.lines)}"
            time.sleep(0.05)


def test_a_receiver_lets_go_of_senders_whose_hosts_vanished(hosts: Any) -> None:  # noqa: F811
    rx_host, mid_host, idle_host, live_host = hosts(4)
    rx = Receiver(rx_host)
    _, base_rss = rx.state()
    idle = _start(idle_host, SENDER, rx.address, "idle")
    live = _start(live_host, SENDER, rx.address, "idle")
    others: list[str] = []
    _line(idle, "open", others)
    _line(live, "open", others)
    live_opened = time.monotonic()
    mid = _start(mid_host, SENDER, rx.address, "half")
    _line(mid, "half", others)
    _, mid_rss = rx.until(lambda n, rss: n == 3 and rss >= base_rss + 24 * MiB,
                          "three connections, half of the 64 MiB frame resident")

    cut = min(_vanish(mid_host), _vanish(idle_host))
    said: dict[str, float] = {}
    while len(said) < 2:
        line = _line(rx.proc, "log TCP transfer connection", rx.lines, within=DEAD_S + SLACK_S + 5)
        if mid_host.ip in line:
            assert "lost in the middle of buffer 0x51 (67108864 bytes)" in line, line
            said["mid"] = time.monotonic() - cut
        elif idle_host.ip in line:
            assert "ended: the peer stopped answering for 3 s" in line, line
            said["idle"] = time.monotonic() - cut
    assert max(said.values()) <= DEAD_S + SLACK_S, (said, "".join(rx.lines))
    rx.until(lambda n, rss: n == 1 and rss <= mid_rss - 24 * MiB,
              "one connection left, the half-filled array given back", within=3)

    # the live host's peer has been idle for twice the bound: its connection stands, and it delivers
    time.sleep(max(0.0, live_opened + 2 * DEAD_S - time.monotonic()))
    live.stdin.write("send\n")
    live.stdin.flush()
    _line(live, "sent", others)
    _line(rx.proc, "delivered 0x77 16", rx.lines)
    assert not any(mid_host.ip in x and "delivered" in x for x in rx.lines)
    assert rx.state()[0] == 1


def test_a_sender_finds_a_vanished_receiver_within_the_bound(hosts: Any) -> None:  # noqa: F811
    rx_host, tx_host = hosts(2)
    rx = Receiver(rx_host)
    tx = _start(tx_host, SENDER, rx.address, "two", f"{DEAD_S:g}")
    lines: list[str] = []
    _line(tx, "open", lines)
    rx.until(lambda n, rss: n == 2, "both links accepted")
    cut = _vanish(rx_host)
    tx.stdin.write("go\n")
    tx.stdin.flush()
    busy = _line(tx, "busy ", lines, within=DEAD_S + SLACK_S + 5).split()
    failed_at = time.monotonic() - cut
    # busy failed SECONDS ERRNO BROKEN ...: ETIMEDOUT (110), the link marked broken (transfer.py
    # then sends by the gRPC stream)
    assert busy[1:2] == ["failed"] and busy[3:5] == ["110", "True"], lines
    assert failed_at <= DEAD_S + SLACK_S, (failed_at, lines)
    idle = _line(tx, "idle ", lines).split()
    assert idle[1:2] == ["failed"] and float(idle[2]) < 0.5 and idle[3] == "110", lines
