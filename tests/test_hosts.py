"""A cluster across separate hosts (tests/hosts.py): the controller on host 0, a worker on each of
hosts 1 and 2, every client inside the hosts.

(a) a program from host 0 whose arrays go from host 1's island to host 2's (worker to worker,
across hosts) gives NumPy's answer, and that edge went by the TCP link: the hosts share no
/dev/shm, so shared memory must not be chosen; a 64 MiB array moves the same way, bit for bit;
(b) a host's worker killed -9 fails the program using it with a clear error within 15 s, while
the other host keeps working.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import (
    Host,
    Hosts,
    NamespaceUnavailable,
    _pids_in_netns,
    hosts,  # noqa: F401  (the fixture)
    read_until,
)
from test_multihost import Cluster

pytestmark = pytest.mark.timeout(240)

HEARTBEAT_TIMEOUT_S = 3.0
ERROR_BOUND_S = 15.0

# Host 1's island doubles, host 2's adds one: b(a(x)) sends a's output from host 1 to host 2.
PROGRAM = """
import os
import sys
import numpy as np
import pwctl as pw

d1 = pw.make_virtual_device_set().add_slice(devices=2, island=os.environ.get("FIRST", "h1")).devices
d2 = pw.make_virtual_device_set().add_slice(devices=2, island=os.environ.get("SECOND", "h2")).devices
a = pw.pmap(lambda x: x * 2.0, devices=d1)
b = pw.pmap(lambda x: x + 1.0, devices=d2)
c = pw.pmap(lambda x: x - 3.0, devices=d1)

@pw.program
def across(v):
    return b(a(v))

@pw.program
def local(v):
    return c(a(v))

x = np.load(sys.argv[1])
mode = sys.argv[2]
if mode == "once":
    np.save(sys.argv[3], np.asarray(across(x)))
    print("done", flush=True)
else:  # until the program across hosts fails; then host 1's island alone, three times
    n = 0
    while True:
        try:
            r = np.asarray(across(x))
            assert np.allclose(r, x * 2.0 + 1.0)
            n += 1
            print("ok", n, flush=True)
        except Exception as e:
            print("error", type(e).__name__, str(e).replace(chr(10), " "), flush=True)
            break
    for _ in range(3):
        r = np.asarray(local(x))
        assert np.allclose(r, x * 2.0 - 3.0), r
        print("local ok", flush=True)
"""


# 64 MiB made on host 1's island and waited for (materialised there), then read whole on host 2's
# island (worker to worker, by the TCP link) and fetched back: exact. "loop": such moves until one
# fails, then host 2's island alone three times.
BIG = """
import sys
import jax.numpy as jnp
import numpy as np
import pwctl as pw

n = 16 * 2**20  # 64 MiB of float32; every value exact (integers below 2**24, halved, plus one)
vs = pw.make_virtual_device_set()
s1, s2 = vs.add_slice(devices=1, island="h1"), vs.add_slice(devices=1, island="h2")
make = pw.jit(lambda s: jnp.arange(n, dtype=jnp.float32) * s[0], mesh=s1.mesh(("d",)))
take = pw.jit(lambda y: y + 1.0, mesh=s2.mesh(("d",)))
alone = pw.jit(lambda s: s * 3.0, mesh=s2.mesh(("d",)))
seed = np.full((1,), 0.5, np.float32)
want = np.arange(n, dtype=np.float32) * np.float32(0.5) + np.float32(1.0)
if sys.argv[1] == "once":
    y = make(seed).block_until_ready(timeout=120)
    got = np.asarray(take(y))
    assert got.dtype == np.float32 and got.shape == (n,), (got.dtype, got.shape)
    np.testing.assert_array_equal(got, want)
    print("equal", flush=True)
else:
    k = 0
    while True:
        try:
            y = make(seed).block_until_ready(timeout=120)
            got = take(y)
            print("moving", k, flush=True)
            assert float(np.asarray(got)[-1]) == float(want[-1])
            k += 1
        except Exception as e:
            print("error", type(e).__name__, str(e).replace(chr(10), " "), flush=True)
            break
    for _ in range(3):
        assert float(np.asarray(alone(seed))[0]) == 1.5
        print("alone ok", flush=True)
"""


def _cluster(hs: list[Host]) -> Cluster:
    """A controller on host 0, and a worker w<i> on each other host i, its own island h<i>."""
    return Cluster(hs, tuple(f"h{i}" for i in range(1, len(hs))), heartbeat_timeout=HEARTBEAT_TIMEOUT_S)


def test_program_across_hosts_uses_the_network(hosts: Any, tmp_path: Path) -> None:  # noqa: F811
    hs = hosts(3)
    cl = _cluster(hs)
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    x = np.arange(2 * 4096, dtype=np.float32).reshape(2, 4096) / 7.0
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out.npy"
    r = hs[0].run([sys.executable, str(prog), str(tmp_path / "x.npy"), "once", str(out)], timeout=120, **cl.env())
    assert r.returncode == 0 and "done" in r.stdout, f"program failed: {r.stdout}{r.stderr}"
    np.testing.assert_allclose(np.load(out), x * 2.0 + 1.0, rtol=1e-6)

    sender = cl.worker_log(1)
    # the cross-host edge: host 1's worker sent to host 2's worker by the TCP link, never by
    # shared memory (the hosts have separate /dev/shm, mount and network namespaces)
    assert re.search(rf"first transfer to {re.escape(hs[2].ip)}:\d+ by TCP link", sender), sender[-3000:]
    assert "by shared-memory" not in sender, sender[-3000:]

    # the multi-host benchmark's transfer (bench/multihost.py), on the same hosts: 64 MiB made on
    # host 1 and read on host 2 arrive bit for bit, by the TCP link too (a worker logs its first
    # transfer to a peer by each transport: any other way to host 2 would add a line)
    big = tmp_path / "big.py"
    big.write_text(BIG)
    r = hs[0].run([sys.executable, str(big), "once"], timeout=180, **cl.env())
    assert r.returncode == 0 and "equal" in r.stdout, f"the 64 MiB move failed: {r.stdout}{r.stderr}"
    sender = cl.worker_log(1)
    ways = re.findall(rf"first transfer to {re.escape(hs[2].ip)}:\d+ by ([^\n]+?)\s*$", sender, re.M)
    assert ways == ["TCP link"], f"the 64 MiB move to host 2 went by {ways}:\n{sender[-3000:]}"

    # the control: a second worker on host 1 is on the same host, and that edge uses shared memory
    r = hs[1].pwctl("worker", "start", "--island", "h1b", "--devices", "2", "--name", "w1b",
                    "--listen", f"{hs[1].ip}:0", "--server", cl.address, PWCTL_TOKEN=cl.token)
    assert r.returncode == 0, f"worker start: {r.stdout}{r.stderr}"
    r = hs[0].run([sys.executable, str(prog), str(tmp_path / "x.npy"), "once", str(out)], timeout=120,
                  FIRST="h1", SECOND="h1b", **cl.env())
    assert r.returncode == 0 and "done" in r.stdout, f"program failed: {r.stdout}{r.stderr}"
    np.testing.assert_allclose(np.load(out), x * 2.0 + 1.0, rtol=1e-6)
    sender = cl.worker_log(1)
    assert re.search(rf"first transfer to {re.escape(hs[1].ip)}:\d+ by shared-memory", sender), sender[-3000:]


def kill_mid_run(proc: Any, host: Any, worker: str, survivor_line: str, lines: list[str]) -> None:
    """Kills every process of `host` (its worker is `worker`) while `proc` runs: the program's
    next line is an error within ERROR_BOUND_S, one line naming what was lost (the host or its
    worker), no traceback; then the program goes on (three `survivor_line`s) and exits 0."""
    assert host.kill_all(), f"{worker}'s host had no processes to kill"
    t0 = time.monotonic()
    err = read_until(proc, "error", t0 + ERROR_BOUND_S, lines)
    assert err is not None, f"no error within {ERROR_BOUND_S:g} s of killing {worker}'s host:\n{''.join(lines)}"
    assert time.monotonic() - t0 < ERROR_BOUND_S
    assert re.search(rf"{worker}|host|worker|lost|unavailable", err, re.IGNORECASE), err
    assert "Traceback" not in err
    for _ in range(3):
        assert read_until(proc, survivor_line, time.monotonic() + 60, lines), "".join(lines)
    assert proc.wait(timeout=30) == 0, "".join(lines)


def test_killed_host_fails_its_program_and_the_other_host_works(hosts: Any, tmp_path: Path) -> None:  # noqa: F811
    hs = hosts(3)
    cl = _cluster(hs)
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    x = np.arange(2 * 256, dtype=np.float32).reshape(2, 256)
    np.save(tmp_path / "x.npy", x)
    proc = hs[0].popen([sys.executable, str(prog), str(tmp_path / "x.npy"), "loop"], **cl.env())
    lines: list[str] = []
    try:
        assert read_until(proc, "ok 3", time.monotonic() + 90, lines), "".join(lines)
        kill_mid_run(proc, hs[2], "w2", "local ok", lines)  # host 1 keeps working: its island alone
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)



def test_a_transfer_whose_sender_dies_fails_cleanly(hosts: Any, tmp_path: Path) -> None:  # noqa: F811
    """Host 1 (the sender of 64 MiB moves to host 2) killed -9 while they run: the move that was
    under way fails within 15 s with a one-line error, and host 2's worker (the receiver, perhaps
    with half an array read) keeps serving its island."""
    hs = hosts(3)
    cl = _cluster(hs)
    prog = tmp_path / "big.py"
    prog.write_text(BIG)
    proc = hs[0].popen([sys.executable, str(prog), "loop"], **cl.env())
    lines: list[str] = []
    try:
        assert read_until(proc, "moving 2", time.monotonic() + 120, lines), "".join(lines)
        kill_mid_run(proc, hs[1], "w1", "alone ok", lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    receiver = cl.worker_log(2)
    assert "Traceback" not in receiver, receiver[-3000:]


ECHO_SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
c.sendall(socket.gethostname().encode())
"""


@pytest.mark.parametrize("use_netns", [True, False], ids=["ip-netns", "unshare-holders"])
def test_hosts_are_separate(tmp_path: Path, use_netns: bool) -> None:
    """Both ways of making hosts: own hostname, own /dev/shm, and reachable only from each other."""
    if os.geteuid() != 0:
        pytest.skip("separate hosts need root (network, mount and UTS namespaces)")
    made = Hosts(tmp_path / "hosts", _use_netns=use_netns)
    try:
        try:
            h0, h1 = made.start(2)
        except NamespaceUnavailable as e:
            pytest.skip(f"cannot make network namespaces here: {e}")
        assert (made._netns != []) == use_netns
        marker = f"/dev/shm/pw-host-test-{os.getpid()}"
        assert h1.run(["sh", "-c", f"touch {marker}"]).returncode == 0
        assert h0.run(["test", "-e", marker]).returncode != 0, "host 0 sees host 1's /dev/shm"
        assert not Path(marker).exists(), "the root namespace sees host 1's /dev/shm"
        server = h1.popen([sys.executable, "-c", ECHO_SERVER, h1.ip])
        try:
            port = int(server.stdout.readline())  # type: ignore[union-attr]
            r = h0.python(f"import socket; print(socket.create_connection(('{h1.ip}', {port}), timeout=5).recv(64)"
                          ".decode())")
            assert r.returncode == 0 and r.stdout.strip() == h1.hostname, r.stdout + r.stderr
        finally:
            server.kill()
            server.wait(timeout=10)
        inodes = [h0.inode, h1.inode]
    finally:
        made.close()
    assert all(not _pids_in_netns(i) for i in inodes), "processes left in the hosts' namespaces"
