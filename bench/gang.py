"""Admission and dispatch of one gang node over a slice spanning an island's hosts (issue 31).

Against a controller that runs with the dispatch probe on (`PATHWAYS_DISPATCH_PROBE`, see
server/controller/dispatch_probe.py) and simulated workers that report their tasks done at once
(`bench.simworkers --complete`): a slice over every device of an island (its hosts then form the
island's group: the controller starts a coordination service and sends each member a `JoinGroup`,
which the simulated hosts answer), one program of one node on it registered through a real
`Session` stream, and runs of it one at a time. Per run, the controller's time from the
`RunProgram`'s arrival at the dispatcher to the last of its `Enqueue`s (one per member host) taken
by that host's stream to be written by gRPC: the scheduler's admission of one segment per member,
one `Task` per member, the flush into the links, and every stream's wake-up.

Runs go one at a time (the next once the controller said the last is over, and `SETTLE_S` later),
so each measures an idle controller's latency for one gang node, not a queue's throughput; the
hosts keep heartbeating meanwhile. The program's function is opaque bytes: the controller never
reads them, and the simulated hosts execute nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pwctl.client import Client
from pwctl.errors import Rejected
from schemas.pathways.v1 import controller_pb2 as cpb

SLICE = "gang"
RUNS = 50
WARMUP = 10  # the first run also carries the segment definitions and the function to every member
SETTLE_S = 0.05  # between one run's end and the next run
FUNCTION_BYTES = b"bench.gang: opaque to the controller, never executed by simulated hosts"
FUNCTION = cpb.FunctionInfo(function_id=hashlib.sha256(FUNCTION_BYTES).hexdigest(), name="step",
                            exported=FUNCTION_BYTES)


def one_node_graph(slice_name: str = SLICE) -> cpb.ProgramGraph:
    """One node on `slice_name`, no inputs, its one output the program's."""
    return cpb.ProgramGraph(
        name="gang", num_inputs=0,
        nodes=[cpb.ProgramNode(function_id=FUNCTION.function_id, slice=slice_name, num_outputs=1, name="step")],
        outputs=[cpb.ValueRef(node_output=cpb.NodeOutput(node=0, output=0))])


class RegistrationRefused(RuntimeError):
    pass


class Session:
    """A client's program session over the real `Session` RPC: messages go up from a queue, events
    are read on a thread of their own."""

    def __init__(self, client: Client, name: str = "bench-gang") -> None:
        self._up: queue.Queue[cpb.ClientMessage | None] = queue.Queue()
        self._events: queue.Queue[cpb.SessionEvent | BaseException | None] = queue.Queue()
        self._up.put(cpb.ClientMessage(hello=cpb.Hello(client_name=name)))
        self._stream = client.session(iter(self._up.get, None))
        self._reader = threading.Thread(target=self._read, name="gang-session", daemon=True)
        self._reader.start()
        self.done = 0  # runs the controller said are over
        welcome = self._next(30.0)
        if welcome.WhichOneof("msg") != "welcome":
            raise RuntimeError(f"the session did not start: {welcome}")
        self._prefix = welcome.welcome.id_prefix << 40
        self._ids = 0

    def _read(self) -> None:
        try:
            for ev in self._stream:
                self._events.put(ev)
        except BaseException as e:  # handed to the waiting thread
            self._events.put(e)
        self._events.put(None)

    def _next(self, timeout: float) -> cpb.SessionEvent:
        ev = self._events.get(timeout=timeout)
        if ev is None:
            raise RuntimeError("the session ended")
        if isinstance(ev, BaseException):
            raise RuntimeError(f"the session failed: {ev}") from ev
        if ev.WhichOneof("msg") == "error":
            raise RuntimeError(f"the session ended: {ev.error}")
        if ev.WhichOneof("msg") == "finished" and not ev.finished.ok:
            raise RuntimeError(f"run {ev.finished.run_id} failed: {ev.finished.error}")
        return ev

    def new_id(self) -> int:
        self._ids += 1
        return self._prefix | self._ids

    def register(self, graph: cpb.ProgramGraph, functions: list[cpb.FunctionInfo], timeout: float = 60.0) -> str:
        self._up.put(cpb.ClientMessage(register=cpb.RegisterProgram(request_id=1, graph=graph, functions=functions)))
        deadline = time.monotonic() + timeout
        while True:
            ev = self._next(max(0.1, deadline - time.monotonic()))
            if ev.WhichOneof("msg") == "registered":
                if ev.registered.error or ev.registered.missing_functions:
                    raise RegistrationRefused(ev.registered.error or f"missing {ev.registered.missing_functions}")
                return ev.registered.program_id

    def run(self, program_id: str, outputs: int = 1) -> int:
        run_id = self.new_id()
        self._up.put(cpb.ClientMessage(run=cpb.RunProgram(run_id=run_id, program_id=program_id,
                                                          output_ids=[self.new_id() for _ in range(outputs)])))
        return run_id

    def wait_done(self, count: int, timeout: float = 60.0) -> None:
        """Until the controller says `count` of this session's runs are over."""
        deadline = time.monotonic() + timeout
        while self.done < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"only {self.done} of {count} runs over after {timeout:g} s")
            try:
                ev = self._next(left)
            except queue.Empty:
                continue
            if ev.WhichOneof("msg") == "runs_done":
                self.done = ev.runs_done.count

    def close(self) -> None:
        self._up.put(None)
        self._stream.cancel()
        self._reader.join(timeout=10)


@dataclass
class GangResult:
    island: str
    hosts: int
    devices: int
    create_s: float  # CreateSlice, its answer waiting for the island's group to form
    latencies_s: list[float]  # per measured run: arrival to the last Enqueue handed to gRPC
    queued_s: list[float]  # per measured run: arrival to every Enqueue queued on its link (the flush)
    cpu_s: list[float]  # per measured run: the event loop thread's CPU time from arrival to the last hand-off
    queued_cpu_s: list[float]  # per measured run: its CPU time from arrival to the flush's end
    tasks: int  # tasks per run (one per member host)
    # per measured run: arrival to the last member host receiving its task (the simulator's clock,
    # the same monotonic clock); empty when no simulator was asked
    received_s: list[float] = field(default_factory=list)

    def quantile(self, q: float) -> float:
        s = sorted(self.latencies_s)
        return s[min(len(s) - 1, int(q * len(s)))]

    @property
    def median(self) -> float:
        return statistics.median(self.latencies_s)


def probe_lines(path: Path) -> dict[int, dict[str, object]]:
    out: dict[int, dict[str, object]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out[int(rec["run"])] = rec
    return out


def gang_dispatch(address: str, island: str, hosts: int, devices: int, probe: Path, runs: int = RUNS,
                  warmup: int = WARMUP, token: str | None = None,
                  received: Callable[[list[int]], list[float | None]] | None = None) -> GangResult:
    """Creates a slice of `devices` devices on `island` (`hosts` hosts), runs a one-node program on
    it `warmup + runs` times through a session, and reads the probe's latencies of the last `runs`;
    with `received` (the simulator's `SimWorkers.received`), also when each run's last task
    reached its host."""
    with Client(server=address, token=token, timeout=60.0) as c:  # token None: found as pwctl finds it
        t0 = time.monotonic()
        c.create_slice(cpb.SliceSpec(name=SLICE, devices=devices, island=island))
        create_s = time.monotonic() - t0
        session = Session(c)
        measured: list[int] = []
        try:
            # CreateSlice waits for the group up to a limit (server/controller/servicer.py): on a
            # loaded machine it may still be forming, which registration then says
            deadline = time.monotonic() + 60
            while True:
                try:
                    program = session.register(one_node_graph(), [FUNCTION])
                    break
                except RegistrationRefused as e:
                    if "forming" not in str(e) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            for i in range(warmup + runs):
                run_id = session.run(program)
                if i >= warmup:
                    measured.append(run_id)
                session.wait_done(i + 1)
                time.sleep(SETTLE_S)
        finally:
            session.close()
        # the session's end releases its program; the slice is free once the controller saw it
        deadline = time.monotonic() + 30
        while True:
            try:
                c.delete_slice(SLICE)
                break
            except Rejected:  # in use until the controller saw the session end
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    recs = probe_lines(probe)
    missing = [r for r in measured if r not in recs or recs[r]["handed"] is None or not recs[r]["ok"]]
    if missing:
        raise RuntimeError(f"the dispatch probe has no complete record of {len(missing)} of {len(measured)} runs")
    tasks = {int(recs[r]["tasks"]) for r in measured}  # type: ignore[call-overload]
    if tasks != {hosts}:
        raise RuntimeError(f"runs handed {sorted(tasks)} tasks, not one per member host ({hosts})")
    lat = [float(recs[r]["handed"]) - float(recs[r]["arrived"]) for r in measured]  # type: ignore[arg-type]
    queued = [float(recs[r]["queued"]) - float(recs[r]["arrived"]) for r in measured]  # type: ignore[arg-type]
    cpu = [float(recs[r]["cpu"]) for r in measured]  # type: ignore[arg-type]
    queued_cpu = [float(recs[r]["queued_cpu"]) for r in measured]  # type: ignore[arg-type]
    got: list[float] = []
    if received is not None:
        times = received(measured)
        got = [t - float(recs[r]["arrived"]) for r, t in zip(measured, times, strict=True)  # type: ignore[arg-type]
               if t is not None]
    return GangResult(island, hosts, devices, create_s, lat, queued, cpu, queued_cpu, hosts, got)


def stop_island_services(home: Path) -> int:
    """Stops the island coordination services a controller with data directory `home` left
    running (a stopped controller leaves them to their members: server/controller/groups.py).
    Only pids its record names whose command line is such a service."""
    try:
        pids = json.loads((home / "island-services.json").read_text()).get("pids", [])
    except (OSError, ValueError):
        return 0
    stopped = 0
    for pid in pids:
        try:
            if b"server.controller.coordsvc" not in Path(f"/proc/{int(pid)}/cmdline").read_bytes():
                continue
        except OSError:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(pid), signal.SIGTERM)
            stopped += 1
    return stopped
