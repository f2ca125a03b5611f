"""gRPC servicer: translates requests into calls on the controller's components.

No business logic here; component errors map to status codes in one place, for every method,
streaming ones included: `errors.classify`, applied by the server's `rpcguard.GuardInterceptor`
(which also answers requests that do not decode with INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

import grpc
from grpc import aio

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc

from .. import __version__
from ..db.engine import redact
from ..relaysig import link_key
from .core import Controller
from .errors import InvalidArgument, NotFound, Rejected
from .hostviews import list_devices, list_hosts
from .limits import check_registration, page_size
from .links import WorkerLink
from .owners import ConnectionOwners
from .status_view import StatusQuery

T = TypeVar("T")
log = logging.getLogger(__name__)



async def _until(stop: asyncio.Event, stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """The items of a long-lived server stream until `stop` is set, then its end (status OK): a
    controller shutting down ends `status --watch` and `logs -f` instead of leaving gRPC to cancel
    their handlers when the grace period runs out. One task per item: for low-rate streams."""
    stopped = asyncio.ensure_future(stop.wait())
    it = aiter(stream)
    try:
        while True:
            nxt: asyncio.Future[T] = asyncio.ensure_future(anext(it))
            await asyncio.wait((nxt, stopped), return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await nxt
                return
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stopped.cancel()


class _Gate:
    """Counts the open streams of one kind and refuses one more beyond `most` (RESOURCE_EXHAUSTED):
    each open stream holds memory (a session its queue, a watch its snapshots in flight)."""

    def __init__(self, what: str, most: int, flag: str = "") -> None:
        self.what, self.most, self.flag, self.open = what, most, flag, 0

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        if self.open >= self.most:
            hint = f" (the controller's {self.flag})" if self.flag else ""
            raise Rejected(f"{self.open} {self.what} are open, the limit{hint}: close some and retry")
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1


class ControllerServicer(cgrpc.ControllerServicer):
    def __init__(self, core: Controller) -> None:
        self.core = core
        limits = core.config.limits
        self.limits = limits
        self._sessions = _Gate("client sessions", limits.max_sessions, "--max-sessions")
        self._watches = _Gate("watch streams", limits.max_watches, "--max-watches")
        self._log_streams = _Gate("log streams", limits.max_log_streams)
        self._owners = ConnectionOwners()

    # ---- cluster ----
    async def GetInfo(self, request: cpb.GetInfoRequest, context: aio.ServicerContext) -> cpb.ServerInfo:
        core = self.core
        return cpb.ServerInfo(
            version=__version__,
            address=core.address,
            database=redact(core.db_url),
            uptime_s=time.monotonic() - core.started_mono,
            islands=len(core.cluster.islands),
            hosts=len(core.cluster.hosts),
            devices=sum(core.cluster.island_counts(i)[1] for i in core.cluster.islands),
            slices=core.slice_count(),
            jobs=core.job_count(),
            pid=os.getpid(),
            dispatch=core.dispatch,
            started_at=core.started_at,
            metrics_url=core.metrics_url,
            policy=core.config.policy,
            jobs_total=len(core.jobs.jobs),
        )

    async def Shutdown(self, request: cpb.ShutdownRequest, context: aio.ServicerContext) -> cpb.ShutdownResponse:
        log.info("shutdown requested by a caller at %s", context.peer())
        self.core.request_shutdown()
        return cpb.ShutdownResponse()

    async def ListIslands(
        self, request: cpb.ListIslandsRequest, context: aio.ServicerContext
    ) -> cpb.ListIslandsResponse:
        islands = self.core.cluster.island_protos()
        for island in islands:
            island.group = self.core.groups.summary(island.name)
        return cpb.ListIslandsResponse(islands=islands)

    async def ListHosts(self, request: cpb.ListHostsRequest, context: aio.ServicerContext) -> cpb.ListHostsResponse:
        self.core.require_island(request.island)
        return list_hosts(self.core.cluster, request.island, request.state, page_size(request.limit),
                          request.page_token, stalled=self.core.hangs.stalled_hosts())

    async def ListDevices(
        self, request: cpb.ListDevicesRequest, context: aio.ServicerContext
    ) -> cpb.ListDevicesResponse:
        self.core.require_island(request.island)
        return list_devices(self.core.cluster, request.island, request.state, page_size(request.limit),
                            request.page_token, self.core.device_slice_count, self.core.slices.epoch)

    async def DeleteHost(self, request: cpb.DeleteHostRequest, context: aio.ServicerContext) -> cpb.DeleteHostResponse:
        self.core.removal.delete_host(request.name, request.force)
        await self.core.slices.written()  # the answer promises the rows are gone
        return cpb.DeleteHostResponse()

    async def DeleteIsland(
        self, request: cpb.DeleteIslandRequest, context: aio.ServicerContext
    ) -> cpb.DeleteIslandResponse:
        self.core.removal.delete_island(request.name)
        await self.core.slices.written()
        return cpb.DeleteIslandResponse()

    # ---- workers ----
    async def WorkerConnect(
        self, request_iterator: AsyncIterator[cpb.WorkerToController], context: aio.ServicerContext
    ) -> AsyncIterator[cpb.ControllerToWorker]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("msg") != "register":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a registration")
            return
        reg = first.register
        check_registration(reg, self.limits)  # before it costs anything (limits.py)
        credential, credential_hash = self.core.cluster.admit(reg)  # a live host's name: its credential
        link = WorkerLink(reg.name)
        # what relays carry for it is signed with a key of its credential (server/relaysig.py)
        link.set_relay_key(link_key(credential or reg.credential, link.link_id))
        info = self.core.cluster.register(reg, link, credential_hash)
        link.send(
            cpb.ControllerToWorker(
                registered=cpb.Registered(
                    host_id=info.id,
                    heartbeat_interval_s=self.core.cluster.heartbeat_interval,
                    device_ids=info.device_ids,
                    session_key=self.core.worker_key,
                    credential=credential,
                    link=link.link_id,
                )
            )
        )
        for missed in self.core.cluster.missed(reg.name):  # owners that ended while it was away
            link.send(missed)
        reader = self.core.spawn(self._read_worker(reg.name, request_iterator, link))
        try:
            async for msg in link.messages():
                yield msg
        finally:
            reader.cancel()
            self.core.cluster.disconnected(reg.name, link)

    async def _read_worker(
        self, name: str, request_iterator: AsyncIterator[cpb.WorkerToController], link: WorkerLink
    ) -> None:
        heartbeat, node_events = self.core.cluster.heartbeat, self.core.dispatcher.node_events
        try:
            async for msg in request_iterator:
                if msg.delivered:
                    link.ack(msg.delivered)  # relayed messages it has: forgotten (relays.py)
                kind = msg.WhichOneof("msg")
                if kind == "heartbeat":
                    heartbeat(name, msg.heartbeat)
                elif kind == "node_events":
                    node_events(name, msg.node_events)
                elif kind == "joined":
                    self.core.groups.joined(name, msg.joined.generation, msg.joined.error)
                elif kind == "relay_failed":
                    self.core.relays.failed(name, list(msg.relay_failed.hosts), msg.relay_failed.rejected)
        except (aio.AioRpcError, aio.UsageError):
            pass
        finally:
            link.close()

    # ---- slices (server/controller/slices.py) ----
    async def CreateSlice(
        self, request: cpb.CreateSliceRequest, context: aio.ServicerContext
    ) -> cpb.CreateSliceResponse:
        island = request.spec.island
        if island and island not in self.core.cluster.islands:  # not found (exit 3), as everywhere
            known = ", ".join(sorted(self.core.cluster.islands)) or "none"
            raise NotFound(f"unknown island {island!r}; known islands: {known}")
        self._owners.check(context.peer(), request.owner)  # only the caller's own session or job (owners.py)
        created = self.core.slices.create(request.spec, request.dry_run, request.owner)
        await self.core.slices.written()  # the answer promises a durable slice
        if not request.dry_run and len({d.host for d in created.slice.devices}) > 1:
            # over several hosts: answer once the island's group can run it (or say why not), at
            # most the controller's --group-wait, as calls on the slice wait
            island = created.slice.devices[0].island
            if not await self.core.groups.wait_usable(island, self.core.slices.group_wait_s):
                created.explanation += (f"; island {island}'s group is not formed yet "
                                        f"({self.core.groups.summary(island) or 'forming'}): calls on the slice wait "
                                        f"for it, up to the controller's --group-wait")
        return created

    async def ListSlices(self, request: cpb.ListSlicesRequest, context: aio.ServicerContext) -> cpb.ListSlicesResponse:
        return cpb.ListSlicesResponse(slices=self.core.slices.list(request.owner))

    async def GetSlice(self, request: cpb.GetSliceRequest, context: aio.ServicerContext) -> cpb.Slice:
        return self.core.slices.get(request.name)

    async def DeleteSlice(
        self, request: cpb.DeleteSliceRequest, context: aio.ServicerContext
    ) -> cpb.DeleteSliceResponse:
        self.core.slices.delete(request.name, request.force)
        await self.core.slices.written()
        return cpb.DeleteSliceResponse()

    # ---- programs (server/controller/sessions.py) ----
    async def Session(
        self, request_iterator: AsyncIterator[cpb.ClientMessage], context: aio.ServicerContext
    ) -> AsyncIterator[cpb.SessionEvent]:
        peer, owner = context.peer(), ""
        with self._sessions.enter():
            try:
                async for ev in self.core.sessions.serve(request_iterator, context):
                    if not owner and ev.WhichOneof("msg") == "welcome":
                        session = self.core.sessions.sessions.get(ev.welcome.client_id)
                        if session is not None:
                            owner = session.owner
                            self._owners.opened(peer, owner)
                    yield ev
            finally:
                if owner:
                    self._owners.closed(peer, owner)

    # ---- jobs (server/controller/jobs.py) ----
    async def SubmitJob(self, request: cpb.SubmitJobRequest, context: aio.ServicerContext) -> cpb.Job:
        return await self.core.jobs.submit(request)

    async def ListJobs(self, request: cpb.ListJobsRequest, context: aio.ServicerContext) -> cpb.ListJobsResponse:
        return cpb.ListJobsResponse(jobs=self.core.hangs.annotate_jobs(self.core.jobs.list(request.state, request.all)))

    async def GetJob(self, request: cpb.GetJobRequest, context: aio.ServicerContext) -> cpb.Job:
        return self.core.hangs.annotate_jobs([self.core.jobs.get(request.id)])[0]

    async def CancelJob(self, request: cpb.CancelJobRequest, context: aio.ServicerContext) -> cpb.Job:
        return await self.core.jobs.cancel(request.id)

    async def StreamLogs(
        self, request: cpb.StreamLogsRequest, context: aio.ServicerContext
    ) -> AsyncIterator[cpb.LogChunk]:
        with self._log_streams.enter():
            async for chunk in _until(self.core.shutdown_event, self.core.jobs.stream_logs(request, context)):
                yield chunk

    # ---- observe (server/controller/observe.py) ----
    async def Watch(
        self, request: cpb.WatchRequest, context: aio.ServicerContext
    ) -> AsyncIterator[cpb.ClusterStatus]:
        query = StatusQuery.of(request)  # a bad query: its ControllerError's status (rpcguard)
        with self._watches.enter():
            watch = self.core.observer.watch(request.interval_s or 1.0, query)
            async for status in _until(self.core.shutdown_event, watch):
                yield status

    async def GetTrace(self, request: cpb.GetTraceRequest, context: aio.ServicerContext) -> cpb.TraceResponse:
        if request.last < 0 or request.since_unix_ns < 0:
            raise InvalidArgument("last and since must not be negative")
        text, total, n = await self.core.observer.trace_window(request.job, request.program, request.since_unix_ns,
                                                               request.last)
        return cpb.TraceResponse(chrome_trace_json=text, node_runs_total=total, node_runs=n)
