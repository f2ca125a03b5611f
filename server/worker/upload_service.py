"""The worker's upload handlers (`PutBuffers`, `Uploads`): a session's arrays, one per message or
in pieces (uploads.py), or its part of an array sharded over several members of its island
group (parts.py `uploaded_part`); held by `WorkerServicer` (servicer.py) as a mixin."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import jax
import numpy as np
from grpc import aio

from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

from .. import wire
from ..credentials import Caller
from ..rpcguard import WarningLimiter
from .acks import Acknowledger
from .auth import WorkerAuth
from .buffers import BufferFailed, BufferStore
from .executor import Executor
from .parts import joined_sources, part_sources, uploaded_part
from .uploads import Assembly, UploadStream, add_piece, decode_upload

log = logging.getLogger(__name__)
_refusals = WarningLimiter()  # a client sending refused uploads writes a bounded log

MAX_SOURCES_WAIT_S = 60.0  # the longest an uploaded part waits for the buffers it is made of


class UploadHandlers(wgrpc.WorkerServicer):
    """Uploads serve authenticated sessions their own buffers only (auth.py)."""

    store: BufferStore
    executor: Executor
    auth: WorkerAuth
    upload_messages: int

    async def _settled(self, buffer_ids: list[int], timeout: float, must_exist: bool = False) -> bool:
        raise NotImplementedError

    def _foreign(self, caller: Caller, buffer_id: int) -> bool:
        raise NotImplementedError

    async def PutBuffers(  # type: ignore[override]  # requests parsed by wire.put_buffer
        self, request_iterator: AsyncIterator[wire.PutBuffer], context: aio.ServicerContext
    ) -> wpb.PutBuffersResponse:
        """A session's uploads, one array per message or one in pieces (uploads.py).

        An upload refused whole (its bytes disagree with its dtype and shape, or cannot be
        allocated) fails that buffer with the reason, for the runs that read it, and the stream
        goes on: a client's later uploads queued behind it on the same stream are not lost (the
        runs reading them would wait for them until the hang timeout). The stream then ends with
        the first refusal's status. An upload in pieces that goes wrong, or is cut off, ends the
        stream at once and fails its buffer for whatever already waits on it; a cut-off staged
        upload nobody waits for leaves nothing (the proxy drops an unused one that way)."""
        caller = await self.auth.session(context, "upload")
        up = UploadStream()
        async for _ in self._uploads(request_iterator, context, caller, up, resent_if_cut=False):
            pass
        if up.pieces is not None:
            pieces = up.pieces
            missing = "" if pieces.dtype is not None else ", without its dtype and shape"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"buffer {pieces.buffer_id:#x}: the upload ended "
                                f"after {pieces.filled} of its {len(pieces.out)} bytes{missing}")
        if up.refused is not None:
            await context.abort(*up.refused)
        return wpb.PutBuffersResponse(count=up.count)

    async def Uploads(  # type: ignore[override]  # requests parsed by wire.put_buffer
        self, request_iterator: AsyncIterator[wire.PutBuffer], context: aio.ServicerContext
    ) -> None:
        """`PutBuffers` with acknowledgements of the messages handled so far (worker.proto,
        coalesced: acks.py), for a client that sends again what a broken stream may have lost
        (pwctl/worker_client.py). An upload refused whole fails its buffer and is acknowledged
        (the stream goes on and ends well); one refused in pieces, or under another's id, ends
        the stream with its status, as in `PutBuffers`. An upload cut off mid-array is dropped
        without failing its buffer: the client sends it again whole on its next stream, and the
        readers get it then."""
        caller = await self.auth.session(context, "upload")
        up = UploadStream()
        acks = Acknowledger(context)
        ok = False
        try:
            async for _ in self._uploads(request_iterator, context, caller, up, resent_if_cut=True):
                acks.handled(up.handled)
            ok = True
        finally:
            await acks.close(ok)

    async def _uploads(self, request_iterator: AsyncIterator[wire.PutBuffer], context: aio.ServicerContext,
                       caller: Caller, up: UploadStream, *, resent_if_cut: bool) -> AsyncIterator[None]:
        """Handles an upload stream's messages (`up` keeps its counts), yielding after each.
        `resent_if_cut`: an array cut off mid-way is dropped, not failed (`Uploads`)."""
        try:
            async for req in request_iterator:
                self.upload_messages += 1
                if not caller.owns_id(req.buffer_id):
                    log.warning("upload of buffer %#x by %s refused: not its id", req.buffer_id, caller.owner)
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                        f"buffer id {req.buffer_id:#x} is not one of this session's ids")
                up.handled += 1
                part_of = req.part_of
                if req.total_bytes or up.pieces is not None:
                    if up.pieces is not None:
                        part_of = up.pieces.part_of
                    arr = await self._piece(req, up.pieces, caller, context)
                    if not isinstance(arr, np.ndarray):
                        up.pieces = arr
                        yield
                        continue
                    up.pieces = None
                else:
                    try:
                        arr = decode_upload(req.array)
                    except (ValueError, MemoryError) as e:
                        up.refused = up.refused or self._refuse(req, caller, e, held=True)
                        yield
                        continue
                try:
                    value, nbytes = await self._upload_value(arr, part_of, caller)
                except ValueError as e:
                    up.refused = up.refused or self._refuse(req, caller, e, held=True)
                    yield
                    continue
                if not self.store.put(req.buffer_id, value, nbytes, owner=caller.owner, client_ref=True,
                                      same_owner=True, again=req.again):
                    await context.abort(grpc.StatusCode.NOT_FOUND, f"no buffer {req.buffer_id:#x} on this worker")
                up.count += 1
                yield
        finally:
            pieces = up.pieces
            if pieces is not None and not resent_if_cut:  # cut off (ended, failed or cancelled) mid-array
                self.store.refuse(pieces.buffer_id, caller.owner, f"the upload of buffer {pieces.buffer_id:#x} "
                                  f"ended after {pieces.filled} of its {len(pieces.out)} bytes", held=False)

    async def _upload_value(self, arr: np.ndarray, part_of: bytes, caller: Caller
                            ) -> tuple[np.ndarray | jax.Array, int]:
        """What an uploaded array is stored as, and its bytes: itself, or with `part_of` this
        worker's part of an array sharded over several members (parts.py); ValueError: refused."""
        if not part_of:
            return arr, arr.nbytes
        sources = part_sources(part_of)
        flat = await self._sources(sources, caller, arr.dtype) if sources else arr.reshape(-1)
        return uploaded_part(flat, part_of, self.executor.runners.group, self.executor.runners.devices), flat.nbytes

    async def _sources(self, ids: list[int], caller: Caller, dtype: np.dtype) -> np.ndarray:
        """The buffers an uploaded part is made of (the caller's, here or arriving), joined."""
        if any(self._foreign(caller, b) for b in ids) or not await self._settled(ids, MAX_SOURCES_WAIT_S):
            raise ValueError(f"its source buffers {[f'{b:#x}' for b in ids]} are not here after "
                             f"{MAX_SOURCES_WAIT_S:g} s")
        try:
            return joined_sources(self.store.wait_all(ids, 0.0), dtype)
        except (TimeoutError, BufferFailed) as e:
            raise ValueError(f"its source buffers: {e}") from None

    async def _piece(self, req: wire.PutBuffer, pieces: Assembly | None, caller: Caller,
                     context: aio.ServicerContext) -> Assembly | np.ndarray:
        """The next piece of an upload in pieces: the assembly so far, or the array once complete.
        A piece refused ends the stream, failing the buffers it concerns for what waits on them."""
        try:
            if not req.total_bytes:
                assert pieces is not None
                raise ValueError(f"buffer {pieces.buffer_id:#x} ends after {pieces.filled} of its "
                                 f"{len(pieces.out)} bytes")
            pieces = add_piece(pieces, req)
            return pieces.array() if pieces.done else pieces
        except (ValueError, MemoryError) as e:
            if pieces is not None and pieces.buffer_id != req.buffer_id:
                self.store.refuse(pieces.buffer_id, caller.owner,
                                  f"the upload of buffer {pieces.buffer_id:#x} was refused: {e}", held=False)
            await context.abort(*self._refuse(req, caller, e, held=False))
            raise AssertionError("abort raises") from None

    def _refuse(self, req: wire.PutBuffer, caller: Caller, e: ValueError | MemoryError,
                *, held: bool) -> tuple[grpc.StatusCode, str]:
        """Fails the buffer of an upload refused with `e` (BufferStore.refuse), logs it (a flood
        of them writes a bounded log) and gives the status and message for the caller."""
        if isinstance(e, MemoryError):
            status = grpc.StatusCode.RESOURCE_EXHAUSTED
            reason = f"{req.total_bytes or len(req.array.data)} bytes cannot be allocated"
        else:
            status, reason = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        _refusals.warn("PutBuffers", caller.owner, f"upload of buffer {req.buffer_id:#x} refused: {reason}")
        self.store.refuse(req.buffer_id, caller.owner, f"the upload of buffer {req.buffer_id:#x} was refused: {reason}",
                          held=held)
        return status, f"buffer {req.buffer_id:#x}: {reason}"
