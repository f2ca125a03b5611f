"""The client runtime: one per process, shared by every `pw` object.

It keeps one long-lived Session stream to the controller. Outgoing messages go into a
queue that a sender drains into batches, so a loop of calls costs one message per
batch and never waits for a reply (the client chooses run and buffer ids itself).
Array bytes go straight to, and come straight from, the workers.

The session outlives a controller restart: when the stream breaks, `Resume` (resume.py) opens
it again and resumes the session; the runtime keeps the stream machinery it uses.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future as CFuture
from typing import Any

from schemas.pathways.v1 import controller_pb2 as cpb

from ..client import Client
from ..errors import ConnectionFailed, PathwaysError, ProgramError
from ..worker_client import Upload, WorkerClient
from .env import env_amount, keep_local_jax_on_cpu
from .packing import Release, pack
from .resume import RECONNECT_S, Resume

log = logging.getLogger(__name__)

MAX_BATCH = 4096
# Failed runs remembered (their errors, for the futures of those runs); older ones are forgotten,
# and a future of a forgotten run reports the worker's own error for its buffer instead.
MAX_FAILED_RUNS = 4096
# Runs sent but not known to be over, before a call blocks (PWCTL_MAX_IN_FLIGHT; 0: no bound). A
# loop that calls without ever waiting would otherwise queue work (and its inputs) without limit;
# JAX blocks its async dispatch the same way.
MAX_IN_FLIGHT = 1024
_STOP = object()
_WAKE = object()  # wakes a stream's sender that the stream outlived (it then hands its item on)
# Run ids remembered as handed to the current stream, for `uncertain` after a reconnect; older runs
# are over in practice (a client keeps at most MAX_IN_FLIGHT in flight).
MAX_HANDED = 65536
# How long closing (at exit) waits for the runs still in flight to be reported over before the
# session ends (which cancels them): a program that exits right after fetching its last result
# has its earlier runs finished on the workers, and their reports on the way; they count as done,
# not cancelled. A program exiting with work still running waits this long at most.
CLOSE_DRAIN_S = 2.0


class _Lost(Exception):
    """The session stream ended; `reason` says why (reconnect, unless `final`)."""

    def __init__(self, reason: str, final: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.final = final


class Runtime:
    """The process-wide connection: session stream, id allocation, workers, slices."""

    _instance: Runtime | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls) -> Runtime:
        with cls._instance_lock:
            if cls._instance is None or cls._instance.closed:
                cls._instance = Runtime()
            return cls._instance

    def __init__(self, server: str | None = None) -> None:
        keep_local_jax_on_cpu()
        self.client = Client(server=server)
        self.job_id = os.environ.get("PWCTL_JOB_ID", "")
        self.closed = False
        self._out: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._welcome: CFuture[cpb.Welcome] = CFuture()
        self._pending: dict[int, CFuture[cpb.ProgramRegistered]] = {}
        self._failed_runs: OrderedDict[int, str] = OrderedDict()  # the last MAX_FAILED_RUNS
        self._lost_lock = threading.Lock()  # one cancel_run per run, whichever worker lost its inputs
        self.max_in_flight = env_amount("PWCTL_MAX_IN_FLIGHT", os.environ.get("PWCTL_MAX_IN_FLIGHT", ""),
                                        MAX_IN_FLIGHT, int, "a number of runs (0: no bound)")
        self._runs_sent = 0
        self._runs_done = 0  # as the controller last reported (RunsDone)
        self._progress = threading.Condition()
        self._session_error = ""
        self._workers: dict[str, WorkerClient] = {}
        self._workers_lock = threading.Lock()
        self.known_functions: set[str] = set()  # ids of the functions the server accepted from us
        self.slices: dict[str, Any] = {}  # name -> VirtualSlice, refreshed on SliceChanged
        self.reconnect_s = env_amount("PWCTL_RECONNECT_S", os.environ.get("PWCTL_RECONNECT_S", ""),
                                      RECONNECT_S, float, "seconds (0: never reconnect)")
        # what a resumed session sends again: every program registered, registrations unanswered
        self._programs: dict[str, tuple[cpb.ProgramGraph, list[Any]]] = {}
        self._pending_msgs: dict[int, cpb.ClientMessage] = {}
        # the streams: a generation per stream; a sender that its stream outlived hands on what
        # it took (`_carry`, sent first on the next stream)
        self._gen = 0
        self._gen_lock = threading.Lock()
        self._carry: deque[object] = deque()
        # runs handed to the current stream, with their outputs
        self._handed: deque[tuple[int, tuple[int, ...]]] = deque(maxlen=MAX_HANDED)
        self._handed_total = 0  # runs handed to any stream (the base of a new stream's RunsDone)
        self._done_base = 0
        self.resume = Resume(self)  # across controller restarts; what is known of runs in flight at one
        self._resume_token = ""
        self.client_id = ""
        self._hello = cpb.Hello(
            client_name=f"pid-{os.getpid()}",
            job_id=self.job_id,
            job_secret=os.environ.get("PWCTL_JOB_SECRET", "") if self.job_id else "",  # proves it is the driver
            priority=int(os.environ.get("PWCTL_PRIORITY", "0") or 0),
            weight=float(os.environ.get("PWCTL_WEIGHT", "1") or 1),
            dispatch=os.environ.get("PWCTL_DISPATCH", ""),
        )
        ready = threading.Event()
        self._ready = ready
        self._sender_done = threading.Event()
        self._call = self.client.session(self._requests(0, [cpb.ClientMessage(hello=self._hello)], ready,
                                                        self._sender_done))
        self._reader = threading.Thread(target=self._read, name="pw-session", daemon=True)
        self._reader.start()
        try:
            welcome = self._welcome.result(timeout=30)
        except PathwaysError:
            raise
        except Exception as e:
            raise ConnectionFailed(
                f"cannot reach the server at {self.client.address}: is it running? try `pwctl up`"
            ) from e
        self.owner = f"job:{self.job_id}" if self.job_id else f"client:{welcome.client_id}"
        self._prefix = welcome.id_prefix << 40
        self._credential = welcome.worker_credential  # what workers check (worker_client.py)
        atexit.register(self.close)

    def _welcomed(self, welcome: cpb.Welcome) -> None:
        self.client_id = welcome.client_id
        self._resume_token = welcome.resume_token

    # ---- ids ----
    def new_id(self) -> int:
        return self._prefix | next(self._ids)

    # ---- outgoing ----
    def send(self, msg: cpb.ClientMessage) -> None:
        if self._session_error:
            raise ConnectionFailed(self._session_error)
        self._out.put(msg)

    def wait_for_room(self) -> None:
        """Blocks while `max_in_flight` runs are in flight (until the controller reports some over)."""
        if self.max_in_flight <= 0 or self._runs_sent - self._runs_done < self.max_in_flight:
            return
        with self._progress:
            while (self.max_in_flight <= self._runs_sent - self._runs_done and not self._session_error
                   and not self.closed):
                self._progress.wait(timeout=1.0)

    def send_run(self, msg: cpb.ClientMessage) -> None:
        with self._progress:
            self._runs_sent += 1
        self.send(msg)

    def in_flight(self) -> int:
        """Runs sent whose end the controller has not reported yet."""
        return self._runs_sent - self._runs_done

    def _requests(self, gen: int, first: list[cpb.ClientMessage], ready: threading.Event,
                  done: threading.Event) -> Iterator[cpb.ClientMessage]:
        """Stream `gen`'s messages: `first` (hello, and on a resumed stream the registrations),
        then, once the Welcome came (`ready`), what was carried over and what is queued, in
        batches. A newer stream ends this one: what it took then goes to `_carry`, in order."""
        try:
            yield from first
            while not ready.wait(0.5):
                if gen != self._gen or self.closed:
                    return
            while True:
                with self._gen_lock:
                    if gen != self._gen:
                        return
                    carried = list(self._carry)
                    self._carry.clear()
                batch: list[cpb.ClientMessage | Release] = []
                stop = False
                for item in carried:
                    if item is _STOP:
                        stop = True
                    elif item is not _WAKE:
                        assert isinstance(item, cpb.ClientMessage | Release)
                        batch.append(item)
                if not batch and not stop:
                    item = self._out.get()
                    if not self._take(gen, item, batch):
                        return
                    stop = item is _STOP
                while not stop and batch and len(batch) < MAX_BATCH:
                    try:
                        nxt = self._out.get_nowait()
                    except queue.Empty:
                        break
                    if not self._take(gen, nxt, batch):
                        return
                    stop = nxt is _STOP
                if batch:
                    runs = [(m.run.run_id, tuple(m.run.output_ids)) for m in batch
                            if isinstance(m, cpb.ClientMessage) and m.HasField("run")]
                    with self._gen_lock:  # handed (and remembered as such) only while the stream is current
                        if gen != self._gen:
                            self._carry.extend(batch)
                            return
                        if runs:
                            self._handed.extend(runs)
                            self._handed_total += len(runs)
                    yield pack(batch)
                if stop:
                    return
        finally:
            done.set()

    def _take(self, gen: int, item: object, batch: list[cpb.ClientMessage | Release]) -> bool:
        """Adds `item` to `batch`; False when stream `gen` is over: then the batch and the item
        go to `_carry`, in order, for the next stream."""
        with self._gen_lock:
            if gen != self._gen:
                self._carry.extend(batch)
                if item is not _WAKE:
                    self._carry.append(item)
                batch.clear()
                return False
        if isinstance(item, cpb.ClientMessage | Release):
            batch.append(item)
        return True

    # ---- incoming ----
    def _read(self) -> None:
        call: Any = self._call
        events: Iterator[cpb.SessionEvent] = iter(call)
        try:
            while True:
                try:
                    self._serve(events)
                    return  # closed by us
                except _Lost as lost:
                    if self.closed:
                        return
                    if lost.final or not self._welcome.done():
                        self._session_error = lost.reason
                        return
                    if self.reconnect_s <= 0:
                        address = self.client.address
                        self._session_error = f"lost the session with the server at {address}: {lost.reason}"
                        return
                    resumed, error = self.resume.reconnect(lost.reason)
                    if resumed is None:
                        self._session_error = error
                        return
                    events = resumed
        finally:
            with self._progress:  # calls waiting for room see the session's end
                self._progress.notify_all()
            if not self._welcome.done():
                self._welcome.set_exception(ConnectionFailed(self._session_error or "session closed"))
            for fut in list(self._pending.values()):
                if not fut.done():
                    fut.set_exception(ConnectionFailed(self._session_error or "session closed"))
            self._pending.clear()
            self._pending_msgs.clear()

    def _serve(self, events: Iterator[cpb.SessionEvent]) -> None:
        """Handles a stream's events; raises _Lost when it ends (returns when we closed it)."""
        going_away = ""
        try:
            for ev in events:
                kind = ev.WhichOneof("msg")
                if kind == "welcome":
                    self._welcomed(ev.welcome)
                    self._welcome.set_result(ev.welcome)
                    self._ready.set()
                elif kind == "registered":
                    self._pending_msgs.pop(ev.registered.request_id, None)
                    fut = self._pending.pop(ev.registered.request_id, None)
                    if fut is not None:
                        fut.set_result(ev.registered)
                elif kind == "finished":
                    if not ev.finished.ok:
                        self._failed_runs[ev.finished.run_id] = ev.finished.error
                        if len(self._failed_runs) > MAX_FAILED_RUNS:
                            self._failed_runs.popitem(last=False)
                elif kind == "runs_done":
                    with self._progress:
                        self._runs_done = self._done_base + ev.runs_done.count
                        if self._runs_done >= self._runs_sent:
                            self._handed.clear()  # every run handed so far is over
                        self._progress.notify_all()
                elif kind == "slice_changed":
                    vs = self.slices.get(ev.slice_changed.slice.name)
                    if vs is not None:
                        vs._update(ev.slice_changed.slice)
                elif kind == "going_away":
                    going_away = ev.going_away
                elif kind == "error":
                    raise _Lost(ev.error, final=True)
        except PathwaysError as e:
            if self.closed:
                return
            if not self._welcome.done():  # never connected: the usual one-line advice
                raise _Lost(str(e), final=True) from None
            code = e.code.name.lower() if e.code is not None else "error"
            raise _Lost(going_away or f"{code} {e.details}".strip()) from None
        if not self.closed:
            raise _Lost(going_away or "the server ended the session")

    # ---- resuming the session ----
    def _next_stream(self) -> tuple[int, threading.Event, threading.Event]:
        """Ends the current stream's sender (it hands on what it took) and opens a generation."""
        with self._gen_lock:
            self._gen += 1
            gen = self._gen
        self._ready.set()  # a sender waiting for its Welcome looks again, and ends
        self._out.put(_WAKE)
        self._sender_done.wait(1.0)  # a sender blocked on the queue wakes; one stuck in gRPC never takes more
        self._ready = threading.Event()
        self._sender_done = threading.Event()
        return gen, self._ready, self._sender_done

    # ---- hooks for Resume (resume.py) ----
    def _strand_handed(self) -> None:
        """The runs handed to the stream that broke are uncertain, and over for the bound on runs
        in flight (calls waiting for room go on)."""
        with self._progress:
            for run_id, outputs in self._handed:
                self.resume.strand(run_id, outputs)
            self._handed.clear()
            self._done_base = self._handed_total
            self._runs_done = max(self._runs_done, self._done_base)
            self._progress.notify_all()

    def _open_stream(self) -> tuple[Any, threading.Event]:
        """A new stream that resumes the session: its call, and the event that lets its sender
        go on past the hello and the registrations (set once the session is resumed)."""
        gen, ready, done = self._next_stream()
        hello = cpb.Hello()
        hello.CopyFrom(self._hello)
        hello.resume_client_id, hello.resume_token = self.client_id, self._resume_token
        first = [cpb.ClientMessage(hello=hello), *self._registrations()]
        return self.client.session(self._requests(gen, first, ready, done)), ready

    def _registrations(self) -> list[cpb.ClientMessage]:
        """What a resumed session sends first: every program registered before, with its
        functions' bytes (a new controller has none), then the registrations still unanswered."""
        out = []
        for graph, functions in list(self._programs.values()):
            infos = [cpb.FunctionInfo(function_id=f.function_id, name=f.name, donate=list(f.donate),
                                      exported=f.exported) for f in functions]
            out.append(cpb.ClientMessage(register=cpb.RegisterProgram(request_id=self.new_id(), graph=graph,
                                                                      functions=infos)))
        out.extend(self._pending_msgs.values())
        return out

    def _resumed(self, call: Any, welcome: cpb.Welcome) -> None:
        """The session goes on on `call`, whose Welcome this is."""
        self._welcomed(welcome)
        self._call = call

    def _queued(self) -> list[object]:
        """Everything queued for the next stream, in order; no stream takes from the queue until
        its `ready` is set."""
        with self._gen_lock:
            while True:
                try:
                    self._carry.append(self._out.get_nowait())
                except queue.Empty:
                    break
            return list(self._carry)

    def _fail_run(self, run_id: int, error: str) -> None:
        """A queued run that will not be sent fails here (its futures report `error`)."""
        self._failed_runs[run_id] = error

    def _requeue(self, keep: list[object], failed_runs: int) -> None:
        """Only `keep` stays queued: `failed_runs` runs were taken out, never sent, so over."""
        with self._gen_lock:
            self._carry = deque(keep)
        with self._progress:
            self._done_base += failed_runs
            self._runs_done += failed_runs
            self._progress.notify_all()

    # ---- programs ----
    def register(self, graph: cpb.ProgramGraph, functions: list[Any]) -> str:
        """Registers a program graph in one round trip: functions this runtime registered before
        go by id alone, the others with their bytes. Should the server lack some anyway (a
        restarted controller), it names them and a second round trip sends their bytes."""
        known = self.known_functions
        infos = [cpb.FunctionInfo(function_id=f.function_id, name=f.name, donate=list(f.donate),
                                  exported=b"" if f.function_id in known else f.exported)
                 for f in functions]
        reply = self._register_once(graph, infos)
        if reply.missing_functions:
            missing = set(reply.missing_functions)
            infos = [
                cpb.FunctionInfo(function_id=f.function_id, name=f.name, donate=list(f.donate),
                                 exported=f.exported if f.function_id in missing else b"")
                for f in functions
            ]
            reply = self._register_once(graph, infos)
        if reply.error:
            raise ProgramError(reply.error)
        if reply.missing_functions:
            raise ProgramError("the server did not accept the compiled functions")
        known.update(f.function_id for f in functions)
        self._programs[reply.program_id] = (graph, list(functions))
        return reply.program_id

    def _register_once(self, graph: cpb.ProgramGraph, infos: list[cpb.FunctionInfo]) -> cpb.ProgramRegistered:
        request_id = self.new_id()
        fut: CFuture[cpb.ProgramRegistered] = CFuture()
        self._pending[request_id] = fut
        msg = cpb.ClientMessage(register=cpb.RegisterProgram(request_id=request_id, graph=graph, functions=infos))
        self._pending_msgs[request_id] = msg
        self.send(msg)
        return fut.result(timeout=300 + self.reconnect_s)

    def run_failed(self, run_id: int) -> str:
        return self._failed_runs.get(run_id, "") or self._session_error

    def release(self, buffer_id: int, address: str) -> None:
        if self.closed or self._session_error:
            return
        self._out.put(Release(buffer_id, address))

    def _drain(self, timeout: float) -> None:
        """Waits up to `timeout` for the runs in flight to be reported over (close)."""
        deadline = time.monotonic() + timeout
        with self._progress:
            while self._runs_done < self._runs_sent and not self._session_error:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._progress.wait(left)

    # ---- workers ----
    def worker(self, address: str) -> WorkerClient:
        with self._workers_lock:
            conn = self._workers.get(address)
            if conn is None:
                conn = self._workers[address] = WorkerClient(address, self.client.token, self._credential,
                                                             on_lost=self._uploads_lost, wanted=self._upload_wanted)
            return conn

    def _upload_wanted(self, upload: Upload) -> bool:
        """Whether an upload a worker did not acknowledge is still worth sending again
        (worker_client.py): not once its run failed (the controller failed it, say for the loss
        of the worker's host, or another of its inputs was lost), as nothing reads it then."""
        return not (upload.run_id and upload.run_id in self._failed_runs)

    def _uploads_lost(self, uploads: list[Upload], error: str) -> None:
        """Uploads a worker will not get (worker_client.py): the runs reading them fail at once,
        here and on the controller, rather than when its hang detection gives up on them. Each
        run is cancelled once, however many of its inputs are lost, on however many workers
        (each worker's client reports from a thread of its own)."""
        cancels = []
        with self._lost_lock:
            for upload in uploads:
                if upload.run_id and upload.run_id not in self._failed_runs:  # a run's first lost input names it
                    reason = f"input buffer {upload.buffer_id:#x} of this run was lost: {error}"
                    self._fail_run(upload.run_id, reason)
                    cancels.append(cpb.CancelRun(run_id=upload.run_id, reason=reason))
        # and on the controller, which drops it on its workers: its tasks fail now rather than
        # wait for the input until the hang timeout (the run's RunFinished says the same)
        if not (self.closed or self._session_error):
            for cancel in cancels:
                self._out.put(cpb.ClientMessage(cancel_run=cancel))

    def close(self) -> None:
        if self.closed:
            return
        self._drain(CLOSE_DRAIN_S)
        self.closed = True
        self._out.put(_STOP)
        for conn in list(self._workers.values()):
            conn.close()
        try:
            self._call.cancel()
        except Exception:
            pass
        self.client.close()
