"""Simulated workers: one asyncio process holding N real `WorkerConnect` streams to a controller.

Each simulated host speaks what `server/worker/process.py` sends: a `RegisterWorker` first (its
name, island, an address, `device_count` devices, a machine id of its own), then a `Heartbeat`
every `heartbeat_interval_s` that the controller's `Registered` gives, and later `HeartbeatSettings`
change (as the real worker does), with the cluster token as `authorization:
Bearer` metadata when there is one. After a stream ends it connects again on a fresh channel,
waiting as `server/worker/reconnect.py` says (every 50 ms for 5 s, then doubling), so a controller
restart looks to the controller as it would with real workers.

Relays (server/worker/relay.py, server/controller/relays.py): as the real worker, a simulated
host handles the controller's messages in their `seq` order whichever way each came (the same
`Inbox`), acknowledges them on every message it sends up (`delivered`), and as a relay forwards a
`RelayBatch`'s parts to their hosts over real `Relayed` streams (the same `Forwarder`, one TCP
connection per member), reporting a member it cannot reach (`RelayFailed`). The hosts of islands
of at least `listen_min` hosts (`--listen-min`, default 32: the controller's default relay
threshold) listen for `Relayed` streams on a loopback port each (127.0.0.1:<port>, one gRPC server
for all of them in this process, which does not check the peer credential); the others register
an address nothing listens at (127.0.0.2:<10000 + i>), so no client may upload to any of them.
Per run it records when the host that got the run's tasks last received them (`received`).

It runs nothing: an `Enqueue`'s tasks are reported failed at once (a `NodeEvent` with ok false),
so a run sent here ends instead of hanging; with `complete` (`--complete`) they are reported done
(ok, zero duration) at once instead, so a program's runs finish as if each computation took no
time (what the benchmark's gang dispatch needs: runs that end without a failure and its drops).
Their outputs exist nowhere: no client may fetch them. Releases and drops need no answer.

A `JoinGroup` (the island spans hosts and has a slice over several of them:
server/controller/groups.py) is answered with `GroupJoined` for its generation at once, as the real
worker answers once it has joined. A simulated host joins no `jax.distributed` group: it owns no
devices and runs nothing, so there is nothing to join with (the controller still starts its real
coordination service per generation, which nobody connects to).

Per host a switch: `silence` (the process froze: no heartbeats, the stream stays open, and no
reconnection when the controller closes it), `disconnect` (the stream closes, the host stays away)
and `resume` (back to normal: it reconnects if it must).

Run it as `python -m bench.simworkers --server ADDR --hosts N [--islands 4,4,64 ...]`; it reads
one JSON command per line on stdin and answers each with one JSON line on stdout (`SimWorkers` below
is the driver the benchmark and the tests use). Times are `time.monotonic()`, which every process
on the machine shares.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from pwctl import settings
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc
from schemas.pathways.v1 import worker_pb2 as wpb
from server.relaysig import link_key
from server.worker.reconnect import Reconnect
from server.worker.relay import Forwarder, Inbox, relayed_message

NORMAL, SILENT, CLOSED = "normal", "silent", "closed"
DEFAULT_INTERVAL_S = 1.0  # until the controller's `Registered` says otherwise
# One TCP connection per simulated host, as separate worker processes have: without a local
# subchannel pool, gRPC would share one connection among all channels to the same address.
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


def host_name(i: int) -> str:
    return f"sim-{i:05d}"


def island_layout(hosts: int, sizes: Sequence[int]) -> list[str]:
    """Island names for `hosts` hosts: consecutive islands of `sizes[0]`, `sizes[1]`, ... hosts
    (the last size repeats until every host has one). Island k is named `i<k>-<size>`."""
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError("island sizes must be positive")
    out: list[str] = []
    k = 0
    while len(out) < hosts:
        size = sizes[min(k, len(sizes) - 1)]
        out.extend([f"i{k:04d}-{size}"] * min(size, hosts - len(out)))
        k += 1
    return out


@dataclass
class SimHost:
    index: int
    name: str
    island: str
    devices: int
    mode: str = NORMAL
    interval: float = DEFAULT_INTERVAL_S
    host_id: int = 0
    device_ids: list[int] = field(default_factory=list)
    registered_at: float = 0.0  # when the current stream's `Registered` arrived (0: not registered)
    registrations: int = 0
    credential: str = ""  # as the controller issued it (a real worker keeps it the same way)
    heartbeats: int = 0
    rejected: str = ""  # the last error the controller answered with (other than UNAVAILABLE)
    call: Any = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    events: list[cpb.NodeEvent] = field(default_factory=list)
    joined: list[int] = field(default_factory=list)  # generations to answer GroupJoined for
    joins: int = 0
    address: str = ""
    inbox: Inbox = field(default_factory=Inbox)  # the controller's messages in their order (relay.py)
    forwarder: Forwarder | None = None  # as a relay (made on its first batch)
    unreachable: list[str] = field(default_factory=list)  # hosts to report in RelayFailed
    relayed_in: int = 0
    session_key: bytes = b""  # the peer credential's key (the controller's Registered)


class Simulator:
    """The hosts and their streams, on one event loop."""

    def __init__(self, server: str, islands: Sequence[str], devices: int = 4, token: str | None = None,
                 reconnect_max_s: float = 5.0, complete: bool = False, listen_min: int = 32) -> None:
        self.server = server
        self.complete = complete
        self.token = token
        self.listen_min = listen_min
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.reconnect_max_s = reconnect_max_s
        self.hosts = [SimHost(i, host_name(i), island, devices) for i, island in enumerate(islands)]
        self.by_name = {h.name: h for h in self.hosts}
        self._tasks: list[asyncio.Task[None]] = []
        self.started_at = 0.0
        self._server: aio.Server | None = None
        self.received: dict[int, float] = {}  # run id -> when the last of its tasks arrived (monotonic)

    async def start(self) -> None:
        sizes: dict[str, int] = {}
        for h in self.hosts:
            sizes[h.island] = sizes.get(h.island, 0) + 1
        listening = [h for h in self.hosts if self.listen_min > 0 and sizes[h.island] >= self.listen_min]
        if listening:
            self._server = aio.server()
            self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pathways.v1.Worker", {
                "Relayed": grpc.stream_unary_rpc_method_handler(
                    self._relayed_stream, request_deserializer=wpb.RelayedMessage.FromString,
                    response_serializer=wpb.RelayedResponse.SerializeToString)}),))
            for h in listening:
                port = self._server.add_insecure_port("127.0.0.1:0")
                h.address = f"127.0.0.1:{port}"
            await self._server.start()
        for h in self.hosts:
            h.address = h.address or f"127.0.0.2:{10000 + h.index}"
        self.started_at = time.monotonic()
        self._tasks = [asyncio.create_task(self._run(h)) for h in self.hosts]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for h in self.hosts:
            if h.forwarder is not None:
                h.forwarder.close()
        if self._server is not None:
            await self._server.stop(None)

    # ---- relaying (server/worker/relay.py) ----
    async def _relayed_stream(self, requests: AsyncIterator[wpb.RelayedMessage],
                              context: aio.ServicerContext) -> wpb.RelayedResponse:
        n = 0
        async for part in requests:
            h = self.by_name.get(part.host)
            if h is None or h.mode == SILENT:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no host {part.host} here")
                raise AssertionError("abort raises")
            self._relayed(h, part)
            n += 1
        return wpb.RelayedResponse(count=n)

    def _relayed(self, h: SimHost, part: wpb.RelayedMessage) -> None:
        msg = relayed_message(part, h.inbox)
        if msg is None:
            return
        h.relayed_in += 1
        for m in h.inbox.accept(msg, time.monotonic()):
            self._handle(h, m)

    def _relay_failed(self, h: SimHost, hosts: Sequence[str]) -> None:
        h.unreachable.extend(hosts)
        h.changed.set()

    def _receive(self, h: SimHost, msg: cpb.ControllerToWorker) -> None:
        if msg.WhichOneof("msg") == "relay":
            if h.forwarder is None:
                h.forwarder = Forwarder(h.name, lambda part: self._relayed(h, part),
                                        lambda hosts: self._relay_failed(h, hosts), self.token)
                h.forwarder.key = h.session_key or None
            h.forwarder.forward(msg.relay)
            return
        for m in h.inbox.accept(msg, time.monotonic()):
            self._handle(h, m)

    # ---- one host ----
    async def _run(self, h: SimHost) -> None:
        loop = asyncio.get_running_loop()
        retry = Reconnect(self.reconnect_max_s)
        while True:
            while h.mode != NORMAL:  # frozen or away: no new connection
                h.changed.clear()
                await h.changed.wait()
            rejected = False
            async with aio.insecure_channel(self.server, options=CHANNEL_OPTIONS) as channel:
                stub = cgrpc.ControllerStub(channel)
                h.inbox.reset()  # a new registration: its messages are numbered from 1
                h.call = stub.WorkerConnect(self._upstream(h), metadata=self.metadata)
                try:
                    async for msg in h.call:
                        retry.connected()
                        self._receive(h, msg)
                except aio.AioRpcError as e:
                    rejected = e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                    if rejected:
                        h.rejected = f"{e.code().name}: {e.details()}"
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise  # the simulator stops
                    # else `disconnect` cancelled this stream's call: the host goes away
                finally:
                    h.call = None
                    h.registered_at = 0.0
            await asyncio.sleep(retry.delay(loop.time(), rejected))

    async def _upstream(self, h: SimHost) -> AsyncIterator[cpb.WorkerToController]:
        yield cpb.WorkerToController(register=cpb.RegisterWorker(
            name=h.name, island=h.island, address=h.address, pid=os.getpid(),
            device_kind="cpu", device_count=h.devices, machine_id=f"sim:{h.name}", credential=h.credential))
        # real workers start at different moments: spread the first beats over one interval
        next_beat = time.monotonic() + random.uniform(0, h.interval)
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(h.changed.wait(), max(0.0, next_beat - time.monotonic()))
            h.changed.clear()
            while h.mode == SILENT:  # frozen: nothing goes up until resumed
                await h.changed.wait()
                h.changed.clear()
            # every message acknowledges what the host handled (relayed ones are kept until then)
            if h.joined:
                generations, h.joined = h.joined, []
                for generation in generations:
                    yield cpb.WorkerToController(joined=cpb.GroupJoined(generation=generation),
                                                 delivered=h.inbox.delivered)
            if h.inbox.stalled(time.monotonic()):  # a relayed message never came (server/worker/relay.py)
                h.unreachable.append(h.name)
            if h.unreachable:
                hosts, h.unreachable = h.unreachable, []
                yield cpb.WorkerToController(relay_failed=cpb.RelayFailed(hosts=hosts), delivered=h.inbox.delivered)
            if h.events:
                events, h.events = h.events, []
                yield cpb.WorkerToController(node_events=cpb.NodeEvents(events=events), delivered=h.inbox.delivered)
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + h.interval
                h.heartbeats += 1
                yield cpb.WorkerToController(heartbeat=cpb.Heartbeat(buffers=0, buffer_bytes=0),
                                             delivered=h.inbox.delivered)

    def _handle(self, h: SimHost, msg: cpb.ControllerToWorker) -> None:
        kind = msg.WhichOneof("msg")
        if kind == "registered":
            h.host_id = msg.registered.host_id
            h.device_ids = list(msg.registered.device_ids)
            if msg.registered.credential:
                h.credential = msg.registered.credential
            if msg.registered.heartbeat_interval_s > 0:
                h.interval = msg.registered.heartbeat_interval_s
            h.registrations += 1
            h.registered_at = time.monotonic()
            h.inbox.link = msg.registered.link  # relayed messages of this registration carry it
            # and are signed with a key of its credential (server/relaysig.py), checked as a worker does
            h.inbox.key = link_key(h.credential, msg.registered.link) if msg.registered.link else b""
            if h.forwarder is not None and msg.registered.session_key:
                h.forwarder.key = msg.registered.session_key
            h.session_key = msg.registered.session_key
        elif kind == "heartbeat":
            if msg.heartbeat.heartbeat_interval_s > 0:
                h.interval = msg.heartbeat.heartbeat_interval_s
        elif kind == "enqueue":
            mono = time.monotonic()
            for t in msg.enqueue.tasks:
                self.received[t.run_id] = mono
            if len(self.received) > 4096:
                for run in list(self.received)[:2048]:
                    del self.received[run]
            now = time.time_ns()
            ok = self.complete
            error = "" if ok else f"simulated host {h.name} runs nothing"
            h.events.extend(
                cpb.NodeEvent(run_id=t.run_id, segment=t.segment, seq=t.seq, start_ns=now, end_ns=now, ok=ok,
                              error=error)
                for t in msg.enqueue.tasks)
            h.changed.set()
        elif kind == "join":
            h.joins += 1
            h.joined.append(msg.join.generation)
            h.changed.set()
        # release and drop: nothing is held here, nothing runs

    # ---- switches ----
    def set_mode(self, names: Sequence[str], mode: str) -> None:
        for name in names:
            h = self.by_name[name]
            h.mode = mode
            if mode == CLOSED and h.call is not None:
                h.call.cancel()
            h.changed.set()

    # ---- views ----
    def registered(self, since: float = 0.0) -> list[float]:
        """When each host registered on its current stream, for those registered at or after `since`."""
        return sorted(h.registered_at for h in self.hosts if h.registered_at and h.registered_at >= since)

    async def wait_registered(self, count: int, since: float, timeout: float) -> list[float]:
        # polled: the times are exact anyway (recorded as each `Registered` arrives), and a
        # check per registration would cost O(hosts) each, O(hosts^2) in all
        deadline = time.monotonic() + timeout
        while len(times := self.registered(since)) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return times

    def status(self, detail: bool = False) -> dict[str, Any]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        out: dict[str, Any] = {"hosts": len(self.hosts), "registered": len(self.registered()),
                "registrations": sum(h.registrations for h in self.hosts),
                "heartbeats": sum(h.heartbeats for h in self.hosts),
                "joins": sum(h.joins for h in self.hosts),
                "rejected": sorted({h.rejected for h in self.hosts if h.rejected}),
                # streams open that the controller has not answered yet, and hosts switched off
                "waiting": sum(1 for h in self.hosts if h.call is not None and not h.registered_at),
                "off": sum(1 for h in self.hosts if h.mode != NORMAL),
                "cpu_s": ru.ru_utime + ru.ru_stime, "started_at": self.started_at,
                "relayed_in": sum(h.relayed_in for h in self.hosts),
                "relayed_out": sum(h.forwarder.forwarded for h in self.hosts if h.forwarder is not None),
                "duplicates": sum(h.inbox.duplicates for h in self.hosts)}
        if detail:
            out["device_ids"] = {h.name: h.device_ids for h in self.hosts if h.registered_at}
            out["intervals"] = sorted({h.interval for h in self.hosts})
        return out


async def _serve_commands(sim: Simulator) -> None:
    """Answers one JSON line per command line on stdin until `stop` or end of input."""
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            return
        cmd = json.loads(line)
        op = cmd.get("cmd")
        reply: dict[str, Any] = {"ok": True}
        if op == "status":
            reply.update(sim.status(bool(cmd.get("detail"))))
        elif op == "wait":
            times = await sim.wait_registered(int(cmd["count"]), float(cmd.get("since", 0.0)),
                                              float(cmd.get("timeout", 60.0)))
            reply.update(ok=len(times) >= int(cmd["count"]), count=len(times), last=times[-1] if times else None,
                         first=times[0] if times else None)
        elif op == "received":  # when the last task of each run arrived (monotonic; None: not seen)
            reply["times"] = [sim.received.get(int(r)) for r in cmd["runs"]]
        elif op in ("silence", "disconnect", "resume"):
            sim.set_mode(cmd["hosts"], {"silence": SILENT, "disconnect": CLOSED, "resume": NORMAL}[op])
            reply["at"] = time.monotonic()
        elif op == "stop":
            print(json.dumps(reply), flush=True)
            return
        else:
            reply = {"ok": False, "error": f"unknown command {op!r}"}
        print(json.dumps(reply), flush=True)


async def _main(ns: argparse.Namespace) -> None:
    sizes = [int(s) for s in ns.islands.split(",")]
    token = ns.token or settings.resolve(ns.server).token  # $PWCTL_TOKEN, the config file, the token file
    sim = Simulator(ns.server, island_layout(ns.hosts, sizes), ns.devices, token, ns.reconnect_max, ns.complete,
                    ns.listen_min)
    await sim.start()
    try:
        await _serve_commands(sim)
    finally:
        await sim.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.simworkers", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True, help="the controller's address")
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--islands", default="4", help="island sizes in hosts, e.g. 512,64,64,4 (the last repeats)")
    p.add_argument("--devices", type=int, default=4, help="devices per host")
    p.add_argument("--token", default="", help="the cluster token (default: found as pwctl finds it: "
                   "$PWCTL_TOKEN, the config file, the data directory's token file)")
    p.add_argument("--reconnect-max", type=float, default=5.0, help="longest wait between reconnections (s)")
    p.add_argument("--complete", action="store_true",
                   help="report every task done (ok) at once instead of failed (nothing runs either way)")
    p.add_argument("--listen-min", type=int, default=32,
                   help="hosts of islands this large listen for relayed messages (0: none)")
    ns = p.parse_args(argv)
    if ns.hosts < 1 or ns.devices < 1:
        p.error("--hosts and --devices must be at least 1")
    # one socket per host and a few for the process: raise the soft limit on open files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, 5 * ns.hosts + 256)  # streams, listeners, relays' streams (both ends)
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    asyncio.run(_main(ns))


class SimWorkers:
    """Drives a `python -m bench.simworkers` process (its stdin/stdout commands) and stops it."""

    def __init__(self, server: str, hosts: int, islands: Sequence[int] = (4,), devices: int = 4,
                 token: str | None = None, env: dict[str, str] | None = None, log: Path | None = None,
                 complete: bool = False, listen_min: int = 32) -> None:
        self.names = [host_name(i) for i in range(hosts)]
        self.islands = island_layout(hosts, islands)
        args = [sys.executable, "-m", "bench.simworkers", "--server", server, "--hosts", str(hosts),
                "--islands", ",".join(str(s) for s in islands), "--devices", str(devices)]
        if complete:
            args.append("--complete")
        args += ["--listen-min", str(listen_min)]
        run_env = dict(env if env is not None else os.environ)
        run_env.pop("PWCTL_TOKEN", None)
        if token:
            run_env["PWCTL_TOKEN"] = token  # not on the command line, where `ps` shows it
        repo = Path(__file__).resolve().parent.parent
        run_env["PYTHONPATH"] = str(repo) + os.pathsep + run_env.get("PYTHONPATH", "")
        self._log = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 (closed in close())
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(args, env=run_env, cwd=repo, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)

    def ask(self, cmd: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the simulator exited ({self.proc.poll()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def wait_registered(self, count: int | None = None, since: float = 0.0, timeout: float = 60.0) -> dict[str, Any]:
        """Waits until `count` hosts (default all) registered at or after `since` (monotonic)."""
        return self.ask("wait", count=len(self.names) if count is None else count, since=since, timeout=timeout)

    def received(self, runs: Sequence[int]) -> list[float | None]:
        """When the last task of each run reached its host (monotonic), None for one not seen."""
        return list(self.ask("received", runs=list(runs))["times"])

    def silence(self, names: Sequence[str]) -> float:
        return float(self.ask("silence", hosts=list(names))["at"])

    def disconnect(self, names: Sequence[str]) -> float:
        return float(self.ask("disconnect", hosts=list(names))["at"])

    def resume(self, names: Sequence[str]) -> float:
        return float(self.ask("resume", hosts=list(names))["at"])

    def status(self, detail: bool = False) -> dict[str, Any]:
        return self.ask("status", detail=detail)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.ask("stop")
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for fh in (self.proc.stdin, self.proc.stdout):
            if fh is not None:
                fh.close()
        if self._log is not subprocess.DEVNULL:
            self._log.close()  # type: ignore[union-attr]

    def __enter__(self) -> SimWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    main()
