"""Client sessions: one long-lived stream per client process (or job driver).

The stream carries registrations, runs and releases from the client (often coalesced
into one batch message) and run failures, the count of finished runs (the client's bound on
runs in flight) and slice changes back. When the stream ends,
everything the client owned goes: its waiting runs, its buffers on every worker, the
slices it made without a name.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from grpc import aio

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from ..credentials import PREFIX_SHIFT, session_credential
from ..invariants import InvariantError
from ..scheduler import Batch, Submit
from .client_session import ClientSession
from .dispatch import Dispatcher
from .errors import ControllerError
from .programs import ProgramRecord, ProgramRegistry

log = logging.getLogger(__name__)

MAX_PREFIXES_REMEMBERED = 1 << 16  # prefixes handed out that new sessions avoid (beyond: the live ones)


class Slices(Protocol):
    """What sessions need of the slice service."""

    def placement(self, name: str) -> object:
        """Where slice `name` runs; raises a ControllerError naming the slice when it cannot."""
        ...

    def release_owner(self, owner: str) -> None: ...


ProgramListener = Callable[[ClientSession, ProgramRecord], None]


class SessionManager:
    """Serves the session streams; turns their messages into dispatcher calls.

    Collaborators: the dispatcher (runs, releases, flushes), the program registry, the slices
    (placement checks at registration, releasing a gone owner's slices) and `broadcast`, which
    sends one message to every ready worker. `program_listeners` hear every registration.
    """

    def __init__(self, dispatcher: Dispatcher, registry: ProgramRegistry, slices: Slices,
                 broadcast: Callable[[cpb.ControllerToWorker], None], default_dispatch: str = "parallel",
                 worker_key: bytes = b"") -> None:
        self.dispatcher = dispatcher
        self.registry = registry
        self.slices = slices
        self.broadcast = broadcast
        self.default_dispatch = default_dispatch
        self.program_listeners: list[ProgramListener] = []
        self.sessions: dict[str, ClientSession] = {}
        self.worker_key = worker_key or secrets.token_bytes(32)
        self._prefixes_used: set[int] = set()

    def new_id_prefix(self) -> int:
        """A random buffer-id prefix no other client of this controller held (ids are
        `prefix << 40 | n`): not the next of a sequence, so no session can guess another's ids.
        Workers serve a session only the ids under its prefix (server/credentials.py)."""
        if len(self._prefixes_used) >= MAX_PREFIXES_REMEMBERED:  # bounded: then only live ones count
            self._prefixes_used = {s.id_prefix for s in self.sessions.values()}
        while True:
            # below 2**23: ids stay under 2**63 (traces and the database keep them as signed 64-bit)
            prefix = secrets.randbelow((1 << 23) - 1) + 1
            if prefix not in self._prefixes_used:
                self._prefixes_used.add(prefix)
                return prefix

    def credential(self, owner: str, prefix: int) -> str:
        """The session credential workers check (server/credentials.py)."""
        return session_credential(self.worker_key, owner, prefix)

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
        dispatch = hello.dispatch or self.default_dispatch
        if dispatch not in ("parallel", "sequential"):
            yield cpb.SessionEvent(error=f"unknown dispatch mode {dispatch!r}: use parallel or sequential")
            return
        session = ClientSession(
            client_id=f"c{secrets.token_hex(6)}",
            id_prefix=self.new_id_prefix(),
            name=hello.client_name,
            job_id=hello.job_id,
            priority=hello.priority,
            weight=hello.weight if hello.weight > 0 else 1.0,
            sequential=dispatch == "sequential",
        )
        self.sessions[session.client_id] = session
        log.info("session %s opened (%s%s)", session.client_id, session.name,
                 f", job {session.job_id}" if session.job_id else "")
        yield cpb.SessionEvent(welcome=cpb.Welcome(
            client_id=session.client_id, id_prefix=session.id_prefix,
            worker_credential=self.credential(session.owner, session.id_prefix)))
        for msg in rest:
            self.handle(session, msg)
        self.dispatcher.flush()
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
                self.dispatcher.flush()
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
                    if self._own_ids(session, m.run):
                        self.dispatcher.submit(session, m.run, submits)
                else:
                    self.handle(session, m)
            if submits:
                self.dispatcher.handle(Batch(tuple(submits), submits[-1].now))
        elif kind == "run":
            if self._own_ids(session, msg.run):
                self.dispatcher.submit(session, msg.run)
        elif kind == "release":
            # only the session's own ids: another session's buffers are not its to free
            mine = [b for b in msg.release.buffer_ids if b >> PREFIX_SHIFT == session.id_prefix]
            for address, ids in session.hold_release(msg.release.address, mine):
                self.dispatcher.release(address, ids)
        elif kind == "register":
            session.send(cpb.SessionEvent(registered=self._register(session, msg.register)))

    def _own_ids(self, session: ClientSession, run: cpb.RunProgram) -> bool:
        """Whether a run reads and writes only the session's own buffer ids; refuses it if not
        (as an unknown buffer: another session's ids are not revealed to exist)."""
        for b in (*run.input_ids, *run.output_ids):
            if b >> PREFIX_SHIFT != session.id_prefix:
                session.run_refused(run.run_id, f"no buffer {b:#x} in this session")
                return False
        return True

    def register_program(self, session: ClientSession, req: cpb.RegisterProgram) -> cpb.ProgramRegistered:
        """Registers a program for `session` (also the IFRT proxy's way in: server/proxy)."""
        return self._register(session, req)

    def _register(self, session: ClientSession, req: cpb.RegisterProgram) -> cpb.ProgramRegistered:
        reg = self.registry
        try:
            missing = reg.add_functions(list(req.functions))
            if missing:
                return cpb.ProgramRegistered(request_id=req.request_id, missing_functions=missing)
            for name in sorted({n.slice for n in req.graph.nodes}):
                self.slices.placement(name)  # fails early, naming the slice
            rec = reg.register(req.graph, session.owner)
        except ControllerError as e:
            return cpb.ProgramRegistered(request_id=req.request_id, error=str(e))
        for listener in self.program_listeners:
            listener(session, rec)
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
        self.dispatcher.client_gone(session.client_id)
        if not session.job_id:  # a job's resources go when the job ends, not its connection
            self.release_owner(session.owner)

    def release_owner(self, owner: str) -> None:
        """Frees every buffer and unnamed slice of a client or job, on every worker."""
        self.broadcast(cpb.ControllerToWorker(release=wpb.ReleaseBuffers(owner=owner)))
        self.dispatcher.forget_programs(self.registry.drop_owner(owner))
        try:
            self.slices.release_owner(owner)
        except ControllerError as e:
            log.warning("releasing the slices of %s: %s", owner, e)

    # ---- slice service listener ----
    def slice_changed(self, info: cpb.Slice) -> None:
        for s in self.sessions.values():
            s.send(cpb.SessionEvent(slice_changed=cpb.SliceChanged(slice=info)))
