"""The Worker gRPC service: uploads from clients, fetches, peer transfers, stats."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from grpc import aio

from schemas.arrays import byte_view, dtype_name, from_bytes, resolve_dtype, to_numpy
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

from ..threadnames import name_native_thread
from .buffers import BufferFailed, BufferStore
from .executor import Executor
from .parts import Gathering, is_partial, local_parts, part_chunks
from .shmring import RingReader, take_segment
from .transfer import CHUNK


def _assemble(first: pb.ArrayProto, parts: list[bytes]) -> np.ndarray:
    if first.shm_name:
        return take_segment(first.shm_name, resolve_dtype(first.dtype), tuple(first.shape))
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    return from_bytes(first.dtype, list(first.shape), data)


class WorkerServicer(wgrpc.WorkerServicer):
    def __init__(self, store: BufferStore, executor: Executor, host: str, island: str) -> None:
        self.store = store
        self.executor = executor
        self.host = host
        self.island = island
        # fetches block until their buffer is computed: a pool of their own keeps them
        # from starving the default executor that assembles transfers
        self.data_address = ""  # of the TCP transfer port (tcplink.py), once it listens
        self._gathering = Gathering()  # parts of multi-host slices' arrays, until whole
        self._waiters = ThreadPoolExecutor(max_workers=64, thread_name_prefix="pw-fetch",
                                            initializer=name_native_thread)

    async def PutBuffers(
        self, request_iterator: AsyncIterator[wpb.PutBufferRequest], context: aio.ServicerContext
    ) -> wpb.PutBuffersResponse:
        count = 0
        async for req in request_iterator:
            arr = _assemble(req.array, [req.array.data])
            self.store.put(req.buffer_id, arr, arr.nbytes, owner=req.owner, client_ref=True)
            count += 1
        return wpb.PutBuffersResponse(count=count)

    async def Fetch(self, request: wpb.FetchRequest, context: aio.ServicerContext) -> AsyncIterator[wpb.FetchChunk]:
        loop = asyncio.get_running_loop()
        timeout = request.timeout_s or None
        try:
            value = await loop.run_in_executor(self._waiters, self.store.wait, request.buffer_id, timeout, False)
            if request.parts and is_partial(value):  # a multi-host slice's array: this worker's shards
                for chunk in part_chunks(await loop.run_in_executor(self._waiters, local_parts, value),
                                         tuple(value.shape), CHUNK):
                    yield chunk
                return
            arr = await loop.run_in_executor(self._waiters, to_numpy, value)
        except (BufferFailed, TimeoutError) as e:
            yield wpb.FetchChunk(error=str(e), last=True)
            return
        except Exception as e:  # the computation behind the array failed
            group = self.executor.runners.group  # a collective's failure names the peer it lost
            error = f"{type(e).__name__}: {e}"
            yield wpb.FetchChunk(error=group.explain(error) if group.active else error, last=True)
            return
        data = byte_view(arr)
        head = pb.ArrayProto(dtype=dtype_name(arr.dtype), shape=list(arr.shape))
        if len(data) <= CHUNK:
            head.data = bytes(data)
            yield wpb.FetchChunk(array=head, last=True)
            return
        for off in range(0, len(data), CHUNK):
            part = pb.ArrayProto(data=bytes(data[off : off + CHUNK]))
            if off == 0:
                part.dtype, part.shape[:] = head.dtype, head.shape
            yield wpb.FetchChunk(array=part, last=off + CHUNK >= len(data))

    async def Wait(self, request: wpb.WaitRequest, context: aio.ServicerContext) -> wpb.WaitReply:
        loop = asyncio.get_running_loop()
        ids, timeout = list(request.buffer_ids), request.timeout_s or None
        return await loop.run_in_executor(self._waiters, self._wait, ids, timeout, request.must_exist)

    def _wait(self, buffer_ids: list[int], timeout: float | None, must_exist: bool = False) -> wpb.WaitReply:
        # one wake for all the buffers (launched), then one wait for their computations
        try:
            jax.block_until_ready(self.store.wait_all(buffer_ids, timeout, must_exist=must_exist))
        except TimeoutError:
            return wpb.WaitReply(ready=False)
        except BufferFailed as e:
            return wpb.WaitReply(error=str(e))
        except Exception as e:  # the computation behind the array failed
            return wpb.WaitReply(error=f"{type(e).__name__}: {e}")
        return wpb.WaitReply(ready=True)

    async def Transfer(
        self, request_iterator: AsyncIterator[wpb.TransferChunk], context: aio.ServicerContext
    ) -> wpb.TransferResponse:
        """A peer's stream of buffers, each one chunk or several (the last marked `last`)."""
        loop = asyncio.get_running_loop()
        heads: dict[int, wpb.TransferChunk] = {}
        parts: dict[int, list[bytes]] = {}
        total = 0
        async for chunk in request_iterator:
            bid = chunk.buffer_id
            if chunk.error:
                heads.pop(bid, None)
                parts.pop(bid, None)
                self._gathering.drop(bid)
                self.store.fail(bid, chunk.error)
                continue
            head = heads.setdefault(bid, chunk)
            parts.setdefault(bid, []).append(chunk.array.data)
            if not chunk.last:
                continue
            del heads[bid]
            data = parts.pop(bid)
            if head.array.shm_name or len(data) > 1:
                arr = await loop.run_in_executor(None, _assemble, head.array, data)
            else:
                arr = _assemble(head.array, data)
            if head.global_shape:  # one member's part of a multi-host slice's array
                try:
                    whole = self._gathering.add(bid, tuple(head.global_shape), tuple(head.part_start), arr)
                except ValueError as e:
                    self._gathering.drop(bid)
                    self.store.fail(bid, f"gathering buffer {bid}: {e}")
                    continue
                if whole is None:
                    continue
                arr = whole
            self.store.put(bid, arr, arr.nbytes, from_peer=True)
            total += arr.nbytes
        return wpb.TransferResponse(bytes=total)

    def deliver_peer(self, header: wpb.TransferChunk, arr: np.ndarray | None) -> None:
        """A peer's array from the TCP link (tcplink.py), or its failure notice (arr None);
        called from that connection's thread, in the peer's order."""
        bid = header.buffer_id
        if arr is None:
            self._gathering.drop(bid)
            self.store.fail(bid, header.error or "the producer failed")
            return
        if header.global_shape:  # one member's part of a multi-host slice's array
            try:
                whole = self._gathering.add(bid, tuple(header.global_shape), tuple(header.part_start), arr)
            except ValueError as e:
                self._gathering.drop(bid)
                self.store.fail(bid, f"gathering buffer {bid}: {e}")
                return
            if whole is None:
                return
            arr = whole
        self.store.put(bid, arr, arr.nbytes, from_peer=True)

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

    async def Stats(self, request: wpb.WorkerStatsRequest, context: aio.ServicerContext) -> wpb.WorkerStats:
        buffers, nbytes = self.store.stats()
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
        )
