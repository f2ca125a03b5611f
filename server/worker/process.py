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
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc
import jax
from grpc import aio

from pwctl import tls
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc
from schemas.pathways.v1 import worker_pb2 as wpb

from .. import heap, host_credential, paths
from ..auth import TokenInterceptor
from ..health import Health
from ..relaysig import link_key
from ..rpcguard import quiet_final_status
from . import memory
from .auth import WorkerAuth
from .buffers import BufferStore
from .bulk_service import BulkSessions
from .config import WorkerConfig
from .executable import unload_unused
from .executor import Executor
from .handlers import add_to_server
from .locallink import LocalReceiver
from .reconnect import Reconnect
from .relay import GAP_S as RELAY_GAP_S
from .relay import Forwarder, Inbox, relayed_message
from .reporting import EventBuffer
from .servicer import WorkerServicer
from .tcplink import TcpReceiver
from .transfer import CHANNEL_OPTIONS, CLIENT_OPTIONS, TransferSender

log = logging.getLogger(__name__)

STALE_START_S = 0.25  # a node running longer than this reports that it started (hang detection)
# Idle this long after some work: free heap memory goes back to the OS. Not sooner: the next burst
# faults every page back in, and a pause of a second between bursts is common (a client's host-side
# work between steps; the bench's windows alternating with plain JAX's lost 10-20% to trims at 1 s).
TRIM_IDLE_S = 5.0
IDLE_POLL_S = 0.5
DEFAULT_HEARTBEAT_S = 1.0
# The sender wakes at least this often, whatever the heartbeat interval (stale-start checks).
SENDER_POLL_S = 0.5


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
        memory.keep_freed_memory()  # no fresh pages per buffer while work flows; trimmed when idle
        self.devices = jax.devices()
        self.kind = "gpu" if self.devices[0].platform in ("gpu", "cuda", "rocm") else "cpu"
        self.store = BufferStore()
        self.sender = TransferSender(token=config.token, tls=config.tls)
        self.auth = WorkerAuth()
        self._events = EventBuffer()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.executor = Executor(self.store, self.devices, self._report, self.sender)
        self.address = ""
        self.stopping = asyncio.Event()
        # as the controller says (Registered, HeartbeatSettings); until then the default
        self.heartbeat_interval = DEFAULT_HEARTBEAT_S
        self._urgent: list[cpb.WorkerToController] = []  # sent at the next wake (group joins)
        # proves this is the host named config.name when it registers again (the controller's)
        self.credential = host_credential.load(config.name)
        # controller messages in their order, whichever way each came (relay.py)
        self.inbox = Inbox()
        self.relayed_in = 0
        self._rejected = 0  # relayed messages that failed their signature, not reported yet (relaysig.py)
        self.servicer: WorkerServicer | None = None  # once serving
        self.forwarder: Forwarder | None = None  # once serving: this worker as a relay

    def _report(self, events: list[cpb.NodeEvent], prompt: bool = False, backlog: int | None = None,
                nbytes: int = 0) -> None:
        """Events for the controller, sent when due (reporting.py)."""
        if self._events.add(events, prompt, backlog, nbytes) and self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        host, _ = paths.split_address(self.config.listen)
        # every call needs the cluster's token, on every address (auth.py), when the worker has one
        token = self.config.token if self.config.check_token else None
        interceptors = [TokenInterceptor(token)] if token else []
        server = aio.server(options=CHANNEL_OPTIONS, interceptors=interceptors)
        servicer = WorkerServicer(self.store, self.executor, self.config.name, self.config.island, self.auth)
        self.servicer = servicer
        add_to_server(servicer, server)  # the generated registration, but malformed input is INVALID_ARGUMENT
        self.forwarder = Forwarder(self.config.name, self._relayed, self._relay_failed, self.config.token,
                                   self.config.tls)
        servicer.on_relayed = self._relayed
        servicer.relay_counts = lambda: (self.relayed_in, self.forwarder.forwarded if self.forwarder else 0,
                                         self.inbox.rejected)
        health = Health("pathways.v1.Worker")
        await health.attach(server)
        port = tls.add_port(server, self.config.listen, self.config.tls)  # TLS only, where configured
        if port == 0:
            raise SystemExit(f"cannot listen on {self.config.listen}")
        self.address = f"{host}:{port}"
        await server.start()
        local = LocalReceiver(self.address, servicer.deliver_local)  # same-host peers' transfers
        local.start()
        # other hosts' transfers; the hello carries the peer credential (auth.py)
        # and the controller's bulk bytes of proxy sessions (bulk_service.py): the session credential
        bulk = BulkSessions(servicer, asyncio.get_running_loop(), self.config.token)
        tcp = TcpReceiver(host, self.config.token, servicer.deliver_peer, check=self.auth.peer_secret_ok,
                          tls=self.config.tls, session=bulk.serve)
        servicer.data_address = tcp.start()
        probes = await health.serve_plain(self.config.health_listen) if self.config.health_listen else None
        await health.serving()
        heap.settle()  # JAX's and the server's objects stay out of later collections
        log.info("worker %s (island %s, %d %s devices) serving at %s%s",
                 self.config.name, self.config.island, len(self.devices), self.kind, self.address,
                 " (TLS)" if self.config.tls is not None else "")
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self.stopping.set)
        link = asyncio.create_task(self._controller_loop())
        trimmer = asyncio.create_task(self._release_memory_when_idle())
        await self.stopping.wait()
        await health.shutting_down()
        link.cancel()
        trimmer.cancel()
        self.executor.stop()
        self.sender.close()
        servicer.close()
        local.close()
        tcp.close()
        self.forwarder.close()
        await server.stop(grace=0.5)
        if probes is not None:
            await probes.stop(grace=None)
        log.info("worker %s stopped", self.config.name)

    async def _controller_loop(self) -> None:
        metadata = (("authorization", f"Bearer {self.config.token}"),) if self.config.token else None
        loop = asyncio.get_running_loop()
        retry = Reconnect(self.config.reconnect_max_s)
        said = ""  # the last TLS failure logged: said once, not at every retry
        while not self.stopping.is_set():
            rejected = False
            up = False  # the controller answered on this stream
            async with tls.aio_channel(self.config.server, CLIENT_OPTIONS, self.config.tls) as channel:
                stub = cgrpc.ControllerStub(channel)
                try:
                    self.inbox.reset()  # a new registration: its messages are numbered from 1
                    call = stub.WorkerConnect(self._upstream(), metadata=metadata)
                    async for msg in call:
                        retry.connected()
                        up = True
                        self._receive(msg)
                except aio.AioRpcError as e:
                    rejected = e.code() != grpc.StatusCode.UNAVAILABLE
                    why = None
                    if not rejected:  # a TLS failure is UNAVAILABLE too: say which (one probe, off the loop)
                        why = await asyncio.to_thread(tls.diagnose, e.details() or "", self.config.server,
                                                      "controller", self.config.tls)
                    if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                        log.error("the controller rejected this worker: %s", e.details())
                    elif why is not None:
                        if why != said:
                            log.error("%s", why)
                        said = why
                    elif rejected or up:  # up: a controller gone (its host too: keepalive, ~20 s)
                        log.warning("controller stream ended: %s %s", e.code().name, e.details())
            await asyncio.sleep(retry.delay(loop.time(), rejected))

    def _activity(self) -> tuple[int, int, int, int]:
        """Changes whenever the worker ran something, its buffers changed, or an upload came in
        (one it refused, or that was cancelled or cut short, changes no buffer count, yet its
        pieces left freed memory: a staged 64 MiB upload that a client deleted left ~20 MiB
        resident, untrimmed, when the worker had read it slowly)."""
        uploads = self.servicer.upload_messages if self.servicer is not None else 0
        return (self.executor.nodes_executed, *self.store.activity(), uploads)

    async def _release_memory_when_idle(self) -> None:
        """Once the worker has been idle for TRIM_IDLE_S: unloads the compiled programs nobody
        ran for `unload_after_s` and hands freed heap memory back to the OS (memory.py). XLA's
        buffers and compilations leave hundreds of MiB in malloc's arenas after a burst of work."""
        idle = memory.IdleTrimmer(self._activity, idle_s=TRIM_IDLE_S)
        while True:
            await asyncio.sleep(IDLE_POLL_S)
            if self.servicer is not None:
                self.servicer.gathering.sweep()  # parts of arrays that will never be whole (parts.py)
            due = idle.due()
            if due or (idle.quiet() and self.config.unload_after_s > 0):
                await asyncio.to_thread(self._release_memory, due)

    def _release_memory(self, trim: bool) -> None:
        unloaded = 0
        if self.config.unload_after_s > 0:
            unloaded = unload_unused(self.config.unload_after_s)
            if unloaded:
                log.info("unloaded %d compiled program(s) not run for %g s", unloaded,
                         self.config.unload_after_s)
        if trim or unloaded:
            heap.settle()  # what the work left behind, collected while nothing runs
            memory.trim()

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
                credential=self.credential,
            )
        )
        assert self._wake is not None
        last_beat = 0.0
        last_stale = 0.0
        loop = asyncio.get_running_loop()
        while True:
            interval = self.heartbeat_interval
            due = self._events.due_in()
            poll = min(interval / 2, SENDER_POLL_S)
            timeout = poll if due is None else min(due, poll)
            if timeout > 0 and not self._wake.is_set():
                # a timer that sets the event, rather than asyncio.wait_for, which makes a task for
                # every wait: this loop wakes for every batch of node events the worker reports
                timer = loop.call_later(timeout, self._wake.set)
                try:
                    await self._wake.wait()
                finally:
                    timer.cancel()
            self._wake.clear()
            while self._urgent:
                yield self._acked(self._urgent.pop(0))
            now = loop.time()
            if self.inbox.stalled(now, RELAY_GAP_S):  # a relayed message never came: ask for it directly
                log.warning("controller message %d did not come through its relay in %g s; asking for it "
                            "directly", self.inbox.next, RELAY_GAP_S)
                yield self._acked(cpb.WorkerToController(relay_failed=cpb.RelayFailed(hosts=[self.config.name])))
            if self._rejected:  # forged or altered on the way: the controller counts them, sends directly
                n, self._rejected = self._rejected, 0
                yield self._acked(cpb.WorkerToController(
                    relay_failed=cpb.RelayFailed(hosts=[self.config.name], rejected=n)))
            if now - last_stale >= STALE_START_S / 2:
                last_stale = now
                stale = self.executor.stale_starts(STALE_START_S)
                if stale:
                    self._report(stale)
            if self._events.due_in() == 0:
                yield self._acked(cpb.WorkerToController(node_events=cpb.NodeEvents(events=self._events.take())))
            now = loop.time()
            if now - last_beat >= interval * 0.9:
                last_beat = now
                n, nbytes = self.store.stats()
                g, gbytes = self.servicer.gathering.stats() if self.servicer is not None else (0, 0)
                yield self._acked(cpb.WorkerToController(heartbeat=cpb.Heartbeat(
                    buffers=n, buffer_bytes=nbytes, gathering=g, gathering_bytes=gbytes)))

    def _acked(self, msg: cpb.WorkerToController) -> cpb.WorkerToController:
        """`msg` telling the controller which of its messages this worker handled (relay.py)."""
        msg.delivered = self.inbox.delivered
        return msg

    def _receive(self, msg: cpb.ControllerToWorker) -> None:
        """A message on the controller stream: a batch to relay, or this worker's own, handled
        in the controller's order (relay.py's Inbox)."""
        if msg.WhichOneof("msg") == "relay":
            if self.forwarder is not None:
                self.forwarder.forward(msg.relay)
            return
        for m in self.inbox.accept(msg, self._now()):
            self._handle(m)

    def _now(self) -> float:
        return self._loop.time() if self._loop is not None else 0.0

    def _relayed(self, part: wpb.RelayedMessage) -> None:
        """A message for this worker that came through a relay (or was a relay batch's own part)."""
        rejected = self.inbox.rejected
        msg = relayed_message(part, self.inbox)
        if msg is None:
            if self.inbox.rejected != rejected:  # reported at once: the genuine one may never come
                self._rejected += self.inbox.rejected - rejected
                if self._wake is not None:
                    self._wake.set()
            return
        self.relayed_in += 1
        for m in self.inbox.accept(msg, self._now()):
            self._handle(m)

    def _relay_failed(self, hosts: Sequence[str]) -> None:
        self._send_now(cpb.WorkerToController(relay_failed=cpb.RelayFailed(hosts=list(hosts))))

    def _handle(self, msg: cpb.ControllerToWorker) -> None:
        kind = msg.WhichOneof("msg")
        if kind == "enqueue":
            self.executor.submit(msg.enqueue)
            if msg.enqueue.release_ids:
                self.store.release(msg.enqueue.release_ids, msg.enqueue.release_owner)
        elif kind == "release":
            if msg.release.buffer_ids:
                self.store.release(msg.release.buffer_ids, msg.release.owner)
            elif msg.release.owner:
                self.store.release_owner(msg.release.owner)
        elif kind == "drop":
            if self.servicer is not None:
                self.servicer.drop_runs(msg.drop)
            else:  # (not serving yet: nothing gathered here)
                self.executor.drop(list(msg.drop.run_ids), msg.drop.reason, list(msg.drop.skipped_seqs))
        elif kind == "registered":
            self.executor.reset("the controller restarted")
            if self.executor.runners.group.announced:  # a new registration is in no island group
                self.executor.join_group(cpb.JoinGroup(num_processes=1), lambda error: None)
            self.inbox.link = msg.registered.link  # relayed messages of this registration carry it
            if msg.registered.session_key:  # callers' credentials are checked with it (auth.py)
                self.auth.set_key(msg.registered.session_key)
                self.sender.set_key(msg.registered.session_key)
                if self.forwarder is not None:
                    self.forwarder.key = msg.registered.session_key
            if msg.registered.credential:  # a new one: this process took the name (or was its first)
                self.credential = msg.registered.credential
                host_credential.save(self.config.name, self.credential)
            # relayed messages of this registration are signed for this host (server/relaysig.py)
            self.inbox.key = link_key(self.credential, msg.registered.link) if msg.registered.link else b""
            self._set_heartbeat(msg.registered.heartbeat_interval_s)
            log.info("registered as host %d", msg.registered.host_id)
        elif kind == "heartbeat":
            self._set_heartbeat(msg.heartbeat.heartbeat_interval_s)
        elif kind == "join":
            generation = msg.join.generation
            self.executor.join_group(msg.join, lambda error: self._joined(generation, error))

    def _joined(self, generation: int, error: str) -> None:
        """(launch thread) The island group switch is done: tell the controller."""
        reply = cpb.WorkerToController(joined=cpb.GroupJoined(generation=generation, error=error))
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._send_now, reply)

    def _send_now(self, msg: cpb.WorkerToController) -> None:
        self._urgent.append(msg)
        if self._wake is not None:
            self._wake.set()

    def _set_heartbeat(self, interval: float) -> None:
        """Beats every `interval` seconds from now on (0, from an older controller: the default)."""
        self.heartbeat_interval = interval if interval > 0 else DEFAULT_HEARTBEAT_S


def run_worker(config: WorkerConfig, log_level: str = "INFO") -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_final_status()  # one line, not gRPC's traceback (rpcguard.FinalStatusFilter)
    asyncio.run(WorkerProcess(config).serve())
