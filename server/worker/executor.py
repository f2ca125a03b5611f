"""The worker's executor: runs enqueued tasks in gang order on its devices.

A task is one run's execution of a registered segment (consecutive program nodes on this
worker; see server/controller/segments.py) and holds one seq of this worker's gang order.
One thread launches tasks strictly in seq order (the island's gang order), never from gRPC
handler threads (docs/facts.md, "JAX on CPU": JAX blocks the launching thread when ~32 computations are in
flight). A launch waits only for its inputs; results are stored as JAX arrays still being
computed, so computations without collectives pipeline through JAX's async dispatch. A
computation with a collective starts only after everything in flight on its devices
completed: on CPU, two collective computations in flight at once deadlock.

A second thread waits for completions in launch order, sends outputs to consumers on other
workers, and reports one event per task (batched by the caller of `report`).
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from ..threadnames import name_native_thread
from .buffers import BufferFailed, BufferStore
from .executable import Executable, ExecutableCache
from .fusion import FusedExecutable, NodeFailed, Runner, Segment, run_parts, run_unfused
from .transfer import TransferSender

log = logging.getLogger(__name__)


class _Skip:
    """A seq given to a task that will never be sent: it counts as done."""


_SKIP = _Skip()


@dataclass
class SegmentInfo:
    """A registered segment and what the worker derives from it once."""

    definition: wpb.SegmentDef
    structure: Segment
    labels: list[str]
    routes: list[wpb.OutputRoute]
    communicates: bool | None = None  # known once its executables exist
    runner: Runner | None = None
    fused: bool = False  # its runner fuses nodes and its first launch has not succeeded yet
    error: str = ""  # why it cannot run (compile error), once known
    out_nbytes: list[int] | None = None  # per output, read off its first launch (shapes are static)
    donates: bool = False  # a node of it donates inputs (known once its runner exists)

    @classmethod
    def of(cls, d: wpb.SegmentDef) -> SegmentInfo:
        return cls(d, Segment.of(d), [n.label for n in d.nodes], list(d.routes))

    @property
    def label(self) -> str:
        return self.definition.label

    @property
    def size(self) -> int:
        return len(self.definition.nodes)


@dataclass
class _Task:
    run_id: int
    segment: int
    seq: int
    input_ids: list[int]
    output_ids: list[int]
    info: SegmentInfo | None  # None: the segment was never registered here (reported at launch)
    label: str
    prompt: bool = False  # the controller waits for its end (sequential dispatch)


@dataclass
class _Launched:
    task: _Task
    info: SegmentInfo
    values: list[Any]  # one per output id
    start_ns: int
    devices: frozenset[int]
    nbytes: int  # of the outputs
    reported_start: bool = False


class Executor:
    def __init__(
        self,
        store: BufferStore,
        devices: Sequence[Any],
        report: Callable[[list[cpb.NodeEvent], bool, int | None, int], None],
        sender: TransferSender,
    ) -> None:
        self.store = store
        self.devices = list(devices)
        self.report = report
        self.sender = sender
        self.cache = ExecutableCache()
        self._functions: dict[str, wpb.FunctionBlob] = {}
        self._segments: dict[int, SegmentInfo] = {}
        self._cond = threading.Condition()
        self._pending: dict[int, _Task | _Skip] = {}
        self._next_seq = 1
        self._dropped: dict[int, str] = {}
        self._inflight: dict[int, _Launched] = {}
        # fused executables by structure, while a registered segment still uses them (segments
        # of different programs with one structure share one)
        self._fused: weakref.WeakValueDictionary[Segment, FusedExecutable] = weakref.WeakValueDictionary()
        # PATHWAYS_FUSE=0 runs a segment's nodes one by one (debugging, benchmarks)
        self.fuse = os.environ.get("PATHWAYS_FUSE", "1") != "0"
        self._busy_until: dict[frozenset[int], int] = {}  # device set -> end of its last batch (ns)
        self._deferred: dict[int, _Task] = {}  # tasks waiting for an input (launch thread only)
        self._ready: list[int] = []  # deferred tasks whose inputs all arrived (under _cond)
        self._next_token = 0
        self._done_q: queue.Queue[_Launched | None] = queue.Queue()
        self._stop = False
        self.nodes_executed = 0
        # tasks received and tasks over, for the backlog: each counter has one writer (the event
        # loop; the completion thread; failures, under their lock)
        self._received = 0
        self._completed = 0
        self._failed = 0
        self._failed_lock = threading.Lock()
        self.recent_order: deque[tuple[int, int, int]] = deque(maxlen=1000)  # (run, segment, seq)
        self._threads = [
            threading.Thread(target=self._launch_loop, name="pw-executor", daemon=True),
            threading.Thread(target=self._complete_loop, name="pw-completer", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- called from the controller link (event loop thread) ----
    def reset(self, reason: str) -> None:
        """A new registration: sequence numbers restart, segment ids are the new controller's;
        work of the old epoch fails."""
        with self._cond:
            stale = [t for t in self._pending.values() if isinstance(t, _Task)]
            stale += list(self._deferred.values())
            self._deferred.clear()
            self._pending.clear()
            self._segments.clear()
            self._next_seq = 1
            self._cond.notify_all()
        for task in stale:
            self._fail(task, reason, report=False)

    def submit(self, enq: wpb.Enqueue) -> None:
        for blob in enq.functions:
            self._functions[blob.function_id] = blob
        for d in enq.segments:
            try:
                self._segments[d.segment_id] = SegmentInfo.of(d)
            except ValueError as e:
                log.error("bad segment definition: %s", e)
        with self._cond:
            for t in enq.tasks:
                info = self._segments.get(t.segment_id)
                task = _Task(t.run_id, t.segment, t.seq, list(t.input_ids), list(t.output_ids), info,
                             info.label if info is not None else f"segment {t.segment}", t.report_promptly)
                self.store.expect(task.output_ids, t.owner, t.output_visible)
                readers = task.input_ids
                if info is not None and info.routes:  # outputs sent to other workers are read once more
                    outs = task.output_ids
                    readers = readers + [outs[r.output_index] for r in info.routes if r.output_index < len(outs)]
                self.store.add_consumers(readers, t.owner)
                self._pending[t.seq] = task
            self._received += len(enq.tasks)
            self._cond.notify_all()
        for sid in enq.forget_segments:  # after the tasks above took their definitions
            self._segments.pop(sid, None)
        for send in enq.sends:
            self.store.add_consumers((send.buffer_id,))
            self.store.on_settled(send.buffer_id, functools.partial(self._send_buffer, send))

    def backlog(self) -> int:
        """Tasks received and not over yet: queued, waiting for inputs, or computing."""
        return max(0, self._received - self._completed - self._failed)

    @property
    def segment_count(self) -> int:
        return len(self._segments)

    def drop(self, run_ids: Sequence[int], reason: str, skipped_seqs: Sequence[int] = ()) -> None:
        """Fails the tasks of these runs that have not run, unblocking any wait on them.

        `skipped_seqs` were assigned to tasks that will never be sent: they count as done.
        """
        with self._cond:
            for seq in skipped_seqs:
                if seq >= self._next_seq and seq not in self._pending:
                    self._pending[seq] = _SKIP
            self._cond.notify_all()
            for r in run_ids:
                self._dropped[r] = reason
            victims = [t for t in self._pending.values() if isinstance(t, _Task) and t.run_id in self._dropped]
            victims += [t for t in list(self._deferred.values()) if t.run_id in self._dropped]
            if len(self._dropped) > 10_000:
                for r in list(self._dropped)[:5_000]:
                    del self._dropped[r]
        for task in victims:
            for inp in task.input_ids:
                self.store.fail(inp, reason)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._done_q.put(None)

    # ---- launch thread ----
    def _launch_loop(self) -> None:
        name_native_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._next_seq in self._pending or bool(self._ready))
                if self._stop:
                    return
                ready, self._ready = self._ready, []
                batch = []  # every consecutive seq available now: one lock round trip
                while self._next_seq in self._pending:
                    batch.append(self._pending.pop(self._next_seq))
                    self._next_seq += 1
            for token in ready:  # deferred tasks whose inputs arrived
                deferred = self._deferred.pop(token, None)
                if deferred is not None:
                    self._launch_safely(deferred)
            for task in batch:
                if not isinstance(task, _Task):
                    continue
                dropped = self._dropped.get(task.run_id)
                if dropped is not None:
                    self._fail(task, dropped)
                elif self._communicates(task):
                    self._barrier()  # collectives keep the gang order exactly
                    self._launch_safely(task)
                elif not self._defer_if_waiting(task):
                    self._launch_safely(task)

    def _launch_safely(self, task: _Task) -> None:
        try:
            self._launch(task)
        except Exception as e:  # a bug here must not kill the worker
            log.exception("launching %s failed", task.label)
            self._fail(task, f"{type(e).__name__}: {e}")

    # Gang order binds computations that communicate: a task with a collective starts only
    # after every earlier task was launched (and, in _drain, completed on its devices). A task
    # without one only reads buffers, so when an input has not arrived yet (a transfer from
    # another island) it is set aside and launched when the input lands, and the tasks behind
    # it go on: micro-batches of a pipeline overlap instead of queueing behind each other's
    # transfers. Every wait still points to an earlier task of the global order, so this
    # cannot deadlock either.
    #
    # Whether a task communicates is read from its compiled programs (the client's flag is a
    # conservative guess made before SPMD partitioning: a data-sharded elementwise pw.jit has no
    # collective once compiled, and need not wait for everything in flight on its devices).
    def _communicates(self, task: _Task) -> bool:
        info = task.info
        if info is None:
            return False
        if info.communicates is None:
            try:
                info.communicates = any(e.has_collectives for e in self._node_executables(info))
            except Exception:
                return info.definition.collective  # its launch reports the compile error
        return info.communicates

    def _defer_if_waiting(self, task: _Task) -> bool:
        missing = self.store.pending_of(task.input_ids)
        if not missing:
            return False
        token = self._next_token
        self._next_token += 1
        self._deferred[token] = task
        left = [len(missing)]
        lock = threading.Lock()

        def arrived() -> None:
            with lock:
                left[0] -= 1
                done = left[0] == 0
            if done:
                with self._cond:
                    self._ready.append(token)
                    self._cond.notify_all()

        for b in missing:
            self.store.on_settled(b, arrived)
        return True

    def _barrier(self) -> None:
        """Launches every deferred task (waiting for their inputs) before a collective."""
        while self._deferred:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or bool(self._ready))
                if self._stop:
                    return
                ready, self._ready = self._ready, []
            for token in ready:
                task = self._deferred.pop(token, None)
                if task is not None:
                    self._launch_safely(task)

    def _inputs_of(self, run_id: int, input_ids: Sequence[int]) -> list[Any]:
        """Input values, waiting for those still pending (re-checking for a drop)."""
        while True:
            try:
                return self.store.wait_all(input_ids, timeout=0.5)  # no wait when they are all ready
            except TimeoutError:
                reason = self._dropped.get(run_id)
                if reason is not None:
                    raise BufferFailed(reason) from None

    def _launch(self, task: _Task) -> None:
        info = task.info
        if info is None:
            self._fail(task, "its segment was never registered on this worker")
            return
        if len(task.input_ids) != info.structure.num_inputs or len(task.output_ids) != len(info.structure.keep):
            self._fail(task, f"the task has {len(task.input_ids)} inputs and {len(task.output_ids)} outputs; "
                             f"its segment takes {info.structure.num_inputs} and gives {len(info.structure.keep)}")
            return
        try:
            inputs = self._inputs_of(task.run_id, task.input_ids)
        except BufferFailed as e:
            self._fail(task, f"an input failed: {e}")
            return
        try:
            runner = self._runner(info)
        except Exception as e:
            self._fail(task, str(e))
            return
        devices = frozenset(info.structure.devices)
        if info.communicates:
            self._drain(devices)
        start = time.time_ns()
        try:
            values = runner(inputs)
        except Exception as e:
            if info.fused:  # its first launch: maybe it does not fuse; run its nodes one by one
                log.info("fused segment %s failed (%s); running its nodes one by one", info.label, e)
                for part in info.structure.parts():
                    self._fused.pop(part.segment, None)
                info.runner, info.fused = self._unfused_runner(info), False
                self._launch(task)
                return
            self._fail(task, str(e) if isinstance(e, NodeFailed) else f"{type(e).__name__}: {e}")
            return
        info.fused = False  # it launched: from now on a failure is the computation's, not fusion's
        if info.donates:  # its donated inputs are gone: later readers must fail, not crash XLA
            gone = [b for b, v in zip(task.input_ids, inputs, strict=False) if getattr(v, "is_deleted", bool)()]
            self.store.consumed(gone, f"buffer donated to {info.label}: it no longer exists (donate_argnums)")
        if info.out_nbytes is None:
            info.out_nbytes = [int(getattr(v, "nbytes", 0)) for v in values]
        nbytes = self.store.launched(task.output_ids, values, task.input_ids, info.out_nbytes)
        launched = _Launched(task, info, values, start, devices, nbytes)
        self._inflight[id(launched)] = launched
        self._done_q.put(launched)

    def _runner(self, info: SegmentInfo) -> Runner:
        """How the segment runs: per part (nodes on the same devices), its node's executable, a
        fused executable, or node by node; the parts one after the other."""
        if info.runner is not None:
            return info.runner
        seg = info.structure
        exes = self._node_executables(info)
        parts = seg.parts()
        runners, collective = [], []
        for part in parts:
            nodes = slice(part.first, part.first + len(part.segment.function_ids))
            runner, fused = self._part_runner(part.segment, exes[nodes], info.labels[nodes])
            runners.append(runner)
            collective.append(any(e.has_collectives for e in exes[nodes]))
            info.fused = info.fused or fused
        info.donates = any(e.donate for e in exes)
        if len(parts) == 1:
            info.runner = runners[0]
        else:
            info.runner = functools.partial(run_parts, seg, parts, runners, collective)
        return info.runner

    def _node_executables(self, info: SegmentInfo) -> list[Executable]:
        """Each node's executable on its devices; errors name the node."""
        seg = info.structure
        exes = []
        for fid, devs, label in zip(seg.function_ids, seg.node_devices, info.labels, strict=True):
            blob = self._functions.get(fid)
            if blob is None:
                raise RuntimeError(f"{label}: function {fid[:12]} was never sent to this worker")
            try:
                exes.append(self._executable(fid, devs))
            except Exception as e:
                raise RuntimeError(f"{label}: cannot compile {blob.name or fid[:12]}: {e}") from e
        return exes

    def _part_runner(self, seg: Segment, exes: list[Executable], labels: list[str]) -> tuple[Runner, bool]:
        """(runner, fused) for nodes on the same devices."""
        if len(exes) == 1 and seg.is_identity() and len(seg.keep) == len(exes[0].out_avals):
            return exes[0], False
        if self.fuse and len(exes) > 1 and not any(e.donate for e in exes):
            fused = self._fused.get(seg)
            if fused is None:
                try:
                    fused = FusedExecutable(seg, exes)
                except Exception as e:
                    log.info("not fusing %s: %s", ", ".join(labels), e)
            if fused is not None:
                self._fused[seg] = fused
                return fused, True
        return functools.partial(run_unfused, seg, exes, labels), False

    def _unfused_runner(self, info: SegmentInfo) -> Runner:
        return functools.partial(run_unfused, info.structure, self._node_executables(info), info.labels)

    def _executable(self, function_id: str, local_devices: tuple[int, ...]) -> Executable:
        """Looked up once per registered segment (its runner keeps what it needs)."""
        blob = self._functions[function_id]
        devices = [self.devices[i] for i in local_devices]
        return self.cache.get_or_compile(function_id, blob.exported, devices, tuple(blob.donate))

    def _drain(self, devices: frozenset[int]) -> None:
        """Waits for every in-flight computation that touches these devices."""
        busy = [launched.values for launched in list(self._inflight.values()) if launched.devices & devices]
        for outs in busy:
            try:
                jax.block_until_ready(outs)
            except Exception:
                pass  # its own completion reports the failure

    def stale_starts(self, older_than_s: float) -> list[cpb.NodeEvent]:
        """'Started' events for tasks running longer than `older_than_s` (for hang
        detection); quick tasks only ever report their completion."""
        cutoff = time.time_ns() - int(older_than_s * 1e9)
        out = []
        for launched in list(self._inflight.values()):
            if launched.start_ns < cutoff and not launched.reported_start:
                launched.reported_start = True
                t = launched.task
                out.append(cpb.NodeEvent(run_id=t.run_id, segment=t.segment, seq=t.seq, start_ns=launched.start_ns,
                                         local_devices=launched.info.structure.devices))
        return out

    def _fail(self, task: _Task, error: str, report: bool = True) -> None:
        message = error if error.startswith(task.label) or _names_a_node(task, error) else f"{task.label}: {error}"
        with self._failed_lock:
            self._failed += 1
        for out in task.output_ids:
            self.store.fail(out, message)
        for inp in task.input_ids:
            self.store.consumer_done(inp)
        routes = task.info.routes if task.info is not None else []
        for route in routes:
            if route.output_index < len(task.output_ids):
                out_id = task.output_ids[route.output_index]
                self.sender.send_error(out_id, route, message)
                self.store.consumer_done(out_id)
        if report:
            now = time.time_ns()
            devices = task.info.structure.devices if task.info is not None else ()
            self.report([cpb.NodeEvent(run_id=task.run_id, segment=task.segment, seq=task.seq, start_ns=now,
                                       end_ns=now, ok=False, error=message, local_devices=devices)],
                        task.prompt, self.backlog(), 0)

    # ---- completion thread ----
    def _complete_loop(self) -> None:
        name_native_thread()
        while True:
            first = self._done_q.get()
            if first is None:
                return
            batch = [first]
            while True:  # everything launched meanwhile completes with one wait
                try:
                    item = self._done_q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._finish(batch)
                    return
                batch.append(item)
            self._finish(batch)
            # the store decides when outputs are freed: hold no reference while idle
            first = item = None
            batch = []

    def _finish(self, batch: list[_Launched]) -> None:
        # Tasks whose outputs travel to other workers are waited for one by one, in launch order,
        # and their outputs leave as soon as they are ready: a pipeline stage's micro-batch k goes
        # to the next stage while micro-batch k+1 still computes (waiting for the whole batch
        # would make stages take turns). The rest complete with one wait.
        errors: list[str] = [""] * len(batch)
        for i, launched in enumerate(batch):
            if launched.info.routes:
                errors[i] = _wait(launched)
                self._send_outputs(launched, errors[i])
        try:
            jax.block_until_ready([launched.values for launched in batch if not launched.info.routes])
        except Exception:
            for i, launched in enumerate(batch):  # find which ones failed
                if not launched.info.routes:
                    errors[i] = _wait(launched)
        end = time.time_ns()
        # One wait completed the whole batch, so per-task times are not known: split the time the
        # batch's devices were busy over its tasks by their node counts, in launch order, per device
        # set (the controller charges device time from these spans; giving it all to the batch's first
        # task would bill one client for everyone's work and break proportional share).
        span_start: dict[frozenset[int], int] = {}
        counts: dict[frozenset[int], int] = {}
        for launched in batch:
            d = launched.devices
            span_start[d] = min(span_start.get(d, launched.start_ns), launched.start_ns)
            counts[d] = counts.get(d, 0) + launched.info.size
        cursor: dict[frozenset[int], float] = {}
        steps: dict[frozenset[int], float] = {}
        for d, first in span_start.items():
            cursor[d] = max(first, self._busy_until.get(d, 0))
            steps[d] = max(0, end - cursor[d]) / counts[d]
            self._busy_until[d] = end
        events = []
        for launched, error in zip(batch, errors, strict=True):
            self._inflight.pop(id(launched), None)
            task, info = launched.task, launched.info
            if error:
                for out in task.output_ids:
                    self.store.fail(out, error)
            self.recent_order.append((task.run_id, task.segment, task.seq))
            d = launched.devices
            span = steps[d] * info.size
            events.append(cpb.NodeEvent(
                run_id=task.run_id, segment=task.segment, seq=task.seq, start_ns=int(cursor[d]),
                end_ns=int(cursor[d] + span), ok=not error, error=error, local_devices=info.structure.devices))
            cursor[d] += span
            self.nodes_executed += info.size
        self._completed += len(batch)
        nbytes = sum(launched.nbytes for launched in batch)
        self.report(events, any(launched.task.prompt for launched in batch), self.backlog(), nbytes)

    def _send_outputs(self, launched: _Launched, error: str) -> None:
        task = launched.task
        for route in launched.info.routes:
            out_id = task.output_ids[route.output_index]
            if not error:
                self.sender.send(out_id, launched.values[route.output_index], route.address, route.same_host,
                                 functools.partial(self.store.consumer_done, out_id))
            else:
                self.sender.send_error(out_id, route, error)
                self.store.consumer_done(out_id)

    def _send_buffer(self, send: wpb.BufferSend) -> None:
        try:
            value = self.store.wait(send.buffer_id, timeout=0)
        except (BufferFailed, TimeoutError) as e:
            self.sender.send_error(send.buffer_id, wpb.OutputRoute(address=send.address), str(e))
            self.store.consumer_done(send.buffer_id)
            return
        self.sender.send(send.buffer_id, value, send.address, send.same_host,
                         lambda: self.store.consumer_done(send.buffer_id))


def _wait(launched: _Launched) -> str:
    """Blocks until the task's outputs are computed; its error, or ''."""
    try:
        jax.block_until_ready(launched.values)
        return ""
    except Exception as e:
        return f"{launched.task.label}: {type(e).__name__}: {e}"


def _names_a_node(task: _Task, error: str) -> bool:
    return task.info is not None and any(error.startswith(label + ":") for label in task.info.labels)
