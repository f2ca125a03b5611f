"""`python -m bench --only multihost` (issue 27, opt-in: needs root): the benchmarks of islands on
separate hosts, made as network namespaces on this machine (bench/netns.py).

Three hosts: the controller and every client on host 0 (the root namespace has no route to the
hosts), host A (1) and host B (2) with a worker each, islands `a` and `b`, 4 CPU devices each.
Every row compares with its baseline in the same run:

- transfer: a 64 MiB array already made on island a (host A) and waited for; a computation
  reading it on island b (moved worker to worker, host A to host B, by the TCP link) against the
  same computation on island a (read in place): the difference of the two is the transfer; vs raw
  TCP between the same two namespaces (one socket, the same bytes), windows alternating. Two
  context rows time a program that makes the 64 MiB and reads them on b, minus the same on a;
  they count producing the bytes too (bench/FINDINGS.md);
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
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import defs, netns
from bench.rows import Row, paired_ratio, row

NBYTES = 64 * 2**20
GB = 1e9
PSUM_DEVICES = 2  # per host
COORDINATOR_PORT = 23456  # inside host A's namespace, which has nothing else listening
HOST_ENV = {"PATHWAYS_VALIDATE": "0"}  # the tests validate state machines after every stimulus; not here


class SideError(RuntimeError):
    pass


class Side:
    """A bench.multihost_side process on a host: its stdout (stderr merged) read by a thread into
    a queue, so that a JSON line after other lines (warnings, gloo's) is never left in a buffer."""

    def __init__(self, host: netns.Host, task: str, args: dict[str, Any], **env: str) -> None:
        self.proc = host.popen([sys.executable, "-m", "bench.multihost_side", task, json.dumps(args)],
                               stdin=subprocess.PIPE, **HOST_ENV, **env)
        self.task = task
        self.lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self.seen: list[str] = []  # its other lines, for the error message
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def read(self, timeout: float) -> dict[str, Any]:
        """Its next JSON line."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self.proc.wait(timeout=15)
                break
            if line.startswith("{"):
                out: dict[str, Any] = json.loads(line)
                return out
            self.seen.append(line.rstrip())
        state = "timed out" if self.proc.poll() is None else f"exited {self.proc.returncode}"
        tail = "\n".join(self.seen[-15:])
        raise SideError(f"{self.task} {state}: {tail[-1500:] or 'no output'}")

    def ask(self, line: str, timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=15)


def _stop(*sides: Side) -> None:
    for side in sides:
        side.stop()


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
    recv = Side(hb, "tcp_recv", {"ip": hb.ip, "nbytes": NBYTES})
    procs: list[Side] = [recv]
    try:
        port = recv.read(60)["port"]
        procs.append(Side(ha, "tcp_send", {"ip": hb.ip, "port": port, "nbytes": NBYTES}))
        recv.read(60)
        pw = Side(h0, "transfer_pw", {"nbytes": NBYTES}, **cl.env())
        procs.append(pw)
        pw.read(300)
        tcp: list[float] = []
        moved: list[float] = []  # the headline: a materialised array moved (a call on b - the same on a)
        move: list[float] = []  # the program making them on A, read on B, minus the same on A (fused)
        kept: list[float] = []
        e2e: list[float] = []
        local: list[float] = []
        local_kept: list[float] = []
        calls: list[tuple[float, float]] = []

        def rate(diff: float) -> float:
            return NBYTES / diff / GB if diff > 0 else float("nan")

        for _ in range(windows):
            tcp.append(NBYTES / defs.median([recv.ask("go", 60)["s"] for _ in range(reps)]) / GB)
            got = pw.ask(f"go {reps}", 300)
            moved.append(rate(got["moved"] - got["in_place"]))
            calls.append((got["moved"], got["in_place"]))
            e2e.append(NBYTES / got["across"] / GB)
            local.append(got["local"])
            local_kept.append(got["local_kept"])
            move.append(rate(got["across"] - got["local"]))
            kept.append(rate(got["across_kept"] - got["local_kept"]))
    finally:
        _stop(*procs)
    log = cl.worker_log(1, "wa")
    via = re.search(rf"first transfer to {re.escape(hb.ip)}:\d+ by ([\w -]+)", log)
    transport = via.group(1).strip() if via else "unknown (no 'first transfer' line in host A's worker log)"
    t = defs.median(tcp)
    tcp_note = " vs TCP " + "/".join(f"{v:.2f}" for v in tcp)

    def med(values: list[float]) -> float | None:
        ok = [v for v in values if v == v]
        return defs.median(ok) if ok else None

    def paired(values: list[float]) -> float | None:
        return paired_ratio([v if v == v else 0.0 for v in values], tcp)

    p = med(moved)
    yield row("multihost", "transfer 64 MiB host A -> B vs raw TCP", "GB/s", "GB/s", p, t, ">= 0.5x raw TCP",
              None if p is None else p >= 0.5 * t,
              f"pathways: a materialised 64 MiB array (float32, made on host A's worker and waited for, untimed) "
              f"read by a computation on island b (moved worker to worker, host A to B) minus the same "
              f"computation on island a (read in place): 64 MiB / the difference of the two calls' times, "
              f"medians of {reps} calls per window (a fresh array each call), {windows} windows alternating "
              f"with raw TCP (one socket between the same two namespaces, the same bytes `sendall` into a "
              f"preallocated buffer by `recv_into`); edge transport: {transport}; windows "
              + "/".join(f"{v:.2f}" for v in moved) + tcp_note
              + "; the calls on b / on a, ms: " + "/".join(f"{b * 1e3:.0f}-{a * 1e3:.0f}" for b, a in calls),
              paired=paired(moved))
    yield row("multihost", "transfer 64 MiB A -> B, program making them (producing counted)", "GB/s", "GB/s",
              med(move), t,
              notes="the headline row until 2026-11-25 evening: a program making the 64 MiB on island a and "
              "reading them on island b, minus the same program on island a alone; on one island XLA fuses "
              "the two computations and never writes the 64 MiB, so the difference also counts writing them "
              "(fresh memory, page faults) as transfer; windows "
              + "/".join(f"{v:.2f}" for v in move) + tcp_note
              + f"; the whole program across hosts, 64 MiB over its time: {defs.median(e2e):.2f} GB/s; "
              f"the program on one island: {defs.median(local) * 1e3:.0f} ms",
              paired=paired(move))
    yield row("multihost", "transfer 64 MiB A -> B, program making them, both writing them", "GB/s", "GB/s",
              med(kept), t,
              notes="as the row above, but both programs also return the 64 MiB (a second output, not "
              "fetched), so that the one-island program writes them too; a difference of two ~100 ms "
              "program times, the noisiest row; windows "
              + "/".join(f"{v:.2f}" for v in kept) + tcp_note
              + f"; the one-island program writing them: {defs.median(local_kept) * 1e3:.0f} ms",
              paired=paired(kept))
    yield from stream_alone(cl, t, rounds=2 if windows <= 2 else 4, reps=3)


STREAM_VARIANTS: list[tuple[int, str]] = [(4 * 2**20, "current"), (2**20, "current"), (2**20, "in_place")]


def stream_alone(cl: Cluster, tcp: float, rounds: int, reps: int) -> Iterator[Row]:
    """Where the transfer's time goes: the worker's chunked gRPC stream alone (transfer.py's
    `chunks` at a chunk size, or built in place; a receiver assembling as servicer.py does),
    host A to host B, the variants taking turns; informational rows against raw TCP's figure."""
    _, ha, hb = cl.hosts
    recv = Side(hb, "stream_recv", {"ip": hb.ip})
    sides = [recv]
    try:
        port = recv.read(60)["port"]
        send = Side(ha, "stream_send", {"address": f"{hb.ip}:{port}", "nbytes": NBYTES, "variants": STREAM_VARIANTS,
                                        "rounds": rounds, "reps": reps})
        sides.append(send)
        out = send.read(600)
        calls = [recv.read(30) for _ in range(len(STREAM_VARIANTS) * (1 + rounds * reps))]
    finally:
        _stop(*sides)
    body = calls[len(STREAM_VARIANTS):]  # after one warm-up call per variant
    for vi, (size, how) in enumerate(STREAM_VARIANTS):
        mine = [body[i] for i in range(len(body)) if (i // reps) % len(STREAM_VARIANTS) == vi]
        got = out[f"{size} {how}"]

        def ms(field: str, mine: list[dict[str, Any]] = mine) -> str:
            return f"{defs.median([m[field] for m in mine]) * 1e3:.0f} ms"

        gbs = NBYTES / got["s"] / GB
        label = {(4 * 2**20, "current"): " (the former TRANSFER_CHUNK)", (2**20, "current"): " (TRANSFER_CHUNK now)",
                 (2**20, "in_place"): ", built in place"}.get((size, how), "")
        yield row("multihost", f"transfer: gRPC stream alone, {size >> 20} MiB chunks{label}", "GB/s", "GB/s", gbs, tcp,
                  notes=f"64 MiB per Transfer call, {mine[0]['messages']} messages, median of {rounds * reps} calls "
                  f"({rounds} rounds taking turns with the other chunkings); sender making and serializing the "
                  f"messages {got['serialize_s'] * 1e3:.0f} ms; receiver: waiting for messages {ms('wait_s')}, "
                  f"joining them into one array {ms('assemble_s')}, the whole call {ms('call_s')}"
                  + ("" if how == "current" else "; in place: each TransferChunk's array filled in, not an "
                     "ArrayProto copied into it"))



# ------------------------------------------------------------------------------------- pipeline


def pipeline(cl: Cluster, quick: bool) -> Iterator[Row]:
    stages = 4
    mbs = 16 if quick else defs.MICRO_BATCHES
    windows = 2 if quick else 9
    window_s = 0.4 / 3 if quick else 1.0 / 3
    proc = Side(cl.hosts[0], "pipeline", {"stages": stages, "micro_batches": mbs, "windows": windows,
                                           "window_s": window_s}, **cl.env())
    try:
        got = proc.read(600)
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
    """Plain jax.distributed (a member on each of hosts A and B) and, where the controller can make
    the slice, pw.pmap on island pod, windows of blocking calls taking turns."""
    _, ha, hb = cl.hosts
    calls = 100 if quick else 300
    windows = 2 if quick else 7
    coordinator = f"{ha.ip}:{COORDINATOR_PORT}"
    members = [Side(h, "psum_member", {"coordinator": coordinator, "process_id": i, "processes": 2, "ip": h.ip,
                                       "devices": PSUM_DEVICES, "calls": calls})
               for i, h in enumerate((ha, hb))]
    sides = list(members)
    err = ""
    jx: list[float] = []
    pw: list[float] = []
    try:
        for m in members:
            m.read(600)
        # the Pathways side: one island `pod` of a worker on each host (needs multi-host islands)
        pws: Side | None = None
        try:
            for i in (1, 2):
                cl.worker(i, "pod", PSUM_DEVICES, f"pod{i}")
            pws = Side(cl.hosts[0], "psum_pw", {"island": "pod", "devices": 2 * PSUM_DEVICES, "calls": calls},
                       **cl.env())
            sides.append(pws)
            err = pws.read(600).get("error", "")
        except SideError as e:
            err = str(e).strip().splitlines()[-1] if str(e).strip() else "SideError"
        for _ in range(windows):
            for m in members:
                assert m.proc.stdin is not None
                m.proc.stdin.write("go\n")
                m.proc.stdin.flush()
            jx.append(float(members[0].read(300)["per_s"]))
            members[1].read(300)
            if pws is not None and not err:
                try:
                    pw.append(float(pws.ask("go", 300)["per_s"]))
                except SideError as e:
                    err = f"after {len(pw)} windows: " + (str(e).strip().splitlines()[-1] or "SideError")
    finally:
        _stop(*sides)
    j = defs.median(jx)
    jax_note = (f"JAX: two processes (hosts A and B) x {PSUM_DEVICES} CPU devices, jax.distributed (coordinator on "
                f"host A), gloo at each host's own address, jax.pmap(psum(x) * 0.25 + 1) over the 4 devices; "
                f"{windows} windows of {calls} calls, each blocking: " + "/".join(f"{v:,.0f}" for v in jx))
    variant = f"psum 2 hosts x {PSUM_DEVICES} devices, blocking"
    if err:
        yield row("multihost", variant, "calls/s", "1/s", None, j, ">= 0.9x jax.distributed", None,
                  f"pathways: not available: {err[:300]}; {jax_note}")
        return
    p = defs.median(pw)
    yield row("multihost", variant, "calls/s", "1/s", p, j, ">= 0.9x jax.distributed", p >= 0.9 * j,
              f"pathways: pw.pmap over a {2 * PSUM_DEVICES}-device slice of island pod (a worker --island pod "
              f"--devices {PSUM_DEVICES} on each of hosts A and B: one jax.distributed group), each call blocking, "
              "windows taking turns with JAX's: " + "/".join(f"{v:,.0f}" for v in pw) + f"; {jax_note}",
              paired=paired_ratio(pw, jx))


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
        except BaseException as e:
            made.close()  # exactly what was made so far
            tmp.cleanup()
            if not isinstance(e, netns.NamespaceUnavailable):
                raise
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
