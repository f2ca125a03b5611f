"""`xla.ifrt.proxy.GrpcIfrtService` over grpc.aio: version negotiation, sessions, host buffers.

A session is one `IfrtSession` stream. Its metadata header carries the protocol version and the
initialization data the plugin (pwctl/proxy_plugin.py) filled: the cluster token and the slice.
The service answers `InitResponse` with an unguessable session id (64 random bits); the host
buffer RPCs (host_buffer_rpcs.py), which carry nothing but `{session_id, handle}`, are bound to
their session by it.

Requests are read in order and answered as they finish: a request that waits (CheckFuture,
CheckValueReady, a MakeArray whose bytes have not arrived) goes on in its own task, so later
requests are answered before it (requirement 4 in docs/facts.md); the per-call kinds of a
training loop (`INLINE`: Execute, DestructArray, a read's FullyReplicatedShard) run in the reader
until they wait, and most are answered without a task. One writer task owns the stream's writes
(answers.py); at most `MAX_PENDING` requests of a session wait at once, and reading stops while
that many answers are unwritten, so a client that never reads holds only its own session.

Device work goes through the `ClusterBackend` (backend.py): arrays in arrays.py, compiles and
executes in executables.py; request kinds this server does not
(yet) implement are answered with UNIMPLEMENTED naming the request, and the session goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc import aio

from ..rpcguard import write_or_cancel
from . import arrays, downloads, executables, reshard, shardings
from . import protocol as proto_mod
from .answers import AnswerWriter, Encoder
from .backend import BackendError, ClusterBackend, SessionBackend
from .handles import MAX_HANDLES, HandleError, HandleTable, HostBuffers, HostData
from .host_buffer_rpcs import HostBufferRpcs
from .layouts import default_layout
from .running import Runner

log = logging.getLogger(__name__)

MAX_PENDING = 4096  # requests of one session in flight at once
# how a session's stream ended, in its last log line
ENDED = "the client ended its stream (closed or cancelled it)"
CANCELLED = "its stream was cancelled (by the client, or the controller stopping)"
TOKEN_KEY, SLICE_KEY, DEVICES_KEY = "pathways.token", "pathways.slice", "pathways.devices"

Message = Any  # a message class built at run time (protocol.py): no static type
# Request kinds run in the session's reader up to their first wait (running.py): the per-call ones
# of a training loop (np.asarray's first: FullyReplicatedShard). Their handlers, where they wait,
# await only futures (no `asyncio.timeout`: it would bind the reader, not the task they go on in).
INLINE = frozenset({"loaded_executable_execute_request", "destruct_array_request", "delete_array_request",
                    "fully_replicated_shard_request"})
# Request kinds whose handlers return their answer's body serialized and never fill `resp`
# (they are given None: no IfrtResponse made per call)
BODIES = frozenset({"loaded_executable_execute_request", "destruct_array_request"})
Handler = Callable[["Session", Message, Message], Awaitable[bytes | None]]


class RequestError(Exception):
    """The answer to one request is an error with this gRPC status code name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Session:
    id: int
    version: int
    backend: SessionBackend
    encoder: Encoder  # pre-serialized answer parts (answers.py)
    handles: HandleTable = field(default_factory=HandleTable)
    buffers: HostBuffers = field(default_factory=HostBuffers)
    submitted: asyncio.Lock = field(default_factory=asyncio.Lock)  # executes reach the cluster in order
    functions: dict[Any, tuple[str, bytes]] = field(default_factory=dict)  # server-made functions (compose.py)
    fetches: dict[int, asyncio.Future[bytes | HostData]] = field(default_factory=dict)  # downloads under way, by buffer
    gathers: dict[int, downloads.SharedCopy] = field(default_factory=dict)  # streamed downloads' shared copies
    place: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # its caller's place, until it ends


def _attributes(attr_map: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in attr_map.attributes.items():
        kind = value.WhichOneof("value")
        out[key] = getattr(value, kind) if kind else None
    return out


def _handles(req: Message, fields: Mapping[str, Sequence[str]], kind: str | None = None) -> list[int]:
    """The handles in the request's `fields[kind]` (arrays.USED_HANDLES, RESULT_HANDLES);
    RequestError for a list of more than `MAX_HANDLES`, before any is looked at."""
    kind = kind if kind is not None else req.WhichOneof("request") or ""
    sub = getattr(req, kind, None)
    out: list[int] = []
    for name in fields.get(kind, ()):
        value = getattr(sub, name, 0)
        if isinstance(value, int):
            out.append(value)
            continue
        if len(value) > MAX_HANDLES:
            raise RequestError("INVALID_ARGUMENT", f"{kind}.{name}: {len(value)} entries, at most {MAX_HANDLES}")
        out.extend(value)
    return out


def _slice_request(init: dict[str, Any]) -> tuple[str | None, int | None]:
    """The slice name and device count a session's initialization data asks for: a UTF-8 name
    and a positive count, as the plugin sends them (else RequestError)."""
    name, devices = init.get(SLICE_KEY), init.get(DEVICES_KEY)
    try:
        text = name.decode() if isinstance(name, bytes) else None
    except UnicodeDecodeError:
        text = None
    if name is not None and text is None:
        raise RequestError("INVALID_ARGUMENT", f"{SLICE_KEY} must be a slice name in UTF-8")
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or not 0 < devices < 2**31):
        raise RequestError("INVALID_ARGUMENT", f"{DEVICES_KEY}={devices!r}: expected a positive number of devices")
    return text or None, devices


Admit = Callable[[str], AbstractContextManager[None]]  # the caller's peer -> its place (BackendError: none left)


class ProxyService(HostBufferRpcs):
    """The servicer. `token`: the cluster token sessions must present (None: no check).
    `max_sessions`: proxy sessions open at once; `admit`: holds a place among its caller's
    sessions for a session's life (the controller's per-caller cap, shared with `pw` sessions)."""

    def __init__(self, cluster: ClusterBackend, token: str | None = None, max_sessions: int = 1024,
                 admit: Admit | None = None) -> None:
        self.p = proto_mod.protocol()  # ~0.3 s the first time: see routing.LazyProxyHandler
        self._cluster = cluster
        self._token = token.encode() if token else None
        self._max_sessions = max_sessions
        self._admit = admit
        self._sessions: dict[int, Session] = {}
        self._closing: set[asyncio.Future[None]] = set()  # sessions' closes under way (IfrtSession)
        self._request = self.p.IfrtRequest.FromString
        self._response = self.p.IfrtResponse
        self._encoder = Encoder(self.p)
        self._handlers: dict[str, Handler] = {
            "init_request": self._init,
            "get_default_layout_request": self._default_layout,
            "check_future_request": self._check_future,
        }
        for kind, handler in {**arrays.HANDLERS, **downloads.HANDLERS, **reshard.HANDLERS,
                              **executables.HANDLERS}.items():
            self._handlers[kind] = functools.partial(handler, proto=self.p)

    @property
    def sessions(self) -> dict[int, Session]:
        return self._sessions

    def generic_handler(self) -> grpc.GenericRpcHandler:
        p = self.p

        def ser(m: Message) -> bytes:
            return bytes(m.SerializeToString())

        return grpc.method_handlers_generic_handler(
            proto_mod.SERVICE_NAME,
            {
                "GetVersion": grpc.unary_unary_rpc_method_handler(
                    self.GetVersion, p.GrpcGetVersionRequest.FromString, ser
                ),
                # requests arrive as bytes and are parsed in IfrtSession: grpc would end the stream
                # silently, with OK, on an undecodable one
                # and answered as bytes: the handler serializes them (answers.py)
                "IfrtSession": grpc.stream_stream_rpc_method_handler(self.IfrtSession, None, None),
                # the bulk bytes skip protobuf's copies: read and written as wire format (wire.py)
                "HostBufferStore": grpc.stream_unary_rpc_method_handler(self.HostBufferStore, None, None),
                # the client reads a stream; served unary, the lookup's last message (a small read's
                # only one) leaves with the call's status in one batch: one write fewer (downloads.py)
                "HostBufferLookup": grpc.unary_unary_rpc_method_handler(
                    self.HostBufferLookup, p.GrpcHostBufferLookupRequest.FromString, None
                ),
                "HostBufferDelete": grpc.unary_unary_rpc_method_handler(
                    self.HostBufferDelete, p.GrpcHostBufferDeleteRequest.FromString, None
                ),
            },
        )

    # -- unary RPCs ---------------------------------------------------------------------------

    async def GetVersion(self, request: Message, context: aio.ServicerContext) -> Message:
        lo, hi = request.min_version, request.max_version
        try:
            v = proto_mod.negotiate(
                proto_mod.Version(lo.protocol_version, lo.ifrt_serdes_version_number),
                proto_mod.Version(hi.protocol_version, hi.ifrt_serdes_version_number),
            )
        except proto_mod.ProtocolError as e:
            log.info("proxy: refused client %s: %s", context.peer(), e)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        resp = self.p.GrpcGetVersionResponse()
        resp.version.protocol_version = v.protocol_version
        resp.version.ifrt_serdes_version_number = v.serdes_version
        return resp

    # -- the session stream -------------------------------------------------------------------

    async def _open(self, context: aio.ServicerContext) -> Session:
        """The session the stream's metadata asks for; RequestError when it is refused."""
        raw = dict(context.invocation_metadata() or ()).get(proto_mod.SESSION_METADATA_HEADER)
        if not isinstance(raw, bytes):
            raise RequestError("INVALID_ARGUMENT", f"IfrtSession without {proto_mod.SESSION_METADATA_HEADER}")
        meta = self.p.GrpcIfrtSessionMetadata()
        try:
            meta.ParseFromString(raw)
        except Exception:  # DecodeError, or whatever the C extension raises for garbage
            raise RequestError("INVALID_ARGUMENT", "undecodable IfrtSession metadata") from None
        version = meta.version.protocol_version
        if not proto_mod.MIN_PROTOCOL_VERSION <= version <= proto_mod.MAX_PROTOCOL_VERSION:
            raise RequestError(
                "FAILED_PRECONDITION",
                f"IFRT proxy protocol version {version} is not one this server speaks "
                f"({proto_mod.MIN_PROTOCOL_VERSION}-{proto_mod.MAX_PROTOCOL_VERSION})",
            )
        init = _attributes(meta.initialization_data)
        if self._token is not None:
            given = init.get(TOKEN_KEY)
            if not isinstance(given, bytes) or not hmac.compare_digest(given, self._token):
                raise RequestError(
                    "UNAUTHENTICATED",
                    "missing or wrong cluster token: set PWCTL_TOKEN (or run where `pwctl` finds the token)",
                )
        if len(self._sessions) >= self._max_sessions:
            raise RequestError("RESOURCE_EXHAUSTED", f"{len(self._sessions)} IFRT proxy sessions are open, the "
                               "controller's limit (--max-sessions): retry when one ends")
        slice_name, devices = _slice_request(init)
        place = contextlib.ExitStack()
        try:
            if self._admit is not None:
                place.enter_context(self._admit(context.peer()))
            backend = await self._cluster.open_session(slice_name, devices)
        except BackendError as e:
            place.close()
            raise RequestError(e.code, str(e)) from None
        except BaseException:
            place.close()
            raise
        session_id = secrets.randbits(64) or 1
        while session_id in self._sessions:
            session_id = secrets.randbits(64) or 1
        session = Session(id=session_id, version=version, backend=backend, encoder=self._encoder, place=place)
        self._sessions[session_id] = session
        log.info(
            "proxy: session %x opened for %s on %d devices", session_id, context.peer(), len(backend.slice.devices)
        )
        return session

    async def IfrtSession(self, requests: AsyncIterator[bytes], context: aio.ServicerContext) -> None:
        """The session stream, through grpc.aio's reader/writer API (`context.read`/`write`: no
        generator hop per message either way); `requests` is unused. The reader runs each
        request as it is read (running.py); one writer task writes the answers (answers.py)."""
        try:
            session = await self._open(context)
        except RequestError as e:
            # Refused sessions answer their requests (the client's Init first) with the error:
            # the jaxlib client shows an error answer to the user, whereas a failed stream only
            # makes it reconnect until its connection timeout and then report CANCELLED.
            log.info("proxy: session from %s refused: %s", context.peer(), e)
            while (raw := await context.read()) is not aio.EOF:
                req = self._parse(raw)
                if req is None:
                    break
                await write_or_cancel(context, self._error(req.request_metadata.op_id, e.code, str(e)))
            return
        out = AnswerWriter(context.write, MAX_PENDING)
        runner = Runner(out, session.handles.unclaim)
        reader = asyncio.current_task()
        writer = asyncio.create_task(out.run())

        ending = False  # the stream is over and the session closing: a cancel would cut `_close` short
        def writer_done(task: asyncio.Task[None]) -> None:  # the stream is broken: nothing more is answered
            if not task.cancelled() and task.exception() is not None and not ending and reader is not None:
                reader.cancel()

        writer.add_done_callback(writer_done)
        undecodable = False
        # how the stream ended, for the log (jaxlib's client ends it as it exits, or, with requests
        # unanswered, after a call of its own failed); grpc.aio's reader sees a client's cancel as
        # the stream's end or as this task's cancellation, and `context.cancelled()` tells neither
        why = CANCELLED
        try:
            while (raw := await context.read()) is not aio.EOF:
                req = self._parse(raw)
                if req is None:
                    undecodable = True
                    break
                kind = req.WhichOneof("request") or ""
                try:
                    used = _handles(req, arrays.USED_HANDLES, kind)
                except RequestError as e:  # a list too long to look at: refused as it is read
                    out.put(self._error(req.request_metadata.op_id, e.code, str(e)))
                else:
                    session.handles.claim(used)  # here, in request order: see handles.py
                    runner.start(self._answer(session, req, kind), used, kind in INLINE)
                if len(runner.pending) >= MAX_PENDING:
                    await asyncio.wait(runner.pending, return_when=asyncio.FIRST_COMPLETED)
                if out.full:
                    await out.room()
            why = "undecodable request" if undecodable else ENDED
            why += f", {len(runner.pending)} requests unanswered then" if runner.pending else ""
            if runner.pending:
                await asyncio.gather(*runner.pending, return_exceptions=True)
            out.close()
            await writer
            if undecodable:
                log.info("proxy: session %x: undecodable request; the session ends", session.id)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "undecodable IfrtRequest: the session ends")
        except asyncio.CancelledError:
            if why == CANCELLED:  # while reading (else the stream had ended: said already)
                if writer.done() and not writer.cancelled() and writer.exception() is not None:
                    why = "its answers could not be written (the client gone)"
                why += f", {len(runner.pending)} requests unanswered" if runner.pending else ""
            raise
        finally:
            ending = True  # writer_done may be scheduled already (a failed write as the caller was killed)
            writer.remove_done_callback(writer_done)
            writer.cancel()
            runner.cancel()
            # in a task of its own, not awaited: the client's leaving cancels this handler, also
            # once here, which cut an awaited close short (issue 28: 3 of 5 sessions of exited
            # clients never closed their cluster sessions nor logged their end); a wait here would
            # also be one more point for grpc.aio's cancellations to land after it handled one
            closing = asyncio.ensure_future(self._close(session, why))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    async def closed(self, timeout: float) -> bool:
        """Waits, at most `timeout` s, until no session is open or closing: at the controller's
        stop, once its server stopped (which cancelled every stream left, so each session's close
        is under way or about to start), before the database and the worker links close under the
        closes. False (and a warning) when some were still open or closing then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._sessions or self._closing:
            left = deadline - loop.time()
            if left <= 0:
                log.warning("proxy: %d sessions still open and %d closing after %g s of the controller's stop",
                            len(self._sessions), len(self._closing), timeout)
                return False
            if self._closing:
                await asyncio.wait(set(self._closing), timeout=left)
            else:  # a stream's cancellation not yet delivered to its handler
                await asyncio.sleep(min(0.01, left))
        return True

    def _parse(self, raw: bytes) -> Message | None:
        try:
            return self._request(raw)
        except Exception:  # DecodeError, or whatever the C extension raises for garbage
            return None

    async def _close(self, session: Session, why: str) -> None:
        """Ends `session`; `why` (how its stream ended) goes in the log's one line. In a task of
        its own (IfrtSession), so nothing the client does cuts it short."""
        self._sessions.pop(session.id, None)
        session.place.close()  # the stream is over: its caller's place is free
        session.buffers.clear()
        try:
            await session.backend.close()
        except BackendError as e:
            log.warning("proxy: session %x: closing its cluster session failed: %s", session.id, e)
        except Exception:  # a bug: said here, as nothing awaits this task
            log.exception("proxy: session %x: closing its cluster session failed", session.id)
        log.info("proxy: session %x closed: %s", session.id, why)

    async def _answer(self, session: Session, req: Message, kind: str) -> bytes:
        """The serialized answer to `req`. A handler fills `resp`, or returns the answer's body
        already serialized (answers.py: the response field of its kind)."""
        op_id = req.request_metadata.op_id
        resp = None if kind in BODIES else self._response()
        handler = self._handlers.get(kind)
        try:
            if handler is None:
                raise RequestError("UNIMPLEMENTED", "the Pathways IFRT proxy server does not support "
                                   f"{kind or 'a request without a kind'} yet")
            body = await handler(session, req, resp)
        except (RequestError, HandleError, BackendError) as e:
            return self._failed(session, req, kind, e.code, str(e))
        except Exception as e:  # a bug: loud in the log; the client still gets its answer
            log.exception("proxy: session %x: %s failed", session.id, kind)
            return self._failed(session, req, kind, "INTERNAL",
                                f"{kind} failed in the Pathways IFRT proxy server (a bug): {e}")
        if body is not None:
            return session.encoder.metadata(op_id) + body
        if resp is None:
            resp = self._response()
        resp.response_metadata.op_id = op_id
        return bytes(resp.SerializeToString())

    def _failed(self, session: Session, req: Message, kind: str, code: str, message: str) -> bytes:
        """The error answer to a request that failed; its result handles are marked failed too
        (requirement 7 in docs/facts.md: later uses report this error)."""
        try:
            results = _handles(req, arrays.RESULT_HANDLES, kind)
        except RequestError:  # too many to mark: the error says so
            results = []
        session.handles.fail(results, code, message)
        return self._error(req.request_metadata.op_id, code, message)

    def _error(self, op_id: int, code: str, message: str) -> bytes:
        """A serialized error answer to request `op_id`."""
        resp = self._response()
        resp.response_metadata.op_id = op_id
        resp.response_metadata.status.code = grpc.StatusCode[code].value[0]
        resp.response_metadata.status.message = message
        return bytes(resp.SerializeToString())

    # -- requests -----------------------------------------------------------------------------

    async def _init(self, session: Session, req: Message, resp: Message) -> None:
        info = session.backend.slice
        r = resp.init_response
        r.session_id = session.id
        r.platform_name = info.platform_name
        r.platform_version = info.platform_version
        r.platform_id = info.platform_id
        r.process_index = 0
        r.runtime_type = "pathways-proxy"
        for i, dev in enumerate(info.devices):
            d = r.all_devices.add()
            d.id = dev.id
            d.local_device_id = i
            d.local_hardware_id = i
            d.platform_name = info.platform_name
            d.device_kind = dev.kind
            d.default_memory_id = dev.id
            d.memory_ids.append(dev.id)
            d.debug_string = d.to_string = f"{info.platform_name.capitalize()}Device(id={dev.id})"  # as JAX names them
            for key, value in dev.attributes.items():
                attr = d.attributes.attributes[key]
                if isinstance(value, int):
                    attr.int64_value = value
                else:
                    attr.string_value = value.encode()
            r.addressable_device_ids.append(dev.id)
            r.primary_device_ids.append(dev.id)
            m = r.memories.add()
            m.id = dev.id
            m.memory_space_kind = "device"
            m.device_ids.append(dev.id)
            m.debug_string = m.to_string = f"MEMORY_SPACE_{dev.id}"

    async def _default_layout(self, session: Session, req: Message, resp: Message) -> None:
        dims = shardings.shape_of(req.get_default_layout_request.dims, "a layout")
        resp.get_default_layout_response.serialized_pjrt_layout = default_layout(len(dims))

    async def _check_future(self, session: Session, req: Message, resp: Message) -> None:
        handle = req.check_future_request.future_handle
        # the op's own error, NOT_FOUND, or INVALID_ARGUMENT for a handle that is no future (an array)
        future = session.handles.get(handle, asyncio.Future)
        session.handles.pop(handle)
        await future
        resp.check_future_response.SetInParent()
