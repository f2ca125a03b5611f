"""The Worker gRPC service: fetches, waits, peer transfers, stats; client uploads: upload_service.py."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
from grpc import aio

from pwctl.errors import status_code
from schemas.arrays import byte_view, dtype_name, resolve_dtype, to_numpy
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from .. import wire
from ..credentials import Caller
from ..threadnames import name_native_thread
from .auth import WorkerAuth
from .buffers import BufferFailed, BufferStore
from .compiling import compile_function
from .executor import Executor
from .parts import Gathering, local_parts, part_chunks
from .readiness import computed_now
from .shards import is_partial
from .shmring import RingReader, is_segment_name
from .transfer import CHUNK, DATA_CHUNK, peer_array
from .upload_service import UploadHandlers
from .waits import MAX_CHECKED_NOW, Verdict, Waits, wake, woken_within

log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0  # the longest one fetch or wait waits; the client asks again (pwctl waits ~1 s a call)
MAX_WAITS_PER_OWNER = 1024  # fetches and waits in progress per owner
MAX_WAIT_IDS = 65536  # buffers named by one Wait, and by all the waits in progress of one owner
INLINE_FETCH_BYTES = 1 << 20  # a computed array at most this large is read for a Fetch on the event loop


def fetched_range(data: memoryview, request: wpb.FetchRequest) -> memoryview | str:
    """The bytes of a buffer a fetch's `offset` and `length` name (worker.proto; none: all of
    them), or why they are out of range."""
    if not (request.offset or request.length):
        return data
    end = request.offset + request.length if request.length else len(data)
    if end > len(data) or request.offset > end:
        return f"bytes {request.offset}-{end} of buffer {request.buffer_id:#x}, which has {len(data)}"
    return data[request.offset : end]


@dataclass(frozen=True, slots=True)
class LocalParts:
    """A multi-host slice's array as this worker's distinct shards (parts.py `local_parts`)."""

    parts: list[tuple[tuple[int, ...], np.ndarray]]
    global_shape: tuple[int, ...]


def _at_hand(value: object) -> bool:
    """Whether `to_numpy(value)` returns at once: a host array, or a computed array of at most
    INLINE_FETCH_BYTES (a device's copy to the host costs the loop less than a pool thread's
    round trip, ~0.1 ms against 1-4 ms on a busy host: bench/FINDINGS.md, 2026-11-27 11:41)."""
    if isinstance(value, np.ndarray):
        return True
    # a deleted one (None) goes to the pool thread, whose read reports what is wrong
    return bool(getattr(value, "nbytes", INLINE_FETCH_BYTES + 1) <= INLINE_FETCH_BYTES
                and computed_now(value) is True)


def _refused(code: grpc.StatusCode, message: str) -> wpb.WaitReply:
    """A wait's refusal (WaitReply.code): the unary Wait ends with it as its status."""
    return wpb.WaitReply(code=code.value[0], error=message)


def _bounded(timeout_s: float) -> float:
    """A wait's length in seconds: what the caller asked (0: as long as allowed), at most MAX_WAIT_S."""
    if not timeout_s > 0 or not math.isfinite(timeout_s):
        return MAX_WAIT_S
    return min(timeout_s, MAX_WAIT_S)


class WorkerServicer(Waits, UploadHandlers):
    """Uploads, fetches and waits serve authenticated sessions their own buffers only; transfers
    serve the cluster's workers only (auth.py). Waits hold no thread: they end when the buffer
    settles, when the caller cancels, or after at most MAX_WAIT_S (the client asks again)."""

    def __init__(self, store: BufferStore, executor: Executor, host: str, island: str,
                 auth: WorkerAuth | None = None) -> None:
        self.store = store
        self.executor = executor
        self.host = host
        self.island = island
        self.auth = auth or WorkerAuth()
        self.data_address = ""  # of the TCP transfer port (tcplink.py), once it listens
        # upload messages received: an upload that never became a buffer (refused, cancelled,
        # cut short) changes no buffer count, yet its pieces leave freed memory to trim
        self.upload_messages = 0
        self.gathering = Gathering(store)  # parts of multi-host slices' arrays, until whole
        # converting a ready value to bytes blocks until its computation is done: a pool of its
        # own keeps that from starving the default executor that assembles transfers
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="pw-fetch",
                                        initializer=name_native_thread)
        self._waits: dict[str, tuple[int, int]] = {}  # owner -> (fetches and waits, ids) in progress
        # relayed controller messages (relay.py): the worker process handles them; its counts for Stats
        self.on_relayed: Callable[[wpb.RelayedMessage], None] = lambda part: None
        self.relay_counts: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0)  # in, out, rejected
        self._compiles = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pw-compile",
                                            initializer=name_native_thread)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._compiles.shutdown(wait=False, cancel_futures=True)

    def drop_runs(self, drop: cpb.Drop) -> None:
        """The controller's Drop: the runs' tasks here fail, the buffers gathered here for them
        go with their parts (parts.py, Gathering.forget), and the copies other workers sent here
        for their readers are no longer held for them (BufferStore.unhold): whether or not a
        reader came (sequential dispatch sends one only once its inputs' nodes finished), and a
        copy of the runs' intermediates that comes later is not kept (BufferStore.unwanted). Buffers
        no run will make (`never_ids`) fail where they are pending (BufferStore.never_made)."""
        if drop.run_ids:
            self.executor.drop(list(drop.run_ids), drop.reason, list(drop.skipped_seqs))
        if drop.never_ids:  # a run that never started: nothing will make them
            self.store.never_made(list(drop.never_ids), drop.reason)
        if drop.gathered_ids:
            self.gathering.forget(list(drop.gathered_ids), drop.reason)
        if drop.routed_ids:
            self.store.unhold(list(drop.routed_ids))
        if drop.unread_ids:  # intermediates: a copy a late sender sends still is not kept
            self.store.unwanted(list(drop.unread_ids))

    # ---- waiting for buffers ----
    def _take_slot(self, caller: Caller, ids: int) -> str:
        """Counts a fetch or wait (and the ids it waits on) against its owner's bounds, so that
        one owner's waits cost bounded memory: "" when taken (`_give_slot` gives it back), else
        why not (RESOURCE_EXHAUSTED)."""
        calls, waited = self._waits.get(caller.owner, (0, 0))
        if calls >= MAX_WAITS_PER_OWNER or waited + ids > MAX_WAIT_IDS:
            log.warning("%s refused a wait: %d waits on %d buffers already in progress", caller.owner, calls,
                        waited)
            return (f"too many fetches and waits in progress for {caller.owner} (at most "
                    f"{MAX_WAITS_PER_OWNER}, on at most {MAX_WAIT_IDS} buffers)")
        self._waits[caller.owner] = (calls + 1, waited + ids)
        return ""

    def _give_slot(self, caller: Caller, ids: int) -> None:
        calls, waited = self._waits[caller.owner]
        if calls > 1:
            self._waits[caller.owner] = (calls - 1, waited - ids)
        else:
            del self._waits[caller.owner]

    async def _settled(self, buffer_ids: list[int], timeout: float, must_exist: bool = False) -> bool:
        """Whether every buffer settled within `timeout` (unknown ones are waited for: a fetch
        may overtake the enqueue that declares its buffer). Cancelling the call ends the wait."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        latch = self.store.watch(buffer_ids, lambda: wake(loop, fut), must_exist)
        if latch is None:
            return True
        try:
            return await woken_within(fut, timeout)
        finally:
            self.store.unwatch(buffer_ids, latch)

    def _foreign(self, caller: Caller, buffer_id: int) -> bool:
        """Whether the buffer is none of the caller's business: another session's id, another
        owner's buffer, or one the caller released. Answered like an id that does not exist."""
        if not caller.owns_id(buffer_id) or self.store.released(buffer_id):
            return True
        owner = self.store.owner_of(buffer_id)
        return bool(owner) and owner != caller.owner

    def _refusal(self, caller: Caller, ids: list[int], timeout_s: float) -> tuple[grpc.StatusCode, str] | None:
        """Why a fetch or wait is refused (its status and message), or None."""
        if len(ids) > MAX_WAIT_IDS:
            return grpc.StatusCode.INVALID_ARGUMENT, f"{len(ids)} buffers in one request; at most {MAX_WAIT_IDS}"
        if math.isnan(timeout_s) or timeout_s < 0:
            return grpc.StatusCode.INVALID_ARGUMENT, f"invalid timeout_s {timeout_s}"
        bad = next((b for b in ids if self._foreign(caller, b)), None)
        if bad is not None:
            return grpc.StatusCode.NOT_FOUND, f"no buffer {bad:#x} on this worker"
        return None

    async def _check_request(self, context: aio.ServicerContext, caller: Caller, ids: list[int],
                             timeout_s: float) -> None:
        refused = self._refusal(caller, ids, timeout_s)
        if refused is not None:
            await context.abort(*refused)

    async def Fetch(  # type: ignore[override]  # yields chunks serialized already (server/wire.py)
        self, request: wpb.FetchRequest, context: aio.ServicerContext
    ) -> AsyncIterator[wpb.FetchChunk | bytes]:
        caller = await self.auth.session(context, "fetch")
        await self._check_request(context, caller, [request.buffer_id], request.timeout_s)
        if request.parts and (request.offset or request.length or request.data_messages):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a byte range or data messages of a fetch by parts")
        got = await self.fetch_array(caller, request.buffer_id, request.timeout_s, request.parts)
        if isinstance(got, tuple):
            await context.abort(*got)
            return  # (abort raises)
        if isinstance(got, LocalParts):  # a multi-host slice's array: this worker's shards
            for chunk in part_chunks(got.parts, got.global_shape, CHUNK):
                yield chunk
            return
        if isinstance(got, str):  # a data-message fetch fails with its status: it has no message for it
            if request.data_messages:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, got)
            yield wpb.FetchChunk(error=got, last=True)
            return
        arr = got
        data = fetched_range(byte_view(arr), request)
        if isinstance(data, str):
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, data)
            return  # (abort raises)
        if request.data_messages:  # FetchData, forwarded as they are to a proxy client
            for off in range(0, max(len(data), 1), DATA_CHUNK):
                yield wire.data_message(data[off : off + DATA_CHUNK])
            return
        dtype, shape = dtype_name(arr.dtype), list(arr.shape)
        # serialized here from views of the array (server/wire.py): one copy of each chunk, not
        # one to slice it, one into the message and one to serialize it
        for off in range(0, max(len(data), 1), CHUNK):
            first = off == 0
            yield wire.fetch_chunk_message(data[off : off + CHUNK], dtype if first else "", shape if first else (),
                                           off + CHUNK >= len(data))

    async def settle_for(self, caller: Caller, bid: int, timeout: float) -> tuple[grpc.StatusCode, str] | str | None:
        """Waits, holding one of the caller's wait slots, up to `timeout` for buffer `bid` to settle
        (a fetch, for `fetch_array` and a bulk connection's fetch of a buffer not settled yet):
        None once it has; a refusal (status, message): no wait slot free, or the buffer turned out
        another's or released meanwhile; a str: it is not ready in time."""
        busy = self._take_slot(caller, 1)
        if busy:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, busy
        try:
            ready = await self._settled([bid], timeout)
        finally:
            self._give_slot(caller, 1)
        if self._foreign(caller, bid):  # it appeared under another owner, or was released meanwhile
            return grpc.StatusCode.NOT_FOUND, f"no buffer {bid:#x} on this worker"
        if not ready:
            return f"buffer {bid} is not ready after {timeout:g} s"
        return None

    async def fetch_array(self, caller: Caller, bid: int, timeout_s: float,
                          parts: bool = False) -> tuple[grpc.StatusCode, str] | np.ndarray | LocalParts | str:
        """A gRPC fetch of buffer `bid` whose request passed its checks (`_refusal`): waits up to
        `timeout_s` (bounded) for it to settle (`settle_for`). Its array (read on the loop when at
        hand, `_at_hand`, else on a pool thread); with `parts`, a multi-host slice's array as this
        worker's parts; a str: why it has no value (it failed, or is not ready in time); a refusal
        (status, message)."""
        timeout = _bounded(timeout_s)
        refused = await self.settle_for(caller, bid, timeout)
        if refused is not None:
            return refused
        loop = asyncio.get_running_loop()
        try:
            value = self.store.wait(bid, 0.0, False)
            if parts and is_partial(value):
                return LocalParts(await loop.run_in_executor(self._pool, local_parts, value), tuple(value.shape))
            return to_numpy(value) if _at_hand(value) else await loop.run_in_executor(self._pool, to_numpy, value)
        except Exception as e:
            return self._fetch_failure(e)

    def _fetch_failure(self, e: Exception) -> str:
        """What a fetch says of a buffer whose value it could not have: the store's reason, or the
        failure of the computation behind it (a collective's names the peer it lost)."""
        if isinstance(e, (BufferFailed, TimeoutError)):
            return str(e)
        group = self.executor.runners.group
        error = f"{type(e).__name__}: {e}"
        return group.explain(error) if group.active else error

    async def Wait(self, request: wpb.WaitRequest, context: aio.ServicerContext) -> wpb.WaitReply:
        caller = await self.auth.session(context, "wait")
        reply = await self._wait_reply(caller, request)
        if reply.code:
            await context.abort(status_code(reply.code), reply.error)
        return reply

    async def Waits(  # type: ignore[override]  # writes its replies itself (context.write)
        self, requests: AsyncIterator[wpb.WaitRequest], context: aio.ServicerContext
    ) -> None:
        """`Wait` on a stream (worker.proto): the session checked once, each request answered by
        its own task (a long wait holds up none after it), refusals as replies. Its context
        writes one reply at a time (handlers.py `_OneAtATime`)."""
        caller = await self.auth.session(context, "wait")
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Task[None]] = set()

        async def answer(request: wpb.WaitRequest) -> None:
            try:
                reply = await self._wait_reply(caller, request)
            except Exception as e:  # a bug here must not leave the caller waiting for its deadline
                log.exception("a wait on the Waits stream of %s failed", caller.owner)
                reply = wpb.WaitReply(code=grpc.StatusCode.INTERNAL.value[0], error=f"{type(e).__name__}: {e}")
            reply.seq = request.seq
            try:
                await context.write(reply)
            except Exception:  # the stream ended meanwhile: nobody to answer
                pass

        ended = False
        try:
            async for request in requests:
                if len(pending) >= MAX_WAITS_PER_OWNER:  # a caller that does not read its answers, or
                    # sends more than it may wait on: no more is read until one is answered
                    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                task = loop.create_task(answer(request))
                pending.add(task)
                task.add_done_callback(pending.discard)
            ended = True
            if pending:  # the caller closed its side: the waits under way still get their answers
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            if not ended:
                for task in list(pending):
                    task.cancel()

    async def _wait_reply(self, caller: Caller, request: wpb.WaitRequest) -> wpb.WaitReply:
        """The answer to one wait (`Wait`, `Waits`); a refusal has `code` set (its status)."""
        ids = list(request.buffer_ids)
        timeout = _bounded(request.timeout_s)
        refused = self._refusal(caller, ids, request.timeout_s)
        if refused is not None:
            return _refused(*refused)
        busy = self._take_slot(caller, len(ids))
        if busy:
            return _refused(grpc.StatusCode.RESOURCE_EXHAUSTED, busy)
        try:
            # must_exist (a client after a controller restart): an id this worker does not hold is
            # an answer ("does not exist"), not something to wait for
            ready = await self._settled(ids, timeout, request.must_exist)
        finally:
            self._give_slot(caller, len(ids))
        bad = next((b for b in ids if self._foreign(caller, b)), None)
        if bad is not None:  # it appeared under another owner, or was released meanwhile
            return _refused(grpc.StatusCode.NOT_FOUND, f"no buffer {bad:#x} on this worker")
        if not ready:
            return wpb.WaitReply(ready=False)
        now = self._values_now(ids, request.must_exist)
        if (now is Verdict.WAIT and len(ids) <= MAX_CHECKED_NOW
                and await self._launches_over(ids, timeout) is False):
            return wpb.WaitReply(ready=False)  # still computing after the timeout
        if now is Verdict.WAIT:
            now = self._values_now(ids, request.must_exist)
        if now is Verdict.WAIT:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._computed, ids, request.must_exist)
        # computed already (or failed, or gone): answered here, no pool thread woken
        return self._computed(ids, request.must_exist, None if now is Verdict.ANSWER else now)

    async def Transfer(
        self, request_iterator: AsyncIterator[wpb.TransferChunk], context: aio.ServicerContext
    ) -> wpb.TransferResponse:
        """A peer's stream of buffers, each one chunk or several (the last marked `last`)."""
        await self.auth.peer(context)
        loop = asyncio.get_running_loop()
        heads: dict[int, wpb.TransferChunk] = {}
        parts: dict[int, list[bytes]] = {}
        total = 0
        async for chunk in request_iterator:
            bid = chunk.buffer_id
            if chunk.error:
                heads.pop(bid, None)
                parts.pop(bid, None)
                self.deliver_peer(chunk, None)
                continue
            head = heads.setdefault(bid, chunk)
            parts.setdefault(bid, []).append(chunk.array.data)
            if not chunk.last:
                continue
            del heads[bid]
            data = parts.pop(bid)
            name = head.array.shm_name
            if name and not is_segment_name(name):  # only a name of the form put_segment makes
                log.warning("transfer of buffer %#x refused: %r is not a transfer segment", bid, name)
                self.store.fail(bid, f"transfer of buffer {bid:#x} failed: not a transfer segment")
                continue
            try:
                if name or len(data) > 1:
                    arr = await loop.run_in_executor(None, peer_array, head.array, data)
                else:
                    arr = peer_array(head.array, data)
            except (OSError, ValueError, TypeError) as e:
                log.warning("transfer of buffer %#x failed: %s", bid, e)
                self.gathering.drop(bid)
                self.store.fail(bid, f"transfer of buffer {bid:#x} failed: {e}")
                continue
            total += self.deliver_peer(head, arr)
        return wpb.TransferResponse(bytes=total)

    def deliver_peer(self, header: wpb.TransferChunk, arr: np.ndarray | None) -> int:
        """A peer's array, whole or one member's part of a multi-host slice's array (gathered
        until its parts cover it), or its failure notice (arr None): from the TCP link
        (tcplink.py, that connection's thread) or the gRPC stream (`Transfer`), in the peer's
        order. Returns the bytes it stored (0 for a part that left the array incomplete)."""
        bid = header.buffer_id
        if arr is None:
            self.gathering.drop(bid)
            self.store.fail(bid, header.error or "the producer failed")
            return 0
        if header.global_shape:
            try:
                whole = self.gathering.add(bid, tuple(header.global_shape), tuple(header.part_start), arr)
            except ValueError as e:
                self.gathering.drop(bid)
                self.store.fail(bid, f"gathering buffer {bid}: {e}")
                return 0
            if whole is None:
                return 0
            arr = whole
        self.store.put(bid, arr, arr.nbytes, from_peer=True)
        return int(arr.nbytes)

    def deliver_local(self, ring: RingReader, notice: wpb.TransferChunk) -> None:
        """A same-host peer's array, in its shared-memory ring (locallink.py); called from the
        thread of that peer's link, one notice at a time in the peer's order (the ring relies on it)."""
        if notice.error:
            self.store.fail(notice.buffer_id, notice.error)
            return
        a = notice.array
        try:
            arr = ring.take(notice.ring, notice.ring_offset, notice.ring_release, resolve_dtype(a.dtype),
                            tuple(a.shape))
        except (OSError, ValueError) as e:
            self.store.fail(notice.buffer_id, f"shared-memory transfer failed: {e}")
            return
        self.store.put(notice.buffer_id, arr, arr.nbytes, from_peer=True)

    async def Relayed(
        self, request_iterator: AsyncIterator[wpb.RelayedMessage], context: aio.ServicerContext
    ) -> wpb.RelayedResponse:
        """A relay's stream of this worker's controller messages (relay.py): peers only."""
        await self.auth.peer(context)
        n = 0
        async for part in request_iterator:
            if part.host != self.host:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"this is worker {self.host}, not {part.host}")
            self.on_relayed(part)
            n += 1
        return wpb.RelayedResponse(count=n)

    async def Compile(self, request: wpb.CompileRequest, context: aio.ServicerContext) -> wpb.CompileReply:
        """Compiles a function now, for the executable cache its runs use (compiling.py)."""
        await self.auth.session(context, "compile")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._compiles, compile_function, self.executor.runners, request)

    async def Stats(self, request: wpb.WorkerStatsRequest, context: aio.ServicerContext) -> wpb.WorkerStats:
        buffers, nbytes = self.store.stats()
        relayed_in, relayed_out, rejected = self.relay_counts()
        gathering, gathering_bytes = self.gathering.stats()
        return wpb.WorkerStats(
            host=self.host,
            island=self.island,
            buffers=buffers,
            buffer_bytes=nbytes,
            executables=len(self.executor.cache),
            nodes_executed=self.executor.nodes_executed,
            executed_order=[f"{r}:{n}@{q}" for r, n, q in list(self.executor.recent_order)],
            segments=self.executor.segment_count,
            data_address=self.data_address,
            relayed_in=relayed_in,
            relayed_out=relayed_out,
            relayed_rejected=rejected,
            gathering=gathering,
            gathering_bytes=gathering_bytes,
            tombstones=self.store.tombstones(),
        )

