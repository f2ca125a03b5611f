"""The client of the worker service: array bytes go to and from workers directly, never through
the controller. Kept apart from `pwctl.client` so the CLI does not import NumPy."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from schemas.arrays import c_order, dtype_name, from_bytes
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

from .errors import ConnectionFailed, DeadlineExceeded
from .transport import NO_RETRY, Transport

_STOP = object()
log = logging.getLogger(__name__)


class WorkerClient:
    """The worker service of one worker, on the same transport as `Client`: uploads on one
    long-lived stream, fetches and waits on demand. Array bytes go to and from workers directly,
    never through the controller."""

    def __init__(self, address: str, token: str | None, credential: str = "") -> None:
        self.address = address
        # the session credential (Welcome.worker_credential): the worker serves this session's
        # buffers only, and only to it
        extra = (("x-pathways-session", credential),) if credential else ()
        self._transport = Transport(address, token, peer="worker", retry=NO_RETRY, metadata=extra)
        self._stub = wgrpc.WorkerStub(self._transport.channel)
        self._puts: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._put_call: Any = None
        self._lock = threading.Lock()

    @staticmethod
    def _put_iter(puts: queue.SimpleQueue[object]) -> Iterator[wpb.PutBufferRequest]:
        while True:
            item = puts.get()
            if item is _STOP:
                return
            assert isinstance(item, wpb.PutBufferRequest)
            yield item

    def put(self, buffer_id: int, arr: np.ndarray, owner: str) -> None:
        """Queues an upload; returns at once (the consuming node waits for it)."""
        arr = c_order(arr)
        req = wpb.PutBufferRequest(
            buffer_id=buffer_id,
            array=pb.ArrayProto(dtype=dtype_name(arr.dtype), shape=list(arr.shape), data=arr.tobytes()),
            owner=owner,
        )
        with self._lock:
            if self._put_call is None or self._put_call.done():
                # a stream the worker ended (it restarted, or refused an upload) is opened again:
                # uploads queued behind an ended stream would otherwise never be sent, and the
                # runs reading them would wait for them
                if self._put_call is not None:
                    _log_ended(self.address, self._put_call)
                    # each stream reads its own queue: the ended one's reader takes nothing more
                    self._puts.put(_STOP)
                    self._puts = queue.SimpleQueue()
                self._put_call = self._transport.client_stream_future(self._stub.PutBuffers,
                                                                      self._put_iter(self._puts))
            self._puts.put(req)

    def fetch(self, buffer_id: int, timeout_s: float, nbytes: int = 0) -> tuple[np.ndarray | None, str]:
        """(array, "") when ready, (None, error) when failed or the worker is unreachable, (None, "")
        on timeout; any other failure raises a typed error.

        The call's deadline is the worker's wait plus time to stream `nbytes` at a slow 50 MB/s: a
        worker that stalls (stopped, wedged) then costs the caller seconds, not a fixed 30, before
        it looks again whether the run failed (hang detection fails it on the controller)."""
        head: pb.ArrayProto | None = None
        parts: list[bytes] = []
        deadline = timeout_s + 5.0 + nbytes / 50e6
        try:
            for chunk in self._transport.server_stream(
                    self._stub.Fetch, wpb.FetchRequest(buffer_id=buffer_id, timeout_s=timeout_s), timeout=deadline):
                if chunk.error:
                    if "not ready after" in chunk.error:
                        return None, ""
                    return None, chunk.error
                if head is None:
                    head = chunk.array
                parts.append(chunk.array.data)
        except ConnectionFailed as e:
            return None, _lost(e)
        if head is None:
            return None, f"empty reply from {self.address}"
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        return from_bytes(head.dtype, list(head.shape), data).copy(), ""

    def fetch_parts(self, buffer_id: int, timeout_s: float, nbytes: int = 0
                    ) -> tuple[list[tuple[tuple[int, ...], np.ndarray]] | None, str]:
        """As `fetch`, for an array of a multi-host slice: the parts this worker holds, each with
        where it starts in the global array (a whole array is one part starting at 0)."""
        heads: dict[int, wpb.FetchChunk] = {}
        data: dict[int, list[bytes]] = {}
        deadline = timeout_s + 5.0 + nbytes / 50e6
        request = wpb.FetchRequest(buffer_id=buffer_id, timeout_s=timeout_s, parts=True)
        try:
            for chunk in self._transport.server_stream(self._stub.Fetch, request, timeout=deadline):
                if chunk.error:
                    if "not ready after" in chunk.error:
                        return None, ""
                    return None, chunk.error
                if chunk.part not in heads:
                    heads[chunk.part] = chunk
                data.setdefault(chunk.part, []).append(chunk.array.data)
        except ConnectionFailed as e:
            return None, _lost(e)
        if not heads:
            return None, f"empty reply from {self.address}"
        parts = []
        for k, head in sorted(heads.items()):
            arr = from_bytes(head.array.dtype, list(head.array.shape), b"".join(data[k])).copy()
            start = tuple(head.part_start) if head.global_shape else (0,) * arr.ndim
            parts.append((start, arr))
        return parts, ""

    def wait(self, buffer_ids: list[int], timeout_s: float, must_exist: bool = False) -> tuple[bool, str]:
        """(True, "") once every buffer is computed, (False, error) when one failed or the worker
        is unreachable, (False, "") on timeout; no bytes move. Other failures raise. With
        `must_exist`, a buffer the worker does not know fails at once (else it is waited for)."""
        try:
            request = wpb.WaitRequest(buffer_ids=buffer_ids, timeout_s=timeout_s, must_exist=must_exist)
            reply = self._transport.unary(self._stub.Wait, request, timeout=timeout_s + 5.0)
        except ConnectionFailed as e:
            return False, _lost(e)
        return reply.ready, reply.error

    def close(self) -> None:
        self._puts.put(_STOP)
        self._transport.close()


def _log_ended(address: str, call: Any) -> None:
    """Says why an upload stream ended, when it failed (an ended stream's uploads were lost)."""
    try:
        call.result(timeout=0)
    except Exception as e:  # the typed error of the transport, or gRPC's
        log.warning("uploads to the worker at %s ended: %s; opening a new stream", address, e)


def _lost(e: ConnectionFailed) -> str:
    """A fetch or wait that could not finish: the error to report, or "" when it only ran out of
    time (the caller checks whether the run failed and asks again)."""
    return "" if isinstance(e, DeadlineExceeded) else str(e)
