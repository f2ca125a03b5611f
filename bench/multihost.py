"""`python -m bench --only multihost` (issue 27, opt-in: needs root): the benchmarks of islands on
separate hosts, made as network namespaces on this machine (bench/netns.py).

Three hosts: the controller and every client on host 0 (the root namespace has no route to the
hosts), host A (1) and host B (2) with a worker each, islands `a` and `b`, 4 CPU devices each.
Every row compares with its baseline in the same run:

- transfer: a program makes 64 MiB on island a and a computation on island b takes them (worker to
  worker, host A to host B, the worker's gRPC stream), against the same program with both
  computations on island a (no transfer): the difference of the two is the transfer; vs raw TCP
  between the same two namespaces (one socket, the same bytes), windows alternating;
- pipeline: the pipeline suite's 4 stages of 256x256, stages 0-1 on host A's island and 2-3 on
  host B's (one hop between hosts per micro-batch), vs the same stages in one plain-JAX process;
- psum: blocking psum calls over 2 hosts x 2 devices: plain multi-controller `jax.distributed` in
  hosts A and B (gloo at each host's address), and `pw.pmap` over a 4-device slice of island `pod`
  (a worker `--island pod --devices 2` on each of hosts A and B), which needs multi-host islands:
  until the controller has them, that row reports the error it got.

Where namespaces cannot be made (not root, no `ip`/`nsenter`/`unshare`, the kernel refuses) the
suite yields one row saying why.
"""

from __future__ import annotations

import json
import re
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import defs, netns
from bench.suites import Row, paired_ratio, row

NBYTES = 64 * 2**20
GB = 1e9
PSUM_DEVICES = 2  # per host
COORDINATOR_PORT = 23456  # inside host A's namespace, which has nothing else listening
HOST_ENV = {"PATHWAYS_VALIDATE": "0"}  # the tests validate state machines after every stimulus; not here


class SideError(RuntimeError):
    pass


def _side(host: netns.Host, task: str, args: dict[str, Any], **env: str) -> subprocess.Popen[str]:
    return host.popen([sys.executable, "-m", "bench.multihost_side", task, json.dumps(args)],
                      stdin=subprocess.PIPE, **HOST_ENV, **env)


def _ask(proc: subprocess.Popen[str], line: str, timeout: float, seen: list[str]) -> dict[str, Any]:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return _read(proc, timeout, seen)


def _read(proc: subprocess.Popen[str], timeout: float, seen: list[str]) -> dict[str, Any]:
    """The next JSON line of a side process (other lines, e.g. warnings and gloo's, are kept in
    `seen` for the error message)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            out: dict[str, Any] = json.loads(line)
            return out
        seen.append(line.rstrip())
    tail = "\n".join(seen[-15:])
    state = "timed out" if proc.poll() is None else f"exited {proc.returncode}"
    raise SideError(f"{state}: {tail[-1500:] or 'no output'}")


def _stop(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=15)


class Cluster:
    """The controller on host 0; a worker on host A (island a) and host B (island b)."""

    def __init__(self, hosts: list[netns.Host], devices: int = 4) -> None:
        self.hosts = hosts
        h0 = hosts[0]
        r = h0.pwctl("server", "start", "--listen", f"{h0.ip}:0", PATHWAYS_VALIDATE="0")
        m = re.search(r"at (\S+:\d+)", r.stdout)
        if r.returncode != 0 or not m:
            raise SideError(f"server start: {r.stdout}{r.stderr}")
        self.address = m.group(1)
        self.token = (h0.home / "token").read_text().strip()  # beyond loopback the token is required
        for i, island in ((1, "a"), (2, "b")):
            self.worker(i, island, devices, f"w{island}")

    def worker(self, i: int, island: str, devices: int, name: str) -> None:
        h = self.hosts[i]
        r = h.pwctl("worker", "start", "--island", island, "--devices", str(devices), "--name", name,
                    "--listen", f"{h.ip}:0", "--server", self.address, PWCTL_TOKEN=self.token, PATHWAYS_VALIDATE="0")
        if r.returncode != 0:
            raise SideError(f"worker start on {h.hostname}: {(r.stdout + r.stderr).strip()}")

    def env(self) -> dict[str, str]:
        return {"PWCTL_SERVER": self.address, "PWCTL_TOKEN": self.token}

    def worker_log(self, i: int, name: str) -> str:
        return (self.hosts[i].home / "logs" / f"worker-{name}.log").read_text(errors="replace")


def _error_row(variant: str, metric: str, unit: str, e: BaseException) -> Row:
    r = row("multihost", variant, metric, unit, None)
    r["error"] = f"{type(e).__name__}: {e}"
    return r


# ------------------------------------------------------------------------------------- transfer


def transfer(cl: Cluster, windows: int, reps: int) -> Iterator[Row]:
    h0, ha, hb = cl.hosts
    seen: list[str] = []
    recv = _side(hb, "tcp_recv", {"ip": hb.ip, "nbytes": NBYTES})
    procs = [recv]
    try:
        port = _read(recv, 60, seen)["port"]
        procs.append(_side(ha, "tcp_send", {"ip": hb.ip, "port": port, "nbytes": NBYTES}))
        _read(recv, 60, seen)
        pw = _side(h0, "transfer_pw", {"nbytes": NBYTES}, **cl.env())
        procs.append(pw)
        _read(pw, 300, seen)
        tcp: list[float] = []
        move: list[float] = []
        e2e: list[float] = []
        local: list[float] = []
        for _ in range(windows):
            tcp.append(NBYTES / defs.median([_ask(recv, "go", 60, seen)["s"] for _ in range(reps)]) / GB)
            got = _ask(pw, f"go {reps}", 300, seen)
            e2e.append(NBYTES / got["across"] / GB)
            local.append(got["local"])
            diff = got["across"] - got["local"]
            move.append(NBYTES / diff / GB if diff > 0 else float("nan"))
    finally:
        _stop(*procs)
    log = cl.worker_log(1, "wa")
    via = re.search(rf"first transfer to {re.escape(hb.ip)}:\d+ by ([\w -]+)", log)
    transport = via.group(1).strip() if via else "unknown (no 'first transfer' line in host A's worker log)"
    ok = [m for m in move if m == m]
    p = defs.median(ok) if ok else None
    t = defs.median(tcp)
    yield row("multihost", "transfer 64 MiB host A -> B vs raw TCP", "GB/s", "GB/s", p, t, ">= 0.5x raw TCP",
              None if p is None else p >= 0.5 * t,
              f"pathways: 64 MiB / (program across hosts - the same program on one island), medians of {reps} "
              f"calls per window, {windows} windows alternating with raw TCP (one socket between the same two "
              f"namespaces, the same bytes into a preallocated buffer); edge transport: {transport}; windows "
              + "/".join(f"{v:.2f}" for v in move) + " vs TCP " + "/".join(f"{v:.2f}" for v in tcp)
              + f"; the whole program across hosts, 64 MiB over its time: {defs.median(e2e):.2f} GB/s; "
              f"the program on one island: {defs.median(local) * 1e3:.0f} ms",
              paired=paired_ratio([m if m == m else 0.0 for m in move], tcp))



# ------------------------------------------------------------------------------------- pipeline


def pipeline(cl: Cluster, quick: bool) -> Iterator[Row]:
    stages = 4
    mbs = 16 if quick else defs.MICRO_BATCHES
    windows = 2 if quick else 9
    window_s = 0.4 / 3 if quick else 1.0 / 3
    seen: list[str] = []
    proc = _side(cl.hosts[0], "pipeline", {"stages": stages, "micro_batches": mbs, "windows": windows,
                                           "window_s": window_s}, **cl.env())
    try:
        got = _read(proc, 600, seen)
    finally:
        _stop(proc)
    p, j = defs.median(got["pw"]), defs.median(got["jax"])
    yield row("multihost", f"{stages} stages, one hop host A -> B", "micro-batches/s", "1/s", p, j,
              ">= 0.7x one process", p >= 0.7 * j,
              f"{mbs} micro-batches of 256x256 tanh(h @ w) stages on devices {got['devices']} of islands a (host A: "
              "0-3) and b (host B: 4-7), one 1-device slice per stage, one program per micro-batch, all submitted "
              "before blocking; JAX: the same stages on the same device indices back to back in one process "
              f"with 8 devices (on host 0); median of {windows} windows alternating: "
              + "/".join(f"{v:,.0f}" for v in got["pw"]) + " vs JAX " + "/".join(f"{v:,.0f}" for v in got["jax"]),
              paired=paired_ratio(got["pw"], got["jax"]))


# ----------------------------------------------------------------------------------------- psum


def psum(cl: Cluster, quick: bool) -> Iterator[Row]:
    _, ha, hb = cl.hosts
    calls = 100 if quick else 300
    windows = 2 if quick else 7
    seen: list[str] = []
    coordinator = f"{ha.ip}:{COORDINATOR_PORT}"
    members = [_side(h, "psum_member", {"coordinator": coordinator, "process_id": i, "processes": 2, "ip": h.ip,
                                        "devices": PSUM_DEVICES, "calls": calls, "windows": windows})
               for i, h in enumerate((ha, hb))]
    try:
        outs = [_read(m, 600, seen) for m in members]
    finally:
        _stop(*members)
    jx = outs[0]["per_s"]
    j = defs.median(jx)
    jax_note = (f"JAX: two processes (hosts A and B) x {PSUM_DEVICES} CPU devices, jax.distributed (coordinator on "
                f"host A), gloo at each host's own address, jax.pmap(psum(x) * 0.25 + 1, axis over the "
                f"{outs[0]['global_devices']} devices), both blocking on each call; {windows} windows of "
                f"{calls} calls: "
                + "/".join(f"{v:,.0f}" for v in jx))
    # the Pathways side: one island `pod` of a worker on each host (needs multi-host islands)
    err = ""
    pw: list[float] = []
    try:
        for i in (1, 2):
            cl.worker(i, "pod", PSUM_DEVICES, f"pod{i}")
        proc = _side(cl.hosts[0], "psum_pw", {"island": "pod", "devices": 2 * PSUM_DEVICES, "calls": calls,
                                              "windows": windows}, **cl.env())
        try:
            got = _read(proc, 600, seen)
        finally:
            _stop(proc)
        err = got.get("error", "")
        pw = got.get("per_s", [])
    except SideError as e:
        err = str(e).strip().splitlines()[-1] if str(e).strip() else "SideError"
    variant = f"psum 2 hosts x {PSUM_DEVICES} devices, blocking"
    if err:
        yield row("multihost", variant, "calls/s", "1/s", None, j, ">= 0.9x jax.distributed", None,
                  f"pathways: not available: {err[:300]}; {jax_note}")
        return
    p = defs.median(pw)
    yield row("multihost", variant, "calls/s", "1/s", p, j, ">= 0.9x jax.distributed", p >= 0.9 * j,
              f"pathways: pw.pmap over a {2 * PSUM_DEVICES}-device slice of island pod (a worker --island pod "
              f"--devices {PSUM_DEVICES} on each of hosts A and B), blocking each call, after the JAX side: "
              + "/".join(f"{v:,.0f}" for v in pw) + f"; {jax_note}")


# ------------------------------------------------------------------------------------------ suite


def bench_multihost(quick: bool, env: dict[str, str]) -> Iterator[Row]:
    """The suite (`python -m bench --only multihost`); `env` is unused: each host's processes get
    the driver's environment with that host's PATHWAYS_HOME (bench/netns.py)."""
    why = netns.unavailable()
    if why is None:
        tmp = tempfile.TemporaryDirectory(prefix="pw-multihost-")
        made = netns.Hosts(Path(tmp.name) / "hosts")
        try:
            made.start(3)
        except netns.NamespaceUnavailable as e:
            made.close()
            tmp.cleanup()
            why = f"cannot make network namespaces here: {e}"
    if why is not None:
        yield row("multihost", "skipped", "", "", None, notes=f"skipped: {why}")
        return
    try:
        t0 = time.monotonic()
        cl = Cluster(made.hosts)
        print(f"[bench] multihost: 3 hosts and the cluster up in {time.monotonic() - t0:.0f} s", file=sys.stderr,
              flush=True)
        parts = [
            ("transfer 64 MiB host A -> B vs raw TCP", "GB/s", "GB/s",
             lambda: transfer(cl, 2 if quick else 7, 3 if quick else 5)),
            ("4 stages, one hop host A -> B", "micro-batches/s", "1/s", lambda: pipeline(cl, quick)),
            (f"psum 2 hosts x {PSUM_DEVICES} devices, blocking", "calls/s", "1/s", lambda: psum(cl, quick)),
        ]
        for variant, metric, unit, part in parts:
            t1 = time.monotonic()
            try:
                yield from part()
            except Exception as e:
                yield _error_row(variant, metric, unit, e)
            print(f"[bench] multihost {variant}: {time.monotonic() - t1:.0f} s", file=sys.stderr, flush=True)
    finally:
        made.close()
        tmp.cleanup()
