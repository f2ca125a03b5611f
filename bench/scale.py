"""The control plane at thousands of hosts (issue 31): a real controller against simulated workers.

For each N it starts its own controller (`python -m server.controller`, a temporary SQLite
database, the default heartbeat interval 1 s and timeout 5 s) and a `bench.simworkers` process
holding N real `WorkerConnect` streams of 4 devices each, in islands of 4 and of 64 hosts, and
from 1,024 hosts on one island of 512 (`island_sizes`). Then, in order:

1. all ready: from the simulator's start until the controller has answered every registration;
2. heartbeating: controller CPU (user+system, psutil) over `HEARTBEAT_WINDOW_S` and its RSS;
3. event-loop stalls: a thread here calls the controller's gRPC health check (answered on its event
   loop, O(1), no token, no database) every `PROBE_EVERY_S` the whole time; a call's latency is
   an upper bound on how long the loop could not answer. The longest and the p99 while heartbeating
   are the figures; the longest while the hosts register is in the notes;
4. listings: ListIslands, ListHosts, ListDevices and the status snapshot (first message of Watch),
   median of `LISTING_REPEATS` calls; slice create (4 devices, then deleted);
5. lost hosts: every 4th host goes silent (stops heartbeating, keeps its stream) and the time until
   the controller shows the last of them lost; then they resume and register again; the same with
   every 4th host closing its stream;
6. restart: the controller is stopped (SIGTERM) and started again on the same database and port;
   the time from its answering until every host registered again, and how many hosts it marked
   lost (its log's "lost:" lines);
7. a gang node (bench/gang.py), last so that its island group changes none of the figures above:
   a slice over every device of the largest island (at 2,048 hosts the 512-host island's 2,048
   devices), whose hosts then form the island's group, and a one-node program on it run one run
   at a time through a real session; per run the controller's time from the `RunProgram`'s arrival
   to the last of its per-host `Enqueue`s handed to gRPC (its dispatch probe,
   server/controller/dispatch_probe.py, which this benchmark's controller runs with), the part of
   it that is the controller's own work (admitted, and every Enqueue queued on its link), and the
   event loop's CPU time over it. The simulated hosts report every task done at once
   (`--complete`). The controller runs with its default relays (server/controller/relays.py:
   islands of 32 hosts or more, groups of 64: 8 relays for the 512-host island), so the hand-off
   is that of the relay batches; a row also gives when the last member host had its task (the
   simulator's clock, the relay hop included: in this one process on the machine's cores).
"""

from __future__ import annotations

import contextlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.cluster import REPO, free_port
from bench.gang import WARMUP as GANG_WARMUP
from bench.gang import gang_dispatch, stop_island_services
from bench.simworkers import SimWorkers
from pwctl.client import Client
from pwctl.paths import read_token
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb
from server.controller.cluster import RECONNECT_PER_HOST_S
from server.controller.relays import DEFAULT_GROUP_SIZE as RELAY_GROUP
from server.controller.relays import DEFAULT_MIN_HOSTS as RELAY_MIN_HOSTS

Row = dict[str, Any]

SIZES = (64, 512, 2048)
QUICK_SIZES = (64, 512)
DEVICES_PER_HOST = 4
HEARTBEAT_WINDOW_S = 8.0
PROBE_EVERY_S = 0.05  # also the resolution of the stall figures
LISTING_REPEATS = 5
READY_TIMEOUT_S = 90.0
LOST_TIMEOUT_S = 20.0
# controller defaults (server/controller/__main__.py), stated so the rows can name them
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0
LOST_LINE = re.compile(r"host (\S+) lost: (.*)$")  # server/controller/cluster.py's warning


def island_sizes(hosts: int) -> list[int]:
    """Island sizes for `bench.simworkers.island_layout`: one island of 512 hosts from 1,024 hosts
    on, then islands of 64 hosts for about half of the rest, then islands of 4 (the last size
    repeats). 64 hosts: 16 islands of 4; 512: 4 of 64 and 64 of 4; 2,048: 1 of 512, 12 of 64, 192
    of 4."""
    big = [512] if hosts >= 1024 else []
    rest = hosts - 512 * len(big)
    return big + [64] * ((rest // 2) // 64) + [4]


class Controller:
    """One controller process on a fixed port and database, restartable."""

    def __init__(self, home: Path, args: tuple[str, ...] = ()) -> None:
        self.home = home
        self.address = f"127.0.0.1:{free_port()}"
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.log = home / "controller-0.log"

    @property
    def token(self) -> str | None:
        """The cluster token the controller made in its data directory (every call needs it)."""
        return read_token(self.home / "token")

    def start(self, env: dict[str, str]) -> float:
        """Starts it; returns when it answers (monotonic)."""
        self.log = self.home / f"controller-{self.starts}.log"
        self.starts += 1
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "server.controller", "--listen", self.address, "--db",
                 f"sqlite:///{self.home / 'pw.db'}", "--log-level", "WARNING", *self.args],
                env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited with {self.proc.returncode}: {self.log.read_text()[-800:]}")
            # a fresh channel per try: a channel that failed to connect waits out gRPC's backoff
            # (1 s and more) before it tries again, which would be counted as the start-up
            with grpc.insecure_channel(self.address) as ch, contextlib.suppress(grpc.RpcError):
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic()
            if time.monotonic() > deadline:
                raise RuntimeError("controller did not answer within 60 s")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def losses(self) -> list[tuple[str, str]]:
        """(host, reason) for each time this controller marked a host lost (its log's warnings;
        a host can be marked lost more than once)."""
        return [(m[1], m[2]) for ln in self.log.read_text(errors="replace").splitlines()
                if (m := LOST_LINE.search(ln))]


class Probe:
    """Calls the controller's health check every `PROBE_EVERY_S` from a thread; records (when, latency)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.samples: list[tuple[float, float]] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-probe", daemon=True)

    def start(self) -> Probe:
        self._thread.start()
        return self

    def _run(self) -> None:
        # Calls go out on schedule whether or not the last one returned, so a stall of 2 s shows
        # as 40 late calls, not one: the p99 is then over time, not over the few calls a stalled
        # loop lets through.
        with grpc.insecure_channel(self.address) as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            while not self._stop.wait(PROBE_EVERY_S):
                t0 = time.monotonic()
                fut = check.future(health_pb2.HealthCheckRequest(), timeout=30.0)
                fut.add_done_callback(lambda f, t0=t0: self._done(f, t0))
            time.sleep(0.1)

    def _done(self, fut: Any, t0: float) -> None:
        if fut.exception() is None:
            self.samples.append((t0, time.monotonic() - t0))
        else:
            self.failures += 1

    def between(self, t0: float, t1: float) -> list[float]:
        return [lat for t, lat in self.samples if t0 <= t <= t1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def p99(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def _timed(fn: Callable[[], object], repeats: int = LISTING_REPEATS) -> tuple[float, float]:
    """Median and longest seconds of `repeats` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), max(times)


def _wait_lost(client: Client, names: set[str], timeout: float) -> tuple[float | None, int]:
    """Polls ListHosts until every host in `names` is lost; (monotonic time seen, how many lost)."""
    deadline = time.monotonic() + timeout
    lost = 0
    while time.monotonic() < deadline:
        lost = sum(1 for h in client.hosts() if h.name in names and h.state == pb.HOST_STATE_LOST)
        if lost == len(names):
            return time.monotonic(), lost
        time.sleep(0.1)
    return None, lost


def _row(variant: str, metric: str, unit: str, value: float | None, target: str = "",
         meets: bool | None = None, notes: str = "") -> Row:
    return {"bench": "scale", "variant": variant, "metric": metric, "unit": unit, "pathways": value, "jax": None,
            "ratio": None, "paired": None, "target": target, "meets": meets, "notes": notes}


def _reasons(losses: list[tuple[str, str]]) -> str:
    """'N times (k "reason", ...)' or 'none'."""
    if not losses:
        return "none"
    counts: dict[str, int] = {}
    for _, reason in losses:
        counts[reason] = counts.get(reason, 0) + 1
    return f"{len(losses)} times (" + ", ".join(f'{n} "{r}"' for r, n in sorted(counts.items())) + ")"


def _at_most(value: float | None, bound: float) -> bool | None:
    return None if value is None else bool(value <= bound)


def measure(hosts: int, env: dict[str, str]) -> Iterator[Row]:
    """All the rows for one cluster of `hosts` simulated hosts (the module's docstring)."""
    v = f"{hosts} hosts"
    big = hosts >= 2048  # the issue's targets are stated at 2,048 hosts
    with tempfile.TemporaryDirectory(prefix="pw-scale-") as tmp:
        home = Path(tmp)
        probe_file = home / "dispatch-probe.jsonl"
        run_env = {**env, "PATHWAYS_HOME": str(home), "PATHWAYS_DISPATCH_PROBE": str(probe_file)}
        run_env.pop("PWCTL_TOKEN", None)
        ctl = Controller(home)
        ctl.start(run_env)
        probe = Probe(ctl.address).start()
        sizes = island_sizes(hosts)
        sim = SimWorkers(ctl.address, hosts, sizes, DEVICES_PER_HOST, env=run_env, log=home / "sim.log",
                         complete=True)
        try:
            reg = sim.wait_registered(timeout=READY_TIMEOUT_S)
            t0 = sim.status()["started_at"]  # its first connection attempts (its imports excluded)
            if not reg["ok"]:
                raise RuntimeError(f"only {reg['count']} of {hosts} hosts registered in {READY_TIMEOUT_S:g} s")
            ready_s = reg["last"] - t0
            stall_reg = max(probe.between(t0, reg["last"]), default=0.0)
            islands = len(set(sim.islands))
            yield _row(v, "all ready", "s", ready_s, "<= 5 s at 2,048", _at_most(ready_s, 5.0) if big else None,
                       f"{islands} islands (sizes {','.join(map(str, sorted(set(sizes), reverse=True)))}); longest "
                       f"health-check latency while registering {stall_reg * 1e3:.0f} ms")

            # heartbeating only
            time.sleep(2.0)
            proc = psutil.Process(ctl.proc.pid if ctl.proc else 0)
            sim_cpu0 = sim.status()["cpu_s"]
            c0, w0 = proc.cpu_times(), time.monotonic()
            time.sleep(HEARTBEAT_WINDOW_S)
            c1, w1 = proc.cpu_times(), time.monotonic()
            sim_cpu = (sim.status()["cpu_s"] - sim_cpu0) / (w1 - w0)
            cpu = (c1.user + c1.system - c0.user - c0.system) / (w1 - w0)
            rss = proc.memory_info().rss / 2**20
            beats = "/".join(f"{i:g}" for i in sim.status(detail=True)["intervals"])  # as the controller set them
            yield _row(v, "controller CPU, heartbeating", "% of a core", 100 * cpu, "<= 10% at 2,048",
                       _at_most(cpu, 0.10) if big else None,
                       f"{HEARTBEAT_WINDOW_S:g} s, beats every {beats} s; the simulator used "
                       f"{100 * sim_cpu:.0f}% of a core")
            yield _row(v, "controller RSS", "MiB", rss)
            lat = probe.between(w0, w1)
            yield _row(v, "event-loop stall p99", "ms", 1e3 * p99(lat) if lat else None, "<= 50 ms at 2,048",
                       _at_most(p99(lat), 0.050) if big and lat else None,
                       f"health-check latency every {PROBE_EVERY_S * 1e3:.0f} ms while heartbeating, "
                       f"{len(lat)} calls")
            yield _row(v, "event-loop stall max", "ms", 1e3 * max(lat) if lat else None)
            extra = sim.status()["registrations"] - hosts
            flaps = ctl.losses()
            yield _row(v, "lost while nothing failed", "hosts", float(len({h for h, _ in flaps})), "0", not flaps,
                       f"marked lost from the start to the end of the heartbeat window (controller log): "
                       f"{_reasons(flaps)}; {extra} registrations beyond the first of each host")

            with Client(server=ctl.address, token=ctl.token, timeout=30.0) as c:
                for name, fn in (("ListIslands", c.islands), ("ListHosts", c.hosts), ("ListDevices", c.devices),
                                 ("status", c.status)):
                    med, worst = _timed(fn)
                    yield _row(v, name, "ms", 1e3 * med, "<= 10 ms at 2,048", _at_most(med, 0.010) if big else None,
                               f"median of {LISTING_REPEATS}, longest {worst * 1e3:.1f} ms")
                n_slice = 0

                def create_delete() -> None:
                    nonlocal n_slice
                    n_slice += 1
                    name = f"scale-{n_slice}"
                    c.create_slice(cpb.SliceSpec(name=name, devices=DEVICES_PER_HOST))
                    c.delete_slice(name)

                med, worst = _timed(create_delete)
                yield _row(v, "slice create+delete", "ms", 1e3 * med, "", None,
                           f"{DEVICES_PER_HOST} devices, median of {LISTING_REPEATS}, longest {worst * 1e3:.1f} ms")

                quarter = sim.names[::4]
                for how, target_s, act in (("silent", 15.0, sim.silence), ("closed stream", 1.0, sim.disconnect)):
                    t_act = act(quarter)
                    seen, lost = _wait_lost(c, set(quarter), LOST_TIMEOUT_S)
                    took = None if seen is None else seen - t_act
                    yield _row(v, f"25% lost, {how}", "s", took, f"<= {target_s:g} s at 2,048",
                               _at_most(took, target_s) if big else (None if took is not None else False),
                               f"{len(quarter)} hosts; last one shown lost (ListHosts every 0.1 s)"
                               + ("" if seen is not None else f"; only {lost} lost after {LOST_TIMEOUT_S:g} s")
                               + (f"; heartbeat timeout {HEARTBEAT_TIMEOUT_S:g} s" if how == "silent" else ""))
                    t_resume = sim.resume(quarter)
                    back = sim.wait_registered(since=0.0, timeout=READY_TIMEOUT_S)
                    if not back["ok"]:
                        st = sim.status()
                        raise RuntimeError(f"after {how}: only {back['count']} of {hosts} hosts back in "
                                           f"{READY_TIMEOUT_S:g} s ({st['waiting']} streams waiting for the "
                                           f"controller's answer, {st['off']} switched off, errors {st['rejected']})")
                    yield _row(v, f"25% back after {how}", "s", back["last"] - t_resume, "", None,
                               f"from their resuming until the last of the {len(quarter)} registered again")

            # restart
            ctl.stop()
            t_stopped = time.monotonic()
            sim_cpu0 = sim.status()["cpu_s"]
            t_answer = ctl.start(run_env)
            back = sim.wait_registered(since=t_stopped, timeout=READY_TIMEOUT_S)
            # the controller marks what did not come back within its reconnect window (its timeout
            # and RECONNECT_PER_HOST_S a host it knew): let that have passed
            window = HEARTBEAT_TIMEOUT_S + RECONNECT_PER_HOST_S * hosts
            time.sleep(max(0.0, t_answer + window + 1.0 - time.monotonic()))
            sim_cpu = sim.status()["cpu_s"] - sim_cpu0
            losses = ctl.losses()
            lost_after = len({h for h, _ in losses})
            took = back["last"] - back["first"] if back["ok"] else None
            notes = f"{back['count']} of {hosts} back"
            if back["ok"]:
                notes = (f"first to last registration with the new controller; {notes}; the first "
                         f"{back['first'] - t_stopped:.1f} s and its health check SERVING {t_answer - t_stopped:.1f} s "
                         f"after the old one exited (its start-up); the simulator's reconnecting took "
                         f"{sim_cpu:.1f} s of CPU")
            yield _row(v, "restart: every host back", "s", took, "every host", bool(back["ok"]), notes)
            yield _row(v, "restart: hosts marked lost", "hosts", float(lost_after), "0",
                       lost_after == 0, f"distinct hosts in the restarted controller's log: {_reasons(losses)}")
            yield from _gang_rows(v, ctl.address, sim, sizes[0], probe_file, big, ctl.token)
        finally:
            sim.close()
            probe.stop()
            ctl.stop()
            stop_island_services(home)  # a stopped controller leaves its island services to their members


def _gang_rows(v: str, address: str, sim: SimWorkers, size: int, probe_file: Path, big: bool,
               token: str | None = None) -> Iterator[Row]:
    """Admission and dispatch of one gang node over every device of the first (largest) island."""
    island = sim.islands[0]
    before = sim.status()
    r = gang_dispatch(address, island, size, size * DEVICES_PER_HOST, probe_file, token=token,
                      received=sim.received)
    after = sim.status()
    relayed = after["relayed_in"] - before["relayed_in"]
    ms = [x * 1e3 for x in r.latencies_s]
    med = statistics.median(ms)
    via = (f"through relays (groups of up to {RELAY_GROUP} hosts, islands of {RELAY_MIN_HOSTS} hosts or more): "
           f"{relayed} messages reached their hosts through a relay" if relayed else "direct (no relays)")
    yield _row(v, "gang node admit+dispatch", "ms", med, "<= 5 ms at 2,048 (512-host island)",
               _at_most(med, 5.0) if big else None,
               f"one node over island {island}: {size} hosts, {r.devices} devices, one Enqueue per host, {via}; "
               f"the RunProgram's arrival to the last Enqueue (or relay batch carrying them) handed to gRPC (the "
               f"controller's dispatch probe), median of {len(ms)} runs one at a time after {GANG_WARMUP}; slice "
               f"create with the group forming {r.create_s:.1f} s")
    if r.received_s:
        got = [x * 1e3 for x in r.received_s]
        yield _row(v, "gang node: last host has its Enqueue", "ms", statistics.median(got), "", None,
                   f"median of {len(got)}; arrival to the last member host receiving its task (the simulator's "
                   "clock), relay hops included; every simulated host and relay shares this machine's cores")
    yield _row(v, "gang node admit+dispatch p99", "ms", r.quantile(0.99) * 1e3, "", None,
               f"max {max(ms):.1f} ms")
    yield _row(v, "gang node admitted and queued", "ms", statistics.median(r.queued_s) * 1e3, "", None,
               "median; the controller's own work: arrival to the end of the flush that put every host's "
               "Enqueue on its link (the rest to the hand-off is the streams taking them to gRPC); event-loop "
               f"CPU over it {statistics.median(r.queued_cpu_s) * 1e3:.1f} ms")
    yield _row(v, "gang node event-loop CPU", "ms", statistics.median(r.cpu_s) * 1e3, "", None,
               "median; the event loop thread's CPU time from arrival to the last hand-off (what the interval "
               "would take with a core to itself; heartbeats handled meanwhile included)")


def bench_scale(quick: bool, env: dict[str, str]) -> Iterator[Row]:
    """The rows for each size (64 and 512 hosts with `quick`, also 2,048 without); each size's
    first row notes the machine's load average (1 min) as it began: other work shares the cores."""
    for hosts in QUICK_SIZES if quick else SIZES:
        t0 = time.monotonic()
        load = psutil.getloadavg()[0]
        for i, r in enumerate(measure(hosts, env)):
            if i == 0:
                r["notes"] = (r["notes"] + "; " if r["notes"] else "") + f"load avg {load:.1f} at the start"
            yield r
        print(f"[bench] scale {hosts} hosts: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
