"""The worker process: serves the Worker service and keeps a stream to the controller.

The stream carries registration, heartbeats and batched node events up, and enqueued
work, releases and drops down. When the controller goes away the worker keeps its
devices and reconnects (registering again as the same host).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import uuid
from collections.abc import AsyncIterator

import grpc
import jax
from grpc import aio

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

from .. import paths
from ..auth import TokenInterceptor
from .buffers import BufferStore
from .config import WorkerConfig
from .executor import Executor
from .servicer import WorkerServicer
from .transfer import CHANNEL_OPTIONS, TransferSender

log = logging.getLogger(__name__)

EVENT_FLUSH_S = 0.005
STALE_START_S = 0.25  # a node running longer than this reports that it started (hang detection)


def machine_id() -> str:
    """Workers with equal ids share /dev/shm (same boot, same mount namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = uuid.getnode().__str__()
    try:
        ns = os.readlink("/proc/self/ns/mnt")
    except OSError:
        ns = ""
    return f"{boot}:{ns}"


class WorkerProcess:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.devices = jax.devices()
        self.kind = "gpu" if self.devices[0].platform in ("gpu", "cuda", "rocm") else "cpu"
        self.store = BufferStore()
        self.sender = TransferSender(token=config.token)
        self._events: list[cpb.NodeEvent] = []
        self._events_lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.executor = Executor(self.store, self.devices, self._report, self.sender)
        self.address = ""
        self.stopping = asyncio.Event()

    def _report(self, events: list[cpb.NodeEvent]) -> None:
        with self._events_lock:
            first = not self._events
            self._events.extend(events)
        if first and self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        host, _ = paths.split_address(self.config.listen)
        # beyond loopback, uploads, fetches and peer transfers need the cluster's token too
        interceptors = (
            [TokenInterceptor(self.config.token)] if self.config.token and not paths.is_loopback(host) else []
        )
        server = aio.server(options=CHANNEL_OPTIONS, interceptors=interceptors)
        wgrpc.add_WorkerServicer_to_server(
            WorkerServicer(self.store, self.executor, self.config.name, self.config.island), server
        )
        port = server.add_insecure_port(self.config.listen)
        if port == 0:
            raise SystemExit(f"cannot listen on {self.config.listen}")
        self.address = f"{host}:{port}"
        await server.start()
        log.info("worker %s (island %s, %d %s devices) serving at %s",
                 self.config.name, self.config.island, len(self.devices), self.kind, self.address)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self.stopping.set)
        link = asyncio.create_task(self._controller_loop())
        await self.stopping.wait()
        link.cancel()
        self.executor.stop()
        self.sender.close()
        await server.stop(grace=0.5)

    async def _controller_loop(self) -> None:
        backoff = 0.1
        metadata = (("authorization", f"Bearer {self.config.token}"),) if self.config.token else None
        while not self.stopping.is_set():
            async with aio.insecure_channel(self.config.server, options=CHANNEL_OPTIONS) as channel:
                stub = cgrpc.ControllerStub(channel)
                try:
                    call = stub.WorkerConnect(self._upstream(), metadata=metadata)
                    async for msg in call:
                        backoff = 0.1
                        self._handle(msg)
                except aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                        log.error("the controller rejected this worker: %s", e.details())
                    elif e.code() != grpc.StatusCode.UNAVAILABLE:
                        log.warning("controller stream ended: %s %s", e.code().name, e.details())
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.reconnect_max_s)

    async def _upstream(self) -> AsyncIterator[cpb.WorkerToController]:
        yield cpb.WorkerToController(
            register=cpb.RegisterWorker(
                name=self.config.name,
                island=self.config.island,
                address=self.address,
                pid=os.getpid(),
                device_kind=self.kind,
                device_count=len(self.devices),
                machine_id=machine_id(),
            )
        )
        assert self._wake is not None
        interval = 1.0
        last_beat = 0.0
        last_stale = 0.0
        loop = asyncio.get_running_loop()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=interval / 2)
            except TimeoutError:
                pass
            self._wake.clear()
            now = loop.time()
            if now - last_stale >= STALE_START_S / 2:
                last_stale = now
                stale = self.executor.stale_starts(STALE_START_S)
                if stale:
                    self._report(stale)
            with self._events_lock:
                events, self._events = self._events, []
            if events:
                yield cpb.WorkerToController(node_events=cpb.NodeEvents(events=events))
                await asyncio.sleep(EVENT_FLUSH_S)  # let a burst of events coalesce
            now = loop.time()
            if now - last_beat >= interval * 0.9:
                last_beat = now
                n, nbytes = self.store.stats()
                yield cpb.WorkerToController(heartbeat=cpb.Heartbeat(buffers=n, buffer_bytes=nbytes))

    def _handle(self, msg: cpb.ControllerToWorker) -> None:
        kind = msg.WhichOneof("msg")
        if kind == "enqueue":
            self.executor.submit(msg.enqueue)
            for b in msg.enqueue.release_ids:
                self.store.release(b)
        elif kind == "release":
            if msg.release.buffer_ids:
                for b in msg.release.buffer_ids:
                    self.store.release(b)
            elif msg.release.owner:
                self.store.release_owner(msg.release.owner)
        elif kind == "drop":
            self.executor.drop(list(msg.drop.run_ids), msg.drop.reason, list(msg.drop.skipped_seqs))
        elif kind == "registered":
            self.executor.reset("the controller restarted")
            log.info("registered as host %d", msg.registered.host_id)


def run_worker(config: WorkerConfig, log_level: str = "INFO") -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(WorkerProcess(config).serve())
