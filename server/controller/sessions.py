"""Client sessions: one long-lived stream per client process (or job driver).

The stream carries registrations, runs and releases from the client (often coalesced
into one batch message) and run failures, the count of finished runs (the client's bound on
runs in flight) and slice changes back. When the stream ends,
everything the client owned goes: its waiting runs, its buffers on every worker, the
slices it made without a name.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from grpc import aio

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from ..invariants import InvariantError
from ..scheduler import Batch, Submit
from .errors import ControllerError

if TYPE_CHECKING:
    from .core import Controller

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ClientSession:
    client_id: str
    id_prefix: int
    name: str
    job_id: str
    priority: int
    weight: float
    sequential: bool
    queue: asyncio.Queue[cpb.SessionEvent | None] = field(default_factory=asyncio.Queue)
    programs: set[str] = field(default_factory=set)
    # Release barrier: a release may not reach a worker before every run the client
    # submitted earlier has finished (a waiting run's enqueue has not been sent yet, and
    # it may read the released buffer).
    submitted: int = 0
    open_runs: dict[int, int] = field(default_factory=dict)  # run id -> ordinal
    _open_heap: list[int] = field(default_factory=list)
    _closed: set[int] = field(default_factory=set)  # ordinals closed but still in the heap
    held_releases: deque[tuple[int, str, list[int]]] = field(default_factory=deque)
    finished: int = 0  # runs over (ran, failed or refused): the client's bound on runs in flight
    _reported: int = 0

    @property
    def owner(self) -> str:
        return f"job:{self.job_id}" if self.job_id else f"client:{self.client_id}"

    def send(self, ev: cpb.SessionEvent) -> None:
        self.queue.put_nowait(ev)

    def run_failed(self, run_id: int, error: str) -> None:
        self.send(cpb.SessionEvent(finished=cpb.RunFinished(run_id=run_id, ok=False, error=error)))

    def run_refused(self, run_id: int, error: str) -> None:
        """A run that never started (unknown program, wrong arity): failed, and over."""
        self.run_failed(run_id, error)
        self.finished += 1

    def report_finished(self) -> None:
        """Tells the client how many of its runs are over, if that changed since last time."""
        if self.finished != self._reported:
            self._reported = self.finished
            self.send(cpb.SessionEvent(runs_done=cpb.RunsDone(count=self.finished)))

    def run_opened(self, run_id: int) -> None:
        self.open_runs[run_id] = self.submitted
        heapq.heappush(self._open_heap, self.submitted)
        self.submitted += 1

    def run_closed(self, run_id: int) -> list[tuple[str, list[int]]]:
        """Forgets a finished run; returns the releases that may go out now."""
        ordinal = self.open_runs.pop(run_id, None)
        if ordinal is not None:
            self._closed.add(ordinal)
            self.finished += 1
        return self.releasable()

    def hold_release(self, address: str, ids: list[int]) -> list[tuple[str, list[int]]]:
        self.held_releases.append((self.submitted, address, ids))
        return self.releasable()

    def releasable(self) -> list[tuple[str, list[int]]]:
        heap, closed = self._open_heap, self._closed
        while heap and heap[0] in closed:
            closed.discard(heapq.heappop(heap))
        if not self.held_releases:
            return []
        low = self._open_heap[0] if self._open_heap else self.submitted
        out = []
        while self.held_releases and self.held_releases[0][0] <= low:
            _, address, ids = self.held_releases.popleft()
            out.append((address, ids))
        return out


class SessionManager:
    def __init__(self, core: Controller) -> None:
        self.core = core
        self.sessions: dict[str, ClientSession] = {}
        base = random.randrange(1, 1 << 23)
        self._prefixes = (((base + i) % ((1 << 24) - 1)) + 1 for i in itertools.count())
        self._client_numbers = itertools.count(1)

    async def serve(
        self, request_iterator: AsyncIterator[cpb.ClientMessage], context: aio.ServicerContext
    ) -> AsyncIterator[cpb.SessionEvent]:
        it = aiter(request_iterator)
        first = await anext(it, None)
        if first is not None and first.WhichOneof("msg") == "batch" and first.batch.messages:
            rest = list(first.batch.messages[1:])
            first = first.batch.messages[0]
        else:
            rest = []
        if first is None or first.WhichOneof("msg") != "hello":
            yield cpb.SessionEvent(error="a session starts with a hello message")
            return
        hello = first.hello
        dispatch = hello.dispatch or self.core.dispatch
        if dispatch not in ("parallel", "sequential"):
            yield cpb.SessionEvent(error=f"unknown dispatch mode {dispatch!r}: use parallel or sequential")
            return
        session = ClientSession(
            client_id=f"c{next(self._client_numbers)}",
            id_prefix=next(self._prefixes),
            name=hello.client_name,
            job_id=hello.job_id,
            priority=hello.priority,
            weight=hello.weight if hello.weight > 0 else 1.0,
            sequential=dispatch == "sequential",
        )
        self.sessions[session.client_id] = session
        log.info("session %s opened (%s%s)", session.client_id, session.name,
                 f", job {session.job_id}" if session.job_id else "")
        yield cpb.SessionEvent(welcome=cpb.Welcome(client_id=session.client_id, id_prefix=session.id_prefix))
        for msg in rest:
            self.handle(session, msg)
        self.core.dispatcher.flush()
        reader = asyncio.get_running_loop().create_task(self._read(session, it))
        try:
            while True:
                ev = await session.queue.get()
                if ev is None:
                    break
                yield ev
        finally:
            reader.cancel()
            self.close(session)

    async def _read(self, session: ClientSession, it: AsyncIterator[cpb.ClientMessage]) -> None:
        try:
            async for msg in it:
                self.handle(session, msg)
                self.core.dispatcher.flush()
        except (aio.AioRpcError, aio.UsageError, asyncio.CancelledError):
            pass
        except InvariantError as e:  # a bug: loud in the log, and the client's session ends with it
            log.error("InvariantError in session %s: %s", session.client_id, e)
            session.send(cpb.SessionEvent(error=f"internal error (a bug): {e.problem}"))
        except Exception:
            log.exception("session %s failed", session.client_id)
        finally:
            session.queue.put_nowait(None)

    def handle(self, session: ClientSession, msg: cpb.ClientMessage) -> None:
        kind = msg.WhichOneof("msg")
        if kind == "batch":  # the runs of a batch go to the scheduler in one pass
            submits: list[Submit] = []
            for m in msg.batch.messages:
                if m.WhichOneof("msg") == "run":
                    self.core.dispatcher.submit(session, m.run, submits)
                else:
                    self.handle(session, m)
            if submits:
                self.core.dispatcher.handle(Batch(tuple(submits), submits[-1].now))
        elif kind == "run":
            self.core.dispatcher.submit(session, msg.run)
        elif kind == "release":
            for address, ids in session.hold_release(msg.release.address, list(msg.release.buffer_ids)):
                self.core.dispatcher.release(address, ids)
        elif kind == "register":
            session.send(cpb.SessionEvent(registered=self._register(session, msg.register)))

    def _register(self, session: ClientSession, req: cpb.RegisterProgram) -> cpb.ProgramRegistered:
        reg = self.core.registry
        try:
            missing = reg.add_functions(list(req.functions))
            if missing:
                return cpb.ProgramRegistered(request_id=req.request_id, missing_functions=missing)
            for name in sorted({n.slice for n in req.graph.nodes}):
                self.core.slices.placement(name)  # fails early, naming the slice
            rec = reg.register(req.graph, session.owner)
        except ControllerError as e:
            return cpb.ProgramRegistered(request_id=req.request_id, error=str(e))
        session.programs.add(rec.program_id)
        self.core.program_registered(session, rec)
        return cpb.ProgramRegistered(request_id=req.request_id, program_id=rec.program_id)

    def end_all(self, reason: str) -> None:
        """Tells every client why its session ends and ends the streams (the controller is
        shutting down): clients fail their waits with `reason`, not with a cancelled stream."""
        for session in list(self.sessions.values()):
            session.queue.put_nowait(cpb.SessionEvent(error=reason))
            session.queue.put_nowait(None)

    def close(self, session: ClientSession) -> None:
        if self.sessions.pop(session.client_id, None) is None:
            return
        log.info("session %s closed", session.client_id)
        self.core.dispatcher.client_gone(session.client_id)
        if not session.job_id:  # a job's resources go when the job ends, not its connection
            self.release_owner(session.owner)

    def release_owner(self, owner: str) -> None:
        """Frees every buffer and unnamed slice of a client or job, on every worker."""
        for host in self.core.cluster.ready_hosts():
            if host.link is not None:
                host.link.send(cpb.ControllerToWorker(release=wpb.ReleaseBuffers(owner=owner)))
        self.core.dispatcher.forget_programs(self.core.registry.drop_owner(owner))
        try:
            self.core.slices.release_owner(owner)
        except ControllerError as e:
            log.warning("releasing the slices of %s: %s", owner, e)

    # ---- used by the slice service ----
    def slice_changed(self, info: cpb.Slice) -> None:
        for s in self.sessions.values():
            s.send(cpb.SessionEvent(slice_changed=cpb.SliceChanged(slice=info)))

    def slice_in_use(self, name: str) -> str | None:
        users = self.core.registry.slice_users(name)
        if not users:
            return None
        owners = sorted({o for r in users for o in r.owners})
        return f"{len(users)} registered program(s) use it (owners: {', '.join(owners)})"
