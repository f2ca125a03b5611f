"""The client of the worker service: array bytes go to and from workers directly, never through
the controller. Kept apart from `pwctl.client` so the CLI does not import NumPy."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from schemas.arrays import c_order, dtype_name, from_bytes
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

from .errors import ConnectionFailed, DeadlineExceeded, PathwaysError, from_status, status_code
from .tls import TlsConfig
from .transport import NO_RETRY, Transport
from .waitstream import WaitStream

_STOP = object()
log = logging.getLogger(__name__)


# An array over this many bytes is uploaded in pieces (PutBufferRequest.offset/total_bytes): a
# worker takes messages of at most 64 MiB, and a larger one ended the whole upload stream.
PIECE_BYTES = 16 * 1024 * 1024
# A stream that ends with uploads unacknowledged is opened again at once, and again after each
# pause here while none gets through; then they are given up (`on_lost`).
RESEND_PAUSES_S = (0.0, 0.2, 0.5, 1.0, 2.0)
# The worker refused the first unacknowledged upload itself (sending it again would fail again);
# other ends (the connection, the worker's server going away, cancellation) lose nothing for good.
_REFUSALS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                       grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION,
                       grpc.StatusCode.UNAUTHENTICATED})

Lost = Callable[[list["Upload"], str], None]
Wanted = Callable[["Upload"], bool]
Ended = Callable[[str], None]


@dataclass(eq=False)
class Upload:
    """One array's upload: its messages (one, or its pieces), kept until the worker acknowledged
    the last, and the run that reads it (0: none known)."""

    buffer_id: int
    messages: list[wpb.PutBufferRequest]
    run_id: int = 0
    sent: bool = False  # handed to a stream (a later one sends it `again`, worker.proto)
    # the client's release of it reached the worker (`WorkerClient.released`): its run is over,
    # unless the release passed a controller that did not know the run (`wanted` decides)
    released: bool = False


def upload_messages(buffer_id: int, arr: np.ndarray, piece_bytes: int = PIECE_BYTES) -> list[wpb.PutBufferRequest]:
    """The messages of one array's upload: one, or pieces of at most `piece_bytes` (worker.proto)."""
    arr = c_order(arr)
    spec = {"dtype": dtype_name(arr.dtype), "shape": list(arr.shape)}
    data = arr.tobytes()
    if len(data) <= piece_bytes:
        return [wpb.PutBufferRequest(buffer_id=buffer_id, array=pb.ArrayProto(data=data, **spec))]  # type: ignore[arg-type]
    return [wpb.PutBufferRequest(buffer_id=buffer_id, offset=off, total_bytes=len(data),
                                 array=pb.ArrayProto(data=data[off : off + piece_bytes],
                                                     **(spec if off == 0 else {})))  # type: ignore[arg-type]
            for off in range(0, len(data), piece_bytes)]


class _Stream:
    """One `Uploads` stream: its own queue (an ended stream's sender takes nothing more), and how
    many of its messages the worker acknowledged."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.acked = 0  # messages acknowledged (UploadAck.handled)
        self.done = 0  # of those, the messages of whole uploads taken off `WorkerClient._unacked`
        self.call: Any = None

    def requests(self) -> Iterator[wpb.PutBufferRequest]:
        """The stream's messages, as gRPC's thread takes them. Made from the queue alone: that
        thread holds the generator until it ends, and must not hold the call through it (a call
        object left to finalization may hang it: `WorkerClient.join`)."""
        return _requests(self.queue)


def _requests(q: queue.SimpleQueue[object]) -> Iterator[wpb.PutBufferRequest]:
    while True:
        item = q.get()
        if item is _STOP:
            return
        assert isinstance(item, Upload)
        yield from item.messages


class WorkerClient:
    """The worker service of one worker, on the same transport as `Client`: uploads on one
    long-lived stream, fetches and waits on demand. Array bytes go to and from workers directly,
    never through the controller.

    Uploads ride an `Uploads` stream whose acknowledgements say which got through: each upload
    is kept until then. When the stream ends (the worker's server or the connection went away,
    the call was cancelled), the uploads not acknowledged are sent again, in order, on a new
    stream opened at once; while none gets through the new stream is tried again after short
    pauses (`RESEND_PAUSES_S`), and then they are given up: `on_lost(uploads, error)` (the
    runtime fails the runs that read them). An upload the worker refused is not sent again, nor
    is one that `wanted(upload)` says nobody needs any more (the runtime: its run failed, or its
    release reached the worker, `released`, so its run is over); that one is dropped. Sent again
    to a worker that restarted meanwhile, it would be stored and kept until the session's
    buffers go, as nothing would ever read or release it.

    The upload stream stays open between uploads, so its end is the client's first sign that the
    worker went away (killed, restarted, its link broken): `on_ended(address)` is told of every
    end not caused by `close`, whether uploads were pending or not (the runtime then asks the
    controller where the worker's slices are before its next call there, `Runtime.catch_up`)."""

    def __init__(self, address: str, token: str | None, credential: str = "", on_lost: Lost | None = None,
                 wanted: Wanted | None = None, tls: TlsConfig | None = None, on_ended: Ended | None = None) -> None:
        self.address = address
        # the session credential (Welcome.worker_credential): the worker serves this session's
        # buffers only, and only to it
        extra = (("x-pathways-session", credential),) if credential else ()
        self._transport = Transport(address, token, peer="worker", retry=NO_RETRY, metadata=extra, tls=tls)
        self._stub = wgrpc.WorkerStub(self._transport.channel)
        self.waits = WaitStream(self._transport, self._stub)  # `wait`'s stream (pwctl/waitstream.py)
        self.on_lost: Lost = on_lost or (lambda uploads, error: None)
        self.on_ended: Ended = on_ended or (lambda address: None)
        # asked, with the lock held (it must be quick), of each upload not acknowledged before it
        # is sent again
        self.wanted: Wanted = wanted or (lambda upload: True)
        self._lock = threading.Lock()
        self._stream: _Stream | None = None
        self._unacked: deque[Upload] = deque()  # handed to the current stream (or the next), in order
        self._failures = 0  # streams in a row that ended with nothing acknowledged
        self._reopening = False  # a new stream is due after a pause (the ended stream's reader opens it)
        self._closed = False
        self._closing = threading.Event()  # set by close: a pause before a stream opens again ends
        self._readers: list[threading.Thread] = []  # the streams' acknowledgement readers (`join`)
        # fetches and unary waits in flight, which `abandon` cancels; `_abandoned` counts its calls
        # (a call that ends cancelled after one since it started reports `_abandoned_why`)
        self._calls: set[Any] = set()
        self._abandoned = 0
        self._abandoned_why = ""

    def put(self, buffer_id: int, arr: np.ndarray, run_id: int = 0) -> None:
        """Queues an upload; returns at once (the consuming node waits for it). `run_id`: the run
        that reads it, named to `on_lost` should it be given up."""
        upload = Upload(buffer_id, upload_messages(buffer_id, np.asarray(arr)), run_id)
        with self._lock:
            self._unacked.append(upload)
            if self._stream is not None:
                upload.sent = True
                self._stream.queue.put(upload)
            elif not self._reopening and not self._closed:
                self._open()

    def released(self, buffer_ids: list[int]) -> None:
        """The client's releases of these buffers reached this worker (the controller said so,
        controller.proto `releases_done`): an upload among them not acknowledged yet is marked
        (`Upload.released`) for `wanted`, asked before it is sent again. A release goes on to
        the worker only once every run the client sent before it is over, its upload's reader
        among them; a worker restarted at this address since would store the copy and, its
        release gone to the worker before, keep it until the session ends."""
        with self._lock:
            if not self._unacked:
                return
            ids = set(buffer_ids)
            for upload in self._unacked:
                if upload.buffer_id in ids:
                    upload.released = True

    def uploading(self) -> bool:
        """Whether some upload is not acknowledged yet; read without the lock (a hint: an upload
        put after it answered has no release out yet, so `released` has nothing for it)."""
        return bool(self._unacked)

    def unacknowledged(self) -> int:
        """Uploads not acknowledged by the worker yet (tests)."""
        with self._lock:
            return len(self._unacked)

    def _drop_unwanted(self) -> None:
        """Drops the uploads not acknowledged that are not `wanted` any more (call with the lock
        held and no stream current: a stream's acknowledgements count its uploads in order)."""
        try:
            keep = [u for u in self._unacked if self.wanted(u)]
        except Exception:  # the callback's bug: send them all, as before it was asked
            log.exception("asking whether %d uploads are still wanted failed", len(self._unacked))
            return
        if len(keep) < len(self._unacked):
            log.info("%d uploads to the worker at %s not sent again: not wanted any more",
                     len(self._unacked) - len(keep), self.address)
            self._unacked = deque(keep)

    def _open(self) -> None:
        """A new stream carrying every upload not acknowledged, in order (call with the lock held)."""
        stream = self._stream = _Stream()
        for upload in self._unacked:
            if upload.sent:  # the worker may have it (its acknowledgement lost), or have freed it since
                for m in upload.messages:
                    m.again = True
            upload.sent = True
            stream.queue.put(upload)
        stream.call = self._transport.bidi(self._stub.Uploads, stream.requests())
        reader = threading.Thread(target=self._acks, args=(stream,), name="pw-upload-acks", daemon=True)
        self._readers = [t for t in self._readers if t.is_alive()]
        self._readers.append(reader)
        reader.start()

    def _acks(self, stream: _Stream) -> None:
        """Reads a stream's acknowledgements, forgetting each upload whose messages are all in;
        when the stream ends, hands on what it had not acknowledged."""
        error = ""
        code: grpc.StatusCode | None = None
        try:
            for ack in stream.call:
                with self._lock:
                    if self._stream is not stream:
                        return
                    stream.acked = ack.handled
                    self._failures = 0
                    while self._unacked and stream.acked - stream.done >= len(self._unacked[0].messages):
                        stream.done += len(self._unacked.popleft().messages)
        except PathwaysError as e:
            error, code = str(e), e.code
        self._ended(stream, error or "the worker ended the upload stream", code)

    def _ended(self, stream: _Stream, error: str, code: grpc.StatusCode | None) -> None:
        """A stream ended: its uploads not acknowledged go again on a new one (after the pause
        for this many failures in a row), or are given up; one the worker refused is given up."""
        refused: list[Upload] = []
        lost: list[Upload] = []
        pause: float | None = None
        if self._stream is stream and not self._closed:  # (read unlocked: told before any pause)
            try:
                self.on_ended(self.address)
            except Exception:  # the callback's bug must not stop the uploads still to send
                log.exception("reporting the end of the upload stream to %s failed", self.address)
        with self._lock:
            if self._stream is not stream:
                return
            self._stream = None
            stream.queue.put(_STOP)
            if self._closed or not self._unacked:
                return
            log.warning("uploads to the worker at %s ended with %d not acknowledged: %s", self.address,
                        len(self._unacked), error)
            if code in _REFUSALS:  # the worker refused the first one not acknowledged: not sent again
                refused.append(self._unacked.popleft())
            self._drop_unwanted()  # neither sent again nor given up: its run is over already
            if self._failures < len(RESEND_PAUSES_S):
                pause = RESEND_PAUSES_S[self._failures]
                self._failures += 1
                self._reopening = bool(self._unacked)
            else:
                lost = list(self._unacked)
                self._unacked.clear()
                self._failures = 0
        if refused:
            self._tell_lost(refused, f"the worker at {self.address} refused the upload: {error}")
        if lost:
            self._tell_lost(lost, f"uploads to the worker at {self.address} failed: {error}")
        if pause is None or not self._reopening:
            return
        if pause:
            self._closing.wait(pause)
        with self._lock:
            self._reopening = False
            if self._stream is None and not self._closed:
                self._drop_unwanted()  # a run may have failed during the pause
                if self._unacked:
                    self._open()

    def _tell_lost(self, uploads: list[Upload], error: str) -> None:
        try:
            self.on_lost(uploads, error)
        except Exception:  # the callback's bug must not stop the uploads still to send
            log.exception("reporting %d lost uploads failed", len(uploads))

    def fetch(self, buffer_id: int, timeout_s: float, nbytes: int = 0,
              gone: Callable[[], str] | None = None) -> tuple[np.ndarray | None, str]:
        """(array, "") when ready, (None, error) when failed or the worker is unreachable, (None, "")
        on timeout; any other failure raises a typed error. `gone`: why the worker's host is lost
        ("" while it is not), asked once the call counts as started (`_mark`).

        The call's deadline is the worker's wait plus time to stream `nbytes` at a slow 50 MB/s: a
        worker that stalls (stopped, wedged) then costs the caller seconds, not a fixed 30, before
        it looks again whether the run failed (hang detection fails it on the controller)."""
        parts: list[bytes] = []
        first, error = self._fetched(wpb.FetchRequest(buffer_id=buffer_id, timeout_s=timeout_s), timeout_s, nbytes,
                                     gone, lambda chunk: parts.append(chunk.array.data))
        if first is None:
            return None, error
        head = first.array
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        return from_bytes(head.dtype, list(head.shape), data).copy(), ""

    def fetch_parts(self, buffer_id: int, timeout_s: float, nbytes: int = 0, gone: Callable[[], str] | None = None
                    ) -> tuple[list[tuple[tuple[int, ...], np.ndarray]] | None, str]:
        """As `fetch`, for an array of a multi-host slice: the parts this worker holds, each with
        where it starts in the global array (a whole array is one part starting at 0)."""
        heads: dict[int, wpb.FetchChunk] = {}
        data: dict[int, list[bytes]] = {}

        def take(chunk: wpb.FetchChunk) -> None:
            heads.setdefault(chunk.part, chunk)
            data.setdefault(chunk.part, []).append(chunk.array.data)

        request = wpb.FetchRequest(buffer_id=buffer_id, timeout_s=timeout_s, parts=True)
        first, error = self._fetched(request, timeout_s, nbytes, gone, take)
        if first is None:
            return None, error
        parts = []
        for k, head in sorted(heads.items()):
            arr = from_bytes(head.array.dtype, list(head.array.shape), b"".join(data[k])).copy()
            start = tuple(head.part_start) if head.global_shape else (0,) * arr.ndim
            parts.append((start, arr))
        return parts, ""

    def _fetched(self, request: wpb.FetchRequest, timeout_s: float, nbytes: int, gone: Callable[[], str] | None,
                 take: Callable[[wpb.FetchChunk], None]) -> tuple[wpb.FetchChunk | None, str]:
        """Streams a `Fetch` (`fetch`'s deadline), handing each chunk to `take` as it comes (not
        kept here: a large array's chunks are not held twice): (the first chunk, "") when it ended
        with chunks; else (None, error), the error "" on timeout."""
        mark, why = self._mark(gone)
        if why:
            return None, why
        first: wpb.FetchChunk | None = None
        try:
            for chunk in self._streamed(self._stub.Fetch, request, timeout_s + 5.0 + nbytes / 50e6, mark):
                if chunk.error:
                    return None, "" if "not ready after" in chunk.error else chunk.error
                if first is None:
                    first = chunk
                take(chunk)
        except ConnectionFailed as e:
            return None, _lost(e)
        if first is None:
            return None, self._why_abandoned(mark) or f"empty reply from {self.address}"
        return first, ""

    def wait(self, buffer_ids: list[int], timeout_s: float, must_exist: bool = False,
             gone: Callable[[], str] | None = None) -> tuple[bool, str]:
        """(True, "") once every buffer is computed, (False, error) when one failed or the worker
        is unreachable, (False, "") on timeout; no bytes move. Other failures raise. With
        `must_exist`, a buffer the worker does not know fails at once (else it is waited for).
        `gone` as `fetch`'s.
        Asked on the `Waits` stream when it can be (pwctl/waitstream.py), else a unary `Wait`:
        the same answers either way."""
        request = wpb.WaitRequest(buffer_ids=buffer_ids, timeout_s=timeout_s, must_exist=must_exist)
        mark, why = self._mark(gone)
        if why:
            return False, why
        reply = self.waits.ask(request, timeout_s + 5.0, abandoned=lambda: self._abandoned != mark)
        if reply is None:
            if why := self._why_abandoned(mark):
                return False, why
            request.seq = 0
            try:
                reply = self._unary_wait(request, timeout_s + 5.0, mark)
            except ConnectionFailed as e:
                return False, self._why_abandoned(mark) or _lost(e)
        elif reply.code:  # refused, as the unary call would have been with this status
            error = from_status(status_code(reply.code), reply.error, self.address, "worker")
            if isinstance(error, ConnectionFailed):
                return False, self._why_abandoned(mark) or _lost(error)
            raise error
        return reply.ready, reply.error

    # ---- calls a host's loss ends ----
    def abandon(self, why: str) -> None:
        """The worker's host was declared lost (`why`): the fetches and waits in flight end now,
        reporting `why`, rather than at their deadline (a frozen host keeps its connections
        open). Calls made later are made as usual."""
        with self._lock:
            self._abandoned += 1
            self._abandoned_why = why
            calls = list(self._calls)
        self.waits.abandon()
        for call in calls:
            call.cancel()

    def _mark(self, gone: Callable[[], str] | None) -> tuple[int, str]:
        """A fetch's or wait's `abandon` mark, taken now, and why the worker's host is lost ("" while
        it is not: `gone`), asked after the mark: the runtime records a loss before it abandons the
        worker's calls (runtime.py `_host_lost`), so a loss recorded before the mark is seen here
        and one after it abandons the call. (A caller's own look before it called can miss a loss
        told in between: its call then waited at a frozen worker for its whole deadline.)"""
        mark = self._abandoned
        return mark, gone() if gone is not None else ""

    def _why_abandoned(self, mark: int) -> str:
        """Why a call that started when `abandon` had been called `mark` times ended: "" unless
        abandoned since."""
        return self._abandoned_why if self._abandoned != mark else ""

    def _started(self, call: Any, mark: int) -> None:
        """Registers a call for `abandon`, made by a caller that took its mark (`_abandoned`) before:
        one abandoned since (between the mark and now, so not among the calls `abandon` cancelled)
        is cancelled here. Else a loss told while the call was being made left it to wait at a
        frozen worker for its whole deadline."""
        with self._lock:
            self._calls.add(call)
            abandoned = self._abandoned != mark
        if abandoned:
            call.cancel()

    def _streamed(self, rpc: Callable[..., Any], request: Any, deadline: float, mark: int) -> Iterator[Any]:
        """A server-streamed call's messages (`Transport.server_stream`), `abandon` able to end it
        (from `mark` on: `_started`)."""
        call = rpc(request, timeout=deadline, metadata=self._transport.metadata)
        self._started(call, mark)
        try:
            yield from call
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                return
            raise self._transport.error(e) from None
        finally:
            with self._lock:
                self._calls.discard(call)

    def _unary_wait(self, request: wpb.WaitRequest, deadline: float, mark: int) -> wpb.WaitReply:
        """A unary `Wait` (`Transport.unary`, not retried), `abandon` able to end it (from `mark` on)."""
        call = self._stub.Wait.future(request, timeout=deadline, metadata=self._transport.metadata)
        self._started(call, mark)
        try:
            reply: wpb.WaitReply = call.result()
            return reply
        except grpc.FutureCancelledError:
            raise ConnectionFailed(f"the wait at {self.address} was cancelled") from None
        except grpc.RpcError as e:
            raise self._transport.error(e) from None
        finally:
            with self._lock:
                self._calls.discard(call)

    def close(self) -> None:
        """Ends the uploads (the stream is cancelled with the channel) and the channel; returns at
        once. `join` then waits for the stream's reader to end."""
        with self._lock:
            self._closed = True
            if self._stream is not None:
                self._stream.queue.put(_STOP)
        self._closing.set()
        self.waits.close()
        self._transport.close()

    def join(self, timeout: float) -> bool:
        """After `close`: waits up to `timeout` for the streams' readers to end, then lets go of the
        stream (its gRPC call). True when none is left running. At interpreter exit this runs
        while gRPC's threads still do (runtime.py, `Runtime.close`): a call object collected
        later, during finalization, takes a lock that one of them may hold, frozen (grpc's
        `_MultiThreadedRendezvous.__del__`)."""
        deadline = time.monotonic() + timeout
        for reader in list(self._readers):
            if reader is not threading.current_thread():
                reader.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._readers = [t for t in self._readers if t.is_alive()]
            if self._stream is not None:
                self._stream.call = None
            self._stream = None
            self.waits.forget()
            return not self._readers


def _lost(e: ConnectionFailed) -> str:
    """A fetch or wait that could not finish: the error to report, or "" when it only ran out of
    time (the caller checks whether the run failed and asks again)."""
    return "" if isinstance(e, DeadlineExceeded) else str(e)

