"""What one gang node's hand-off to N hosts costs grpc.aio, directly or through relays (issue 31).

`python -m bench.fanout_probe [--hosts 512] [--relays 0,8,16] [--rounds 15]`: a bare grpc.aio
server (no controller) holding the streams, as the controller's `WorkerConnect` handler does (a
queue per stream, drained by an async generator, identity serializers: the bytes are made before
the clock starts), and N hosts' streams opened from other processes, one TCP connection each.
Per round, one message for every host; per variant (relays 0 = direct) the medians of:

- `handed`: from queuing the round's messages to the last one taken by its stream to be written
  (what the controller's dispatch probe calls the hand-off to gRPC), and the server's event-loop
  CPU time over it;
- `last host`: until the last host received its message (`time.monotonic()`, shared by the
  processes of the machine).

With R relays, the server holds R streams only, to relay processes, and sends each relay one
message carrying its hosts' messages; each relay (its own process and grpc.aio server) writes
them to its hosts' streams. Every process shares this machine's cores, so `last host` here
includes the relays' writes one after another on the same 2 cores; on separate hosts the relays
write in parallel. Informational: nothing asserts these figures (bench/FINDINGS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import grpc
from grpc import aio

SERVICE, METHOD = "bench.FanOut", "Connect"
PAYLOAD = b"x" * 60  # about an Enqueue with one task
OPTIONS = [("grpc.use_local_subchannel_pool", 1)]  # one connection per stream, as separate hosts


def _identity(b: bytes) -> bytes:
    return b


def pack(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def unpack(b: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(b):
        (n,) = struct.unpack_from("<I", b, i)
        out.append(b[i + 4:i + 4 + n])
        i += 4 + n
    return out


class Streams:
    """A grpc.aio server whose every stream is fed from a queue (the controller's WorkerLink)."""

    def __init__(self) -> None:
        self.queues: list[asyncio.Queue[bytes]] = []
        self.taken: list[float] = []
        self.port = 0
        self._server: aio.Server | None = None

    async def _connect(self, requests: AsyncIterator[bytes], context: aio.ServicerContext) -> AsyncIterator[bytes]:
        q: asyncio.Queue[bytes] = asyncio.Queue()
        self.queues.append(q)

        async def messages() -> AsyncIterator[bytes]:
            while True:
                msg = await q.get()
                self.taken.append(time.monotonic())
                yield msg

        async for msg in messages():
            yield msg

    async def start(self) -> None:
        handler = grpc.method_handlers_generic_handler(SERVICE, {METHOD: grpc.stream_stream_rpc_method_handler(
            self._connect, request_deserializer=_identity, response_serializer=_identity)})
        self._server = aio.server()
        self._server.add_generic_rpc_handlers((handler,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)


async def _open(port: int) -> aio.StreamStreamCall:
    """A stream to `port` on a channel (and connection) of its own, opened."""
    channel = aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
    call = channel.stream_stream(f"/{SERVICE}/{METHOD}", request_serializer=_identity,
                                 response_deserializer=_identity)()
    await call.write(b"")
    return call


async def relay(server_port: int) -> None:
    """A relay process: its own streams' server; each message from the server is split among them."""
    streams = Streams()
    await streams.start()
    print(streams.port, flush=True)
    async for msg in await _open(server_port):
        for q, item in zip(streams.queues, unpack(msg), strict=True):
            q.put_nowait(item)


async def hosts(ports: list[int]) -> None:
    """The hosts' streams (one process): answers `report` on stdin with the last receipt and count."""
    received: list[float] = []
    opened = 0

    async def one(port: int) -> None:
        nonlocal opened
        call = await _open(port)
        opened += 1
        async for _ in call:
            received.append(time.monotonic())

    tasks = [asyncio.create_task(one(p)) for p in ports]
    while opened < len(tasks):
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "report":
        print(json.dumps({"last": max(received, default=0.0), "count": len(received)}), flush=True)
        if len(received) >= len(tasks):
            received.clear()


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "bench.fanout_probe", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


async def variant(n: int, relays: int, rounds: int) -> dict[str, float]:
    streams = Streams()
    await streams.start()
    procs: list[subprocess.Popen[str]] = []
    try:
        if relays:
            per = [(n - relays) // relays + (1 if j < (n - relays) % relays else 0) for j in range(relays)]
            procs = [_spawn("--relay", str(streams.port)) for _ in range(relays)]
            ports = []
            for p in procs:
                assert p.stdout is not None
                ports.append(int(await asyncio.get_running_loop().run_in_executor(None, p.stdout.readline)))
            while len(streams.queues) < relays:
                await asyncio.sleep(0.05)
            host_ports = [port for port, m in zip(ports, per, strict=True) for _ in range(m)]
        else:
            per, host_ports = [], [streams.port] * n
        client = _spawn("--hosts-at", json.dumps(host_ports))
        procs.append(client)
        assert client.stdout is not None and client.stdin is not None
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, client.stdout.readline)  # "ready": every host's stream is open
        expected = len(host_ports)
        while len(streams.queues) < (relays or n):
            await asyncio.sleep(0.05)
        rows = []
        for r in range(rounds + 3):
            streams.taken.clear()
            msgs = [pack([PAYLOAD] * m) for m in per] if relays else [PAYLOAD] * n
            t0, c0 = time.monotonic(), time.thread_time()
            for q, msg in zip(streams.queues, msgs, strict=True):
                q.put_nowait(msg)
            while len(streams.taken) < len(msgs):
                await asyncio.sleep(0)
            c1, t1 = time.thread_time(), max(streams.taken)
            for _ in range(200):
                await asyncio.sleep(0.05)
                client.stdin.write("report\n")
                client.stdin.flush()
                rep = json.loads(client.stdout.readline())
                if rep["count"] >= expected:
                    break
            if r >= 3 and rep["count"] >= expected:
                rows.append(((t1 - t0) * 1e3, (c1 - c0) * 1e3, (rep["last"] - t0) * 1e3))
        client.stdin.write("quit\n")
        client.stdin.flush()
        return {"hosts": n, "relays": relays, "rounds": len(rows),
                "handed_ms": round(statistics.median(x[0] for x in rows), 2),
                "handed_loop_cpu_ms": round(statistics.median(x[1] for x in rows), 2),
                "last_host_ms": round(statistics.median(x[2] for x in rows), 2)}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        await streams.stop()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.fanout_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=512)
    ap.add_argument("--relays", default="0,8,16", help="relay counts to try, 0 = direct")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--relay", type=int, help=argparse.SUPPRESS)  # internal: a relay process
    ap.add_argument("--hosts-at", help=argparse.SUPPRESS)  # internal: the hosts' process
    ns = ap.parse_args()
    if ns.relay is not None:
        asyncio.run(relay(ns.relay))
    elif ns.hosts_at is not None:
        asyncio.run(hosts(json.loads(ns.hosts_at)))
    else:
        for k in (int(x) for x in ns.relays.split(",")):
            print(json.dumps({**asyncio.run(variant(ns.hosts, k, ns.rounds)), "load": round(os.getloadavg()[0], 1)}),
                  flush=True)


if __name__ == "__main__":
    main()
