"""The client runtime: one per process, shared by every `pw` object.

It keeps one long-lived Session stream to the controller. Outgoing messages go into a
queue that a sender drains into batches, so a loop of calls costs one message per
batch and never waits for a reply (the client chooses run and buffer ids itself).
Array bytes go straight to, and come straight from, the workers.

The session outlives a controller restart: when the stream breaks, `Resume` (resume.py) opens
it again and resumes the session, through a few hooks of the runtime's. The parts apart: the
stream's sender and its generations (sender.py, `Sender`), the packing of a batch (packing.py),
program registration (registration.py, `Registrations`); the runtime keeps the reader of the
stream's events, the bound on runs in flight, the runs failed and the connections to workers.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future as CFuture
from typing import Any

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from ..client import Client
from ..errors import ConnectionFailed, PathwaysError
from ..worker_client import Upload, WorkerClient
from .bounded import Bounded
from .env import env_amount, env_dispatch, env_priority, env_weight, keep_local_jax_on_cpu
from .packing import Release
from .registration import Registrations
from .replan import Replans
from .resume import RECONNECT_S, Resume
from .sender import STOP, Sender
from .whereabouts import Whereabouts

log = logging.getLogger(__name__)

# Failed runs remembered (their errors, for the futures of those runs); older ones are forgotten,
# and a future of a forgotten run reports the worker's own error for its buffer instead.
MAX_FAILED_RUNS = 4096
# Runs sent but not known to be over, before a call blocks (PWCTL_MAX_IN_FLIGHT; 0: no bound). A
# loop that calls without ever waiting would otherwise queue work (and its inputs) without limit;
# JAX blocks its async dispatch the same way.
MAX_IN_FLIGHT = 1024
# How long closing (at exit) waits for the runs still in flight to be reported over before the
# session ends (which cancels them): a program that exits right after fetching its last result
# has its earlier runs finished on the workers, and their reports on the way; they count as done,
# not cancelled. A program exiting with work still running waits this long at most.
CLOSE_DRAIN_S = 2.0
# How long closing waits, at most, for the threads of the session and the uploads to end once their
# calls are cancelled (they end within milliseconds: the bound is for a thread stuck elsewhere).
CLOSE_THREADS_S = 2.0


class _Lost(Exception):
    """The session stream ended; `reason` says why (reconnect, unless `final`); `error`: the
    controller's refusal, typed (before the welcome: the caller gets it as it is)."""

    def __init__(self, reason: str, final: bool = False, error: PathwaysError | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.final = final
        self.error = error


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
        # the session's, read first: a bad one is said in one line before anything is opened
        priority = env_priority(os.environ.get("PWCTL_PRIORITY", ""))
        weight = env_weight(os.environ.get("PWCTL_WEIGHT", ""))
        dispatch = env_dispatch(os.environ.get("PWCTL_DISPATCH", ""))
        self.client = Client(server=server)
        self.job_id = os.environ.get("PWCTL_JOB_ID", "")
        self.closed = False
        self._out: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._welcome: CFuture[cpb.Welcome] = CFuture()
        self._sender = Sender(self._out, lambda: self.closed)
        self.registrations = Registrations(self)
        self._failed_runs: Bounded[int, str] = Bounded(MAX_FAILED_RUNS)  # run -> its error
        self._lost_lock = threading.Lock()  # one cancel_run per run, whichever worker lost its inputs
        self.max_in_flight = env_amount("PWCTL_MAX_IN_FLIGHT", os.environ.get("PWCTL_MAX_IN_FLIGHT", ""),
                                        MAX_IN_FLIGHT, int, "a number of runs (0: no bound)")
        self._runs_sent = 0
        self._runs_done = 0  # as the controller last reported (RunsDone)
        self._progress = threading.Condition()
        self._session_error = ""
        self._refused: PathwaysError | None = None  # the session refused before its welcome (`_follow`)
        self._workers: dict[str, WorkerClient] = {}
        self._workers_lock = threading.Lock()
        # lost and suspect workers, and lookups at the controller (whereabouts.py); whether a slice's
        # worker is one of them (as this runtime last heard): a call then reads its slices again
        # first (`catch_up`). `lost_workers`: address -> why, its host declared lost.
        self.where = Whereabouts(self)
        self.lost_workers = self.where.lost
        self.on_lost_worker = False
        self.slices: dict[str, Any] = {}  # name -> VirtualSlice, refreshed on SliceChanged
        # runs refused for their plan, sent again (replan.py): calls read their futures' homes and
        # send under `plan_lock`, as a re-sending does; with a controller that checks the slice
        # generations a run was planned with (Welcome.checks_generations), a run is kept until it
        # says it handled it
        self.plan_lock = threading.Lock()
        self.replans = Replans(self, self.plan_lock)
        self.checks_generations = False
        self.reconnect_s = env_amount("PWCTL_RECONNECT_S", os.environ.get("PWCTL_RECONNECT_S", ""),
                                      RECONNECT_S, float, "seconds (0: never reconnect)")
        self._done_base = 0  # runs over before the current stream (its RunsDone counts from there)
        self.resume = Resume(self)  # across controller restarts; what is known of runs in flight at one
        self._resume_token = ""
        self.client_id = ""
        self._hello = cpb.Hello(
            client_name=f"pid-{os.getpid()}",
            job_id=self.job_id,
            job_secret=os.environ.get("PWCTL_JOB_SECRET", "") if self.job_id else "",  # proves it is the driver
            priority=priority,
            weight=weight,
            dispatch=dispatch,
            ack_releases=True,  # releases not acknowledged are sent again on resuming (sender.py)
        )
        sender = self._sender
        # the session's current stream (let go of by close)
        self._call: Any = self.client.session(sender.requests(0, [cpb.ClientMessage(hello=self._hello)], sender.ready,
                                                              sender.done))
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
        self._sender.set_acks(welcome.acks_releases)
        self.checks_generations = welcome.checks_generations
        if not welcome.checks_generations:  # it will not say which it handled
            self.replans.forget()

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

    # ---- incoming ----
    def _read(self) -> None:
        """The session thread: reads the stream's events, resuming the session when it breaks.

        Closing (`close`, at exit) may come at any point of it, resuming included: it closes the
        channel and the workers' connections under this thread, whose next call then fails
        (gRPC's ValueError for a closed channel, say). The thread then ends quietly: the program
        exits as it would have, its exit status unchanged (its one line about the lost session,
        if it lost it, was said already: resume.py)."""
        try:
            self._follow(iter(self._call))
        except Exception as e:
            if self.closed:
                return
            # not closing: a fault of this thread's own; calls fail with it rather than wait
            self._session_error = f"the session with the server at {self.client.address} ended: {type(e).__name__}: {e}"
            raise
        finally:
            with self._progress:  # calls waiting for room see the session's end
                self._progress.notify_all()
            if not self._welcome.done():
                self._welcome.set_exception(self._refused or ConnectionFailed(self._session_error or "session closed"))
            self.registrations.session_over(self._session_error or "session closed")
            self.replans.session_over()  # waits for the controller's answer to a run end

    def _follow(self, events: Iterator[cpb.SessionEvent]) -> None:
        """Serves the session's streams, one after another as it is resumed, until it ends."""
        while True:
            try:
                self._serve(events)
                return  # closed by us
            except _Lost as lost:
                if self.closed:
                    return
                if lost.final or not self._welcome.done():
                    self._session_error, self._refused = lost.reason, lost.error
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

    def _serve(self, events: Iterator[cpb.SessionEvent]) -> None:
        """Handles a stream's events; raises _Lost when it ends (returns when we closed it)."""
        going_away = ""
        try:
            for ev in events:
                kind = ev.WhichOneof("msg")
                if kind == "welcome":
                    self._welcomed(ev.welcome)
                    self._welcome.set_result(ev.welcome)
                    self._sender.ready.set()
                elif kind == "registered":
                    self.registrations.answered(ev.registered)
                elif kind == "finished":
                    fin = ev.finished
                    if not fin.ok and (error := self.replans.refused(fin) if fin.replan else fin.error) is not None:
                        self._fail_run(fin.run_id, error)  # (None: refused for its plan, sent again)
                elif kind == "runs_done":
                    if ev.runs_done.last_run:
                        self.replans.handled(ev.runs_done.last_run)
                    with self._progress:
                        self._runs_done = self._done_base + ev.runs_done.count
                        if self._runs_done >= self._runs_sent:
                            self._sender.handed.clear()  # every run handed so far is over
                        self._progress.notify_all()
                elif kind == "slice_changed":
                    vs = self.slices.get(ev.slice_changed.slice.name)
                    if vs is not None:
                        self.where.streamed(vs, ev.slice_changed.slice)
                elif kind == "releases_done":
                    self._releases_arrived(self._sender.releases_arrived(ev.releases_done))
                elif kind == "host_lost":
                    self._host_lost(ev.host_lost)
                elif kind == "going_away":
                    going_away = ev.going_away
                elif kind == "error":
                    raise _Lost(ev.error, final=True)
        except PathwaysError as e:
            if self.closed:
                return
            if not self._welcome.done():  # never connected, or refused: its type (exit status) kept
                raise _Lost(str(e), final=True, error=e) from None
            code = e.code.name.lower() if e.code is not None else "error"
            raise _Lost(going_away or f"{code} {e.details}".strip()) from None
        if not self.closed:
            raise _Lost(going_away or "the server ended the session")

    # ---- hooks for Resume (resume.py) ----
    def _next_stream(self) -> tuple[int, threading.Event, threading.Event]:
        """Ends the current stream's sender (it hands on what it took) and opens a generation."""
        return self._sender.next_stream()

    def _strand_handed(self) -> None:
        """The runs handed to the stream that broke are uncertain, and over for the bound on runs
        in flight (calls waiting for room go on)."""
        with self._progress:
            for run_id, outputs in self._sender.handed:
                self.resume.strand(run_id, outputs)
            self._sender.handed.clear()
            self._done_base = self._sender.handed_total
            self._runs_done = max(self._runs_done, self._done_base)
            self._progress.notify_all()

    def _open_stream(self) -> tuple[Any, threading.Event]:
        """A new stream that resumes the session: its call, and the event that lets its sender
        go on past the hello and the registrations (set once the session is resumed)."""
        gen, ready, done = self._next_stream()
        hello = cpb.Hello()
        hello.CopyFrom(self._hello)
        hello.resume_client_id, hello.resume_token = self.client_id, self._resume_token
        self._sender.releases_again()  # once the session is resumed (sender.py)
        first = [cpb.ClientMessage(hello=hello), *self.registrations.again()]
        return self.client.session(self._sender.requests(gen, first, ready, done)), ready

    def _resumed(self, call: Any, welcome: cpb.Welcome) -> None:
        """The session goes on on `call`, whose Welcome this is."""
        self._welcomed(welcome)
        self._call = call

    def _queued(self) -> list[object]:
        """Everything queued for the next stream, in order; no stream takes from the queue until
        its `ready` is set."""
        return self._sender.queued()

    def _fail_run(self, run_id: int, error: str) -> None:
        """Run `run_id` failed (its futures report `error`): reported so by the controller, or
        failed here (a queued run not sent after a restart, a run whose input upload was lost).
        The last MAX_FAILED_RUNS are remembered (`_failed_runs` is bounded)."""
        self._failed_runs[run_id] = error

    def _requeue(self, keep: list[object], failed_runs: int) -> None:
        """Only `keep` stays queued: `failed_runs` runs were taken out, never sent, so over."""
        self._sender.requeue(keep)
        with self._progress:
            self._done_base += failed_runs
            self._runs_done += failed_runs
            self._progress.notify_all()

    # ---- programs ----
    @property
    def known_functions(self) -> set[str]:
        """Ids of the functions the server accepted from this runtime."""
        return self.registrations.known_functions

    def register(self, graph: cpb.ProgramGraph, functions: list[Any]) -> str:
        """Registers a program graph (registration.py); returns its program id."""
        return self.registrations.register(graph, functions)

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
    def lost_host(self, address: str) -> str:
        """Whether the controller declared the host of the worker at `address` lost: why ("host
        NAME was lost"), or "" (not lost, or the controller did not answer). Asked when that worker
        stops answering (futures.py `_poll`): a frozen host keeps its connections open, so only the
        controller's verdict ends the wait."""
        return self.where.lost_host(address)

    def still_lost(self, address: str) -> str:
        """For a worker in `lost_workers`: why, while the controller still has its host lost (a
        call to it fails at once: futures.py `_poll`); "" once it is ready again (whereabouts.py)."""
        return self.where.still_lost(address)

    def catch_up(self, names: set[str]) -> None:
        """Before a call on slices `names` while a worker is lost or suspect: reads those slices
        again from the controller (whereabouts.py `Whereabouts.catch_up`)."""
        self.where.catch_up(names)

    def _host_lost(self, lost: cpb.HostLost) -> None:
        """The controller declared a host lost: the calls waiting at its worker end now, naming
        it (futures.py `_poll` raises their error), not at their deadline; later calls to it fail
        at once while it stays lost (`lost_workers`). Not for a loss older than the slice placed
        at that address again that `catch_up` read (whereabouts.py)."""
        why = self.where.host_lost(lost)
        with self._workers_lock:
            conn = self._workers.get(lost.address)
        if conn is not None and why:
            conn.abandon(why)

    def worker(self, address: str) -> WorkerClient:
        """The connection to the worker at `address` (opened at the first call). None is opened
        once the runtime is closed (its session thread still resuming, say): close() would not
        close it, and its calls would be left to the interpreter's finalization."""
        with self._workers_lock:  # (close() takes the connections to close under it, once closed)
            if self.closed:
                raise ConnectionFailed(f"the pw runtime's session with the server at {self.client.address} is closed")
            conn = self._workers.get(address)
            if conn is None:
                conn = self._workers[address] = WorkerClient(address, self.client.token, self._credential,
                                                             on_lost=self._uploads_lost, wanted=self._upload_wanted,
                                                             tls=self.client.tls, on_ended=self.where.worker_ended)
            return conn

    def _upload_wanted(self, upload: Upload) -> bool:
        """Whether an upload a worker did not acknowledge is still worth sending again
        (worker_client.py): not once its run failed (the controller failed it, say for the loss
        of the worker's host, or another of its inputs was lost), as nothing reads it then; nor
        once its release reached the worker (`released`): the controller sent it on only once
        the run was over (its reader; `execute` releases each upload right after its run). Sent
        again, a worker restarted at that address since would keep it until the session ends.
        Unless the run was in flight at a controller restart (uncertain, resume.py): the release
        sent again then passed a new controller that never knew the run, which a worker may
        still hold, waiting for this input."""
        if upload.run_id and (upload.run_id in self._failed_runs or upload.run_id in self.replans.replanned):
            return False
        return not (upload.released and not self.resume.is_uncertain(upload.run_id))

    def _releases_arrived(self, releases: list[wpb.ReleaseBuffers]) -> None:
        """The controller says these release messages reached their workers: the uploads among
        them that a worker did not acknowledge are marked (`_upload_wanted`)."""
        with self._workers_lock:
            uploading = {address: conn for address, conn in self._workers.items() if conn.uploading()}
        if not uploading:  # every upload acknowledged: the usual case, nothing to look at
            return
        ids: dict[WorkerClient, list[int]] = {}  # one call per worker, however many messages
        for release in releases:
            conn = uploading.get(release.address)
            if conn is not None:
                ids.setdefault(conn, []).extend(release.buffer_ids)
        for conn, buffer_ids in ids.items():
            conn.released(buffer_ids)

    def _uploads_lost(self, uploads: list[Upload], error: str) -> None:
        """Uploads a worker will not get (worker_client.py): the runs reading them fail at once,
        here and on the controller, rather than when its hang detection gives up on them. Each
        run is cancelled once, however many of its inputs are lost, on however many workers
        (each worker's client reports from a thread of its own)."""
        cancels = []
        with self._lost_lock:
            for upload in uploads:
                if (upload.run_id and upload.run_id not in self._failed_runs  # a run's first lost input names it
                        and upload.run_id not in self.replans.replanned):  # sent again elsewhere
                    reason = f"input buffer {upload.buffer_id:#x} of this run was lost: {error}"
                    self._fail_run(upload.run_id, reason)
                    cancels.append(cpb.CancelRun(run_id=upload.run_id, reason=reason))
        # and on the controller, which drops it on its workers: its tasks fail now rather than
        # wait for the input until the hang timeout (the run's RunFinished says the same)
        if not (self.closed or self._session_error):
            for cancel in cancels:
                self._out.put(cpb.ClientMessage(cancel_run=cancel))

    def close(self) -> None:
        """Ends the session (at exit: registered with atexit) and everything it started.

        It returns once the threads reading the session and the upload streams have ended
        (within CLOSE_THREADS_S) and the gRPC call objects are collected. At interpreter exit,
        atexit handlers run while daemon threads still do; after them, finalization freezes every
        daemon thread where it stands, holding whatever lock it held. A gRPC stream's call
        object, collected then, takes its call's lock (grpc `_MultiThreadedRendezvous.__del__`),
        which one of gRPC's threads, or ours, may hold frozen: the process then hangs after its
        last line. Collected here, while they run, it only waits for them to let go."""
        if self.closed:
            return
        self._drain(CLOSE_DRAIN_S)
        self.closed = True
        self._out.put(STOP)
        with self._workers_lock:  # none opened from now on (`worker`)
            workers = list(self._workers.values())
        for conn in workers:
            conn.close()
        try:
            self._call.cancel()
        except Exception:
            pass
        self.client.close()
        self.where.close()
        deadline = time.monotonic() + CLOSE_THREADS_S
        if self._reader is not threading.current_thread():
            self._reader.join(CLOSE_THREADS_S)
        for conn in workers:
            conn.join(max(0.0, deadline - time.monotonic()))
        self._call = None
        gc.collect()  # the calls' objects sit in reference cycles (their exceptions' tracebacks)
