"""The proxy's host buffer RPCs: `HostBufferStore`, `HostBufferLookup`, `HostBufferDelete`.

The bulk bytes of a session's uploads and downloads, beside its `IfrtSession` stream: each call
carries nothing but `{session_id, handle}` (and the bytes), bound to its session by the id.
They skip protobuf's copies: read and written as wire format (wire.py). A host buffer of
`STREAM_MIN_BYTES` or more streams on to its worker as it arrives (staging.py); a lookup streams
the bytes kept here (waited for while they arrive), or a download from the workers as the client
reads (downloads.py); its last message leaves with the call's status (served unary).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio

from .. import wire
from . import downloads
from . import protocol as proto_mod
from .backend import BackendError
from .handles import HandleError, HostData
from .staging import Staging

if TYPE_CHECKING:
    from .service import Session

log = logging.getLogger(__name__)

LOOKUP_CHUNK = 1 << 20  # HostBufferLookup streams in chunks of this many bytes
STREAM_MIN_BYTES = 4 << 20  # a host buffer this large streams on to its worker as it arrives (staging.py)
EMPTY = b""  # an empty message, serialized (GrpcHostBufferStoreResponse and DeleteResponse, an empty lookup chunk)

Message = Any  # a message class built at run time (protocol.py): no static type


class HostBufferRpcs:
    """The host buffer methods of `ProxyService` (service.py), which sets these attributes up."""

    p: Any  # the protocol's message classes (protocol.py)
    _sessions: dict[int, Session]

    async def _session_of(self, session_id: int, context: aio.ServicerContext) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no proxy session {session_id}")
        assert session is not None
        return session

    async def HostBufferStore(self, requests: AsyncIterator[bytes], context: aio.ServicerContext) -> bytes:
        raw = dict(context.invocation_metadata() or ()).get(proto_mod.HOST_BUFFER_METADATA_HEADER)
        meta = self.p.GrpcHostBufferStoreMetadata()
        try:
            meta.ParseFromString(raw if isinstance(raw, bytes) else b"")
        except Exception:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "undecodable host buffer metadata")
        if raw is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "HostBufferStore without its metadata header")
        session = await self._session_of(meta.session_id, context)
        staging: Staging | None = None
        stored = False
        try:
            session.buffers.reserve(meta.buffer_size)
            stage = getattr(session.backend, "stage", None)
            if stage is not None and meta.buffer_size >= STREAM_MIN_BYTES:
                staging = stage(meta.buffer_size)  # the bytes go on to the worker as they come
            # the chunks stay views of the bytes gRPC received (wire.py): no copy to parse or join
            chunks: list[bytes | memoryview] = []
            size = 0
            async for message in requests:
                try:
                    data = wire.data_field(message)
                except wire.WireError as e:
                    raise HandleError("INVALID_ARGUMENT", f"host buffer {meta.handle}: undecodable "
                                      f"GrpcHostBufferStoreRequest ({e})") from None
                size += len(data)
                if size > meta.buffer_size:
                    break
                if staging is not None:
                    await staging.write(data)
                else:
                    chunks.append(data)
            if size != meta.buffer_size:
                raise HandleError(
                    "INVALID_ARGUMENT", f"host buffer {meta.handle}: {meta.buffer_size} bytes announced, {size} sent"
                )
            session.buffers.store(meta.handle, staging if staging is not None else HostData(chunks))
            stored = True
        except (HandleError, BackendError) as e:
            log.info("proxy: session %x: HostBufferStore refused: %s", session.id, e)
            await context.abort(grpc.StatusCode[e.code], str(e))
        finally:
            if staging is not None and not stored:
                staging.discard()
        return EMPTY

    async def HostBufferLookup(self, request: Message, context: aio.ServicerContext) -> bytes:
        """The lookup's messages but its last written here, the last returned: gRPC sends it with
        the call's status (the method is served unary: service.py `generic_handler`)."""
        session = await self._session_of(request.session_id, context)
        try:
            data = await session.buffers.lookup_bytes(request.handle)
        except (HandleError, BackendError) as e:
            await context.abort(grpc.StatusCode[e.code], str(e))
        try:  # the bytes kept here, or a download from the workers as the client reads (downloads.py)
            return await downloads.write_lookup(context, data, LOOKUP_CHUNK, request.handle)
        except BackendError as e:
            log.info("proxy: session %x: lookup of host buffer %d failed: %s", session.id, request.handle, e)
            await context.abort(grpc.StatusCode[e.code], str(e))
            raise  # not reached: abort raises

    async def HostBufferDelete(self, request: Message, context: aio.ServicerContext) -> bytes:
        """Frees a host buffer of a live session (NOT_FOUND for a handle it does not hold). A
        session that is gone (or never was) holds nothing, so its delete answers OK: the jaxlib
        client deletes a download's host buffer after handing the bytes over, and a program that
        exits at once can end its session before that delete arrives; an error answer then is
        logged by the client during its exit, which crashes it (SIGSEGV/SIGABRT in jaxlib 0.10.2:
        17 of 20 exits when the answer came 0.1 s late, 0 of 20 with OK)."""
        session = self._sessions.get(request.session_id)
        if session is None:
            return EMPTY
        try:
            session.buffers.drop(request.handle)
        except HandleError as e:
            await context.abort(grpc.StatusCode[e.code], str(e))
        return EMPTY  # GrpcHostBufferDeleteResponse, serialized
