"""Client sessions: one long-lived stream per client process (or job driver).

The stream carries registrations, runs and releases from the client (often coalesced
into one batch message) and run failures, the count of finished runs (the client's bound on
runs in flight) and slice changes back. When the stream ends,
everything the client owned goes: its waiting runs, its buffers on every worker, the
slices it made without a name.

Except when the controller goes: a session outlives a controller restart (session_store.py). A
stopping controller tells its clients `going_away` and keeps what they own; the next one keeps
the sessions it finds in the database for `grace_s`, and a client that comes back within it
resumes its session (same client id and id prefix, its slices and buffers), registers its
programs again and goes on. What nobody resumed is released when the grace period ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from grpc import aio

from pwctl.limits import DISPATCH_MODES, share_problem
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from ..credentials import JOB_SECRET_ENV, PREFIX_SHIFT, check_job_secret, session_credential
from ..invariants import InvariantError
from ..scheduler import Batch, CancelRun, Submit
from .callers import CallerSessions, caller_of
from .client_session import ClientSession, RunRequest
from .dispatch import Dispatcher
from .errors import ControllerError, GroupForming, InvalidArgument, PermissionDenied
from .limits import DEFAULT_MAX_SESSIONS_PER_CALLER, shown
from .programs import ProgramRecord, ProgramRegistry, check_devices, program_id_of
from .session_store import DEFAULT_GRACE_S, Resumable, SessionStore, new_token, token_hash

if TYPE_CHECKING:
    from .host_info import HostInfo
    from .slices import Placement

log = logging.getLogger(__name__)

MAX_CANCEL_REASON = 1000  # characters of a client's reason for cancelling a run kept (the run's error)

MAX_PREFIXES_REMEMBERED = 1 << 16  # prefixes handed out that new sessions avoid (beyond: the live ones)


class Slices(Protocol):
    """What sessions need of the slice service: `epoch` changes whenever any slice does, or
    an island group's usability."""

    epoch: int

    def placement(self, name: str) -> Placement:
        """Where slice `name` runs; raises a ControllerError naming the slice when it cannot."""
        ...

    def release_owner(self, owner: str) -> None: ...

    async def settled(self, name: str) -> Placement:
        """`placement(name)`, waiting (bounded: the controller's --group-wait) while the slice's
        island group forms; raises like `placement` after that."""
        ...


@dataclass(frozen=True)
class Waiting:
    """A session's messages from one that found slice `slice`'s island group forming: they are
    handled again, in order, once the group formed or the wait ran out (`SessionManager._take`)."""

    slice: str
    rest: list[cpb.ClientMessage]


ProgramListener = Callable[[ClientSession, ProgramRecord], None]


class SessionManager:
    """Serves the session streams; turns their messages into dispatcher calls.

    Collaborators: the dispatcher (runs, releases, flushes), the program registry, the slices
    (placement checks at registration, releasing a gone owner's slices) and `broadcast`, which
    sends one message to every ready worker. `program_listeners` hear every registration.
    """

    def __init__(self, dispatcher: Dispatcher, registry: ProgramRegistry, slices: Slices,
                 broadcast: Callable[[cpb.ControllerToWorker], None], default_dispatch: str = "parallel",
                 worker_key: bytes = b"", store: SessionStore | None = None,
                 grace_s: float = DEFAULT_GRACE_S, job_key: bytes = b"",
                 max_per_caller: int = DEFAULT_MAX_SESSIONS_PER_CALLER) -> None:
        self.dispatcher = dispatcher
        self.registry = registry
        self.slices = slices
        self.broadcast = broadcast
        self.default_dispatch = default_dispatch
        self.store = store  # None: sessions do not outlive the controller
        self.grace_s = grace_s
        self.program_listeners: list[ProgramListener] = []
        self.sessions: dict[str, ClientSession] = {}
        self.worker_key = worker_key or secrets.token_bytes(32)
        self.job_key = job_key or secrets.token_bytes(32)  # job secrets (server/credentials.py)
        self.callers = CallerSessions(max_per_caller)
        self._prefixes_used: set[int] = set()
        self.resumable: dict[str, Resumable] = {}  # sessions of the previous controller, not resumed yet
        self.going_away = False

    def new_id_prefix(self) -> int:
        """A random buffer-id prefix no other client of this controller held, nor a resumable
        session of the previous one (ids are `prefix << 40 | n`): not the next of a sequence, so no
        session can guess another's ids. Workers serve a session only the ids under its prefix
        (server/credentials.py)."""
        if len(self._prefixes_used) >= MAX_PREFIXES_REMEMBERED:  # bounded: then only live ones count
            self._prefixes_used = {s.id_prefix for s in self.sessions.values()}
        taken = {r.id_prefix for r in self.resumable.values()}
        while True:
            # below 2**23: ids stay under 2**63 (traces and the database keep them as signed 64-bit)
            prefix = secrets.randbelow((1 << 23) - 1) + 1
            if prefix not in self._prefixes_used and prefix not in taken:
                self._prefixes_used.add(prefix)
                return prefix

    def credential(self, owner: str, prefix: int) -> str:
        """The session credential workers check (server/credentials.py)."""
        return session_credential(self.worker_key, owner, prefix)

    # ---- sessions of the previous controller ----
    def load(self) -> set[str]:
        """Reads the sessions a previous controller left (at start, before any session opens);
        returns their owners, whose slices stay for the grace period."""
        if self.store is None:
            return set()
        self.resumable = self.store.load()
        self._prefixes_used |= {r.id_prefix for r in self.resumable.values()}
        if self.resumable:
            log.info("%d client session(s) of the previous controller may resume within %g s",
                     len(self.resumable), self.grace_s)
        return {r.owner for r in self.resumable.values()}

    async def expire_resumable(self) -> None:
        """After the grace period: releases what the sessions nobody resumed owned."""
        await asyncio.sleep(self.grace_s)
        gone = list(self.resumable.values())
        self.resumable.clear()
        for rec in gone:
            log.info("session %s (%s) did not resume within %g s: releasing what it owned", rec.client_id,
                     rec.name, self.grace_s)
            if not rec.job_id:  # a job's resources go when the job ends
                self.release_owner(rec.owner)
        if gone and self.store is not None:
            self.store.closed([r.client_id for r in gone])

    async def serve(
        self, request_iterator: AsyncIterator[cpb.ClientMessage], context: aio.ServicerContext | None
    ) -> AsyncIterator[cpb.SessionEvent]:
        """Serves one session stream. `context`: the call's (its peer names the caller, callers.py);
        None in-process (tests: one caller)."""
        it = aiter(request_iterator)
        first = await anext(it, None)
        if first is not None and first.WhichOneof("msg") == "batch" and first.batch.messages:
            rest = list(first.batch.messages[1:])
            first = first.batch.messages[0]
        else:
            rest = []
        # refusals before the welcome are typed (INVALID_ARGUMENT), as a client's other usage errors
        if first is None or first.WhichOneof("msg") != "hello":
            raise InvalidArgument("a session starts with a hello message")
        hello = first.hello
        dispatch = hello.dispatch or self.default_dispatch
        if dispatch not in DISPATCH_MODES:
            raise InvalidArgument(f"unknown dispatch mode {shown(dispatch)!r}: use parallel or sequential")
        problem = share_problem("session", hello.priority, hello.weight)  # a job's range, which its driver's gets
        if problem:
            raise InvalidArgument(problem)
        if hello.job_id and not check_job_secret(self.job_key, hello.job_id, hello.job_secret):
            raise PermissionDenied(
                f"this session cannot act as job {shown(hello.job_id)!r}: only the job's driver can, with the "
                f"secret the controller gave it (${JOB_SECRET_ENV})")
        with self.callers.enter(caller_of(context.peer() if context is not None else "", hello.job_id)):
            async with contextlib.aclosing(self._open(hello, dispatch, rest, it)) as events:  # its finally runs now
                async for ev in events:
                    yield ev

    async def _open(self, hello: cpb.Hello, dispatch: str, rest: list[cpb.ClientMessage],
                    it: AsyncIterator[cpb.ClientMessage]) -> AsyncGenerator[cpb.SessionEvent, None]:
        """Opens (or resumes) the session `hello` asks for and serves it until it ends."""
        token = hello.resume_token
        if hello.resume_client_id:
            rec = self.resumable.get(hello.resume_client_id)
            if rec is None or not rec.accepts(token) or rec.job_id != hello.job_id:
                yield cpb.SessionEvent(error=(
                    f"cannot resume session {hello.resume_client_id}: this controller does not know it (it "
                    f"ended, or did not come back within the {self.grace_s:g} s grace period after a restart)"))
                return
            del self.resumable[rec.client_id]
            client_id, prefix = rec.client_id, rec.id_prefix
        else:
            client_id, prefix, token = f"c{secrets.token_hex(6)}", self.new_id_prefix(), new_token()
            if self.store is not None:
                rec = Resumable(client_id, prefix, token_hash(token), hello.job_id, hello.client_name)
                try:
                    await asyncio.wrap_future(self.store.opened(rec))  # resumable once the client knows the token
                except Exception as e:
                    log.warning("session %s will not outlive the controller: %s", client_id, e)
        session = ClientSession(
            client_id=client_id,
            id_prefix=prefix,
            name=hello.client_name,
            job_id=hello.job_id,
            priority=hello.priority,
            weight=hello.weight if hello.weight > 0 else 1.0,
            sequential=dispatch == "sequential",
            ack_releases=hello.ack_releases,
        )
        self.sessions[session.client_id] = session
        resumed = bool(hello.resume_client_id)
        log.info("session %s %s (%s%s)", session.client_id, "resumed" if resumed else "opened", session.name,
                 f", job {session.job_id}" if session.job_id else "")
        yield cpb.SessionEvent(welcome=cpb.Welcome(
            client_id=session.client_id, id_prefix=session.id_prefix,
            worker_credential=self.credential(session.owner, session.id_prefix),
            resume_token=token, resumed=resumed, acks_releases=hello.ack_releases, checks_generations=True))
        gave_up: dict[str, tuple[int, str]] = {}
        for msg in rest:
            await self._take(session, msg, gave_up)
        self.dispatcher.flush()
        reader = asyncio.get_running_loop().create_task(self._read(session, it, gave_up))
        try:
            while True:
                ev = await session.queue.get()
                if ev is None:
                    break
                yield ev
        finally:
            reader.cancel()
            self.close(session)

    async def _read(self, session: ClientSession, it: AsyncIterator[cpb.ClientMessage],
                    gave_up: dict[str, tuple[int, str]]) -> None:
        try:
            async for msg in it:
                await self._take(session, msg, gave_up)
        except (aio.AioRpcError, aio.UsageError, asyncio.CancelledError):
            pass
        except InvariantError as e:  # a bug: loud in the log, and the client's session ends with it
            log.error("InvariantError in session %s: %s", session.client_id, e)
            session.send(cpb.SessionEvent(error=f"internal error (a bug): {e.problem}"))
        except Exception:
            log.exception("session %s failed", session.client_id)
        finally:
            session.queue.put_nowait(None)

    async def _take(self, session: ClientSession, msg: cpb.ClientMessage,
                    gave_up: dict[str, tuple[int, str]]) -> None:
        """Handles one message of the session's stream. A run or a registration on a slice whose
        island group is forming (at start, after a host joined or was lost, after a remap) waits
        for the group, bounded by the controller's --group-wait, and is then handled again, or
        refused naming why the group is still not usable. The session's later messages wait
        behind it, so its runs keep their order. `gave_up`: the session's slices whose wait ran
        out, with the slices' epoch then and the error: while nothing changed since, the next
        messages on them (which waited behind) are refused at once rather than waiting again."""
        waiting = self.handle(session, msg)
        while waiting is not None:
            self.dispatcher.flush()  # what came before the waiting message goes now
            name = waiting.slice
            if gave_up.get(name, (None, ""))[0] != self.slices.epoch:
                try:
                    await self.slices.settled(name)
                except GroupForming as e:
                    gave_up[name] = (self.slices.epoch, str(e))
                except ControllerError:
                    pass  # handled again without waiting: refused, naming why
            given_up = gave_up.get(name)
            if given_up is not None and given_up[0] == self.slices.epoch:
                self._refuse(session, waiting.rest[0], given_up[1])
                waiting = self._handle_list(session, waiting.rest[1:], patient=True)
            else:
                waiting = self._handle_list(session, waiting.rest, patient=False)
        self.dispatcher.flush()

    def _refuse(self, session: ClientSession, msg: cpb.ClientMessage, why: str) -> None:
        """Refuses a run or a registration (the messages that wait for a group) with `why`."""
        if msg.WhichOneof("msg") == "run":
            self.dispatcher.refuse(session, msg.run.run_id, why, msg.run.output_ids)
            session.last_run = msg.run.run_id
        else:
            session.send(cpb.SessionEvent(registered=cpb.ProgramRegistered(request_id=msg.register.request_id,
                                                                           error=why)))

    def handle(self, session: ClientSession, msg: cpb.ClientMessage, patient: bool = True) -> Waiting | None:
        """Handles one message; a Waiting when it (with `patient`) found its slice's island
        group forming, holding it and the messages after it (nothing of them done yet)."""
        kind = msg.WhichOneof("msg")
        if kind == "batch":  # the runs of a batch go to the scheduler in one pass
            return self._handle_list(session, list(msg.batch.messages), patient)
        elif kind == "run":
            try:
                self.run(session, msg.run, wait=patient)
            except GroupForming as e:
                return Waiting(e.slice, [msg])
        elif kind == "release":
            self.release(session, msg.release.address, msg.release.buffer_ids)
        elif kind == "register":
            try:
                registered = self._register(session, msg.register, wait=patient)
            except GroupForming as e:
                return Waiting(e.slice, [msg])
            session.send(cpb.SessionEvent(registered=registered))
        elif kind == "cancel_run":
            cancel = msg.cancel_run
            if cancel.run_id >> PREFIX_SHIFT == session.id_prefix:  # its own runs only
                self.dispatcher.handle(CancelRun(session.client_id, cancel.run_id,
                                                 cancel.reason[:MAX_CANCEL_REASON] or "cancelled by the client",
                                                 time.monotonic()))
        return None

    def _handle_list(self, session: ClientSession, messages: list[cpb.ClientMessage],
                     patient: bool) -> Waiting | None:
        """A batch's messages, its runs collected for one scheduler pass (those before a
        cancel_run go to the scheduler before it: it may name one); `patient` for the first
        (False: it waited already), the others always."""
        submits: list[Submit] = []
        for k, m in enumerate(messages):
            now_patient = patient or k > 0
            if m.WhichOneof("msg") == "run":
                try:
                    self.run(session, m.run, submits, wait=now_patient)
                except GroupForming as e:
                    self.submit_batch(submits)
                    return Waiting(e.slice, messages[k:])
            else:
                if submits and m.WhichOneof("msg") == "cancel_run":  # it may name one of them
                    self.submit_batch(submits)
                    submits = []
                waiting = self.handle(session, m, now_patient)
                if waiting is not None:
                    self.submit_batch(submits)
                    return Waiting(waiting.slice, waiting.rest + messages[k + 1:])
        self.submit_batch(submits)
        return None

    def run(self, session: ClientSession, run: RunRequest, batch: list[Submit] | None = None,
            wait: bool = False, prompt: bool = False) -> None:
        """A `run` message of the session (also the IFRT proxy's way in, a `LocalRun`, without the
        ClientMessage). With `batch`, its Submit is collected there for one scheduler pass
        (`submit_batch`); with `wait`, a slice whose island group is forming raises GroupForming
        (Dispatcher.submit); with `prompt`, its workers report its end at once (the caller will
        wait for it: `ClientSession.when_over`)."""
        if self._own_ids(session, run):
            self.dispatcher.submit(session, run, batch, wait=wait, prompt=prompt)
        session.last_run = run.run_id  # handled, not waiting for its group: told with RunsDone

    def submit_batch(self, submits: list[Submit]) -> None:
        """Hands the Submits collected by `run(..., batch)` to the scheduler in one pass."""
        if submits:
            self.dispatcher.handle(Batch(tuple(submits), submits[-1].now))

    def release(self, session: ClientSession, address: str, buffer_ids: Iterable[int]) -> None:
        """A `release` message of the session: frees its buffers on the worker at `address`
        once the session's earlier runs that may read them are over (client_session.py)."""
        # only the session's own ids: another session's buffers are not its to free
        mine = [b for b in buffer_ids if b >> PREFIX_SHIFT == session.id_prefix]
        if session.never_computed:  # no later run may read them: nothing to remember
            for b in mine:
                session.never_computed.pop(b, None)
        for where, ids in session.hold_release(address, mine):
            self.dispatcher.release(where, ids, session.owner)
            self.dispatcher.release_acks.released(session, where)

    def _own_ids(self, session: ClientSession, run: RunRequest) -> bool:
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

    def _register(self, session: ClientSession, req: cpb.RegisterProgram, wait: bool = False) -> cpb.ProgramRegistered:
        """Registers a program, or answers why not. With `wait`, a slice whose island group is
        forming raises GroupForming instead (the caller waits for the group and asks again)."""
        reg = self.registry
        try:
            missing = reg.add_functions(list(req.functions))
            if missing:
                return cpb.ProgramRegistered(request_id=req.request_id, missing_functions=missing)
            placements = {name: self.slices.placement(name)  # fails early, naming the slice
                          for name in sorted({n.slice for n in req.graph.nodes})}
            check_devices(req.graph, {name: (len(p.local_devices), p.gang is not None)
                                      for name, p in placements.items()})
            rec = reg.register(req.graph, session.owner)
        except ControllerError as e:
            if wait and isinstance(e, GroupForming):
                raise
            session.program_refused(program_id_of(req.graph), str(e))
            return cpb.ProgramRegistered(request_id=req.request_id, error=str(e))
        session.refused_programs.pop(rec.program_id, None)
        for listener in self.program_listeners:
            listener(session, rec)
        return cpb.ProgramRegistered(request_id=req.request_id, program_id=rec.program_id)

    def end_all(self, reason: str) -> None:
        """Tells every client why its stream ends and ends the streams (the controller is
        shutting down). With a store, what the sessions own stays for the next controller, and
        clients hear `going_away` (they resume there); without, the sessions end with `reason`."""
        self.going_away = self.store is not None
        for session in list(self.sessions.values()):
            ev = cpb.SessionEvent(going_away=reason) if self.going_away else cpb.SessionEvent(error=reason)
            session.queue.put_nowait(ev)
            session.queue.put_nowait(None)

    def close(self, session: ClientSession) -> None:
        if self.sessions.pop(session.client_id, None) is None:
            return
        self.dispatcher.client_gone(session.client_id)
        self.dispatcher.release_acks.forget(session)
        if self.going_away:  # the session resumes at the next controller
            log.info("session %s left for the next controller", session.client_id)
            return
        log.info("session %s closed", session.client_id)
        if self.store is not None:
            self.store.closed([session.client_id])
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

    def host_lost(self, info: HostInfo, reason: str) -> None:
        """(the cluster's listener) Tells every session that a host was lost: a call its client
        waits on at that host's worker ends now (a frozen host keeps its connections open)."""
        ev = cpb.SessionEvent(host_lost=cpb.HostLost(name=info.name, address=info.address, reason=reason))
        for s in self.sessions.values():
            s.send(ev)

    # ---- slice service listener ----
    def slice_changed(self, info: cpb.Slice) -> None:
        for s in self.sessions.values():
            s.send(cpb.SessionEvent(slice_changed=cpb.SliceChanged(slice=info)))
