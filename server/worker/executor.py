"""The worker's executor: the threads and I/O around its pure core (server/worker/state.py).

A task is one run's execution of a registered segment (consecutive program nodes on this
worker; see server/controller/segments.py) and holds one seq of this worker's gang order.
`WorkerState` decides what to launch when; this module only feeds it stimuli and carries out
its instructions:

- the controller link's thread (`submit`, `drop`, `reset`, `peer_lost`) appends stimuli to an
  inbox, one lock round trip per message;
- the launch thread (`pw-executor`) is the machine's only user: it takes the inbox, hands each
  stimulus to the machine and carries out the instructions, feeding back each launch's outcome
  (launched, inputs missing, failed). Launches never happen on gRPC handler threads
  (docs/facts.md, "JAX on CPU": JAX blocks the launching thread when ~32 computations are in
  flight). Results are stored as JAX arrays still being computed, so computations without
  collectives pipeline through JAX's async dispatch; a collective's `Launch` names the
  computations on its devices to wait for first (on CPU, two collective computations in flight
  at once deadlock);
- the completion thread (`pw-completer`) waits for completions in launch order, sends outputs
  to consumers on other workers, reports one event per task (batched by the caller of
  `report`) and hands the completed tasks back to the machine without waking the launch thread.
  A small computation whose inputs are ready runs inline in the launch itself (XLA on CPU does
  that for cheap ones): when nothing handed to the completion thread is still open, such a task
  is completed by the launch thread at the end of its pass, with the others of that pass, and
  the completion thread is never woken for it. The completion side is server/worker/completion.py.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from ..invariants import InvariantError
from ..threadnames import name_native_thread
from . import state as st
from .buffers import BufferFailed, BufferStore
from .completion import COMPLETIONS_BATCH, COMPLETIONS_BOUND, INLINE_BATCH, Completion, all_ready
from .fusion import NodeFailed
from .segments import Runners, SegmentInfo, switch_group
from .shards import held_nbytes
from .spans import DeviceSpans
from .tasks import Exclusive, Task, names_a_node
from .transfer import TransferSender

log = logging.getLogger(__name__)

MAX_DROP_HINTS = 10_000  # dropped runs remembered for launches blocked on inputs; halved when full


class OldEpoch(Exception):
    """A launch waited for an input across a new registration (`Executor.reset`)."""


class Executor(Completion):
    def __init__(
        self,
        store: BufferStore,
        devices: Sequence[Any],
        report: Callable[[list[cpb.NodeEvent], bool, int | None, int], None],
        sender: TransferSender,
    ) -> None:
        self.store = store
        self.report = report
        self.sender = sender
        self.runners = Runners(devices)
        self.cache = self.runners.cache
        self._segments: dict[int, SegmentInfo] = {}
        self.state = st.WorkerState()  # the launch thread's alone
        self._cond = threading.Condition()
        self._inbox: list[st.Stimulus_ | Exclusive] = []  # under _cond
        self._completions: deque[Task] = deque()  # completer -> launch thread, lock-free
        self._launched: list[st.Task] = []  # launched, not told to the machine yet (launch thread)
        self._drop_hints: dict[int, str] = {}  # run -> reason, for launches blocked on inputs
        # registrations (`reset`) and those the machine took in (the launch thread): while they
        # differ, a launch blocked on an input is of the old epoch (one writer each)
        self._resets = 0
        self._resets_taken = 0
        self._reset_reason = ""
        self._launching: Task | None = None  # the task the launch thread is launching
        self._inflight: dict[int, Task] = {}  # id -> launched task, until completed
        self._spans = DeviceSpans()  # when each completed task ran (completion thread)
        self._done_q: queue.Queue[Task | None] = queue.Queue()
        # tasks handed to the completion thread and not finished yet (written by the launch thread
        # when it hands one over, by the completion thread when it finished one: two counters,
        # one writer each); while any is open, every launch goes to the completion thread too, so
        # that tasks complete in launch order
        self._handed = 0
        self._handed_done = 0
        self._ready_now: list[Task] = []  # launched and already complete: finished at the pass's end
        self.completed_inline = 0  # tasks the launch thread completed itself (tests, benchmarks)
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
    def _feed(self, *stimuli: st.Stimulus_ | Exclusive) -> None:
        with self._cond:
            self._inbox.extend(stimuli)
            self._cond.notify_all()

    def reset(self, reason: str) -> None:
        """A new registration: sequence numbers restart, segment ids are the new controller's;
        work of the old epoch fails. A launch blocked on an input meanwhile (a collective's, which
        waits in the launch thread) gives up: the controller that would have dropped its run is
        gone or forgot it (the worker was declared lost), and the machine hears of the Reset only
        once that launch returns."""
        self._segments.clear()
        self._reset_reason = reason
        self._resets += 1
        self._feed(st.Reset(reason))

    def submit(self, enq: wpb.Enqueue) -> None:
        for k in enq.keeps:  # before the tasks, which may read them
            self.store.keep(k.buffer_id, k.owner)
        for blob in enq.functions:
            self.runners.functions[blob.function_id] = blob
        for d in enq.segments:
            try:
                self._segments[d.segment_id] = SegmentInfo.of(d, self.runners.group)
            except ValueError as e:
                log.error("bad segment definition: %s", e)
        tasks: list[st.Task] = []
        for t in enq.tasks:
            info = self._segments.get(t.segment_id)
            task = Task(seq=t.seq, run_id=t.run_id, segment=t.segment, input_ids=list(t.input_ids),
                         output_ids=list(t.output_ids), route_ids=list(t.route_ids), info=info,
                         prompt=t.report_promptly,
                         label=info.label if info is not None else f"segment {t.segment}",
                         devices=info.devices if info is not None else frozenset())
            self.store.expect(task.output_ids, t.owner, t.output_visible)
            readers = task.input_ids
            if info is not None and info.routes:  # outputs sent to other workers are read once more
                outs = task.output_ids
                readers = readers + [outs[r.output_index] for r in info.routes if r.output_index < len(outs)]
            self.store.add_consumers(readers, t.owner)
            tasks.append(task)
        if tasks:
            self._received += len(tasks)
            self._feed(st.Enqueued(tasks))
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
        for r in run_ids:
            self._drop_hints[r] = reason
        if len(self._drop_hints) > MAX_DROP_HINTS:
            for r in list(self._drop_hints)[: MAX_DROP_HINTS // 2]:
                self._drop_hints.pop(r, None)
        launching = self._launching
        if launching is not None and launching.run_id in run_ids:
            for inp in launching.input_ids:  # it may be blocked waiting for them
                self.store.fail(inp, reason)
        self._feed(st.Skipped(list(skipped_seqs)), st.Dropped(list(run_ids), reason))

    def join_group(self, join: cpb.JoinGroup, done: Callable[[str], None]) -> None:
        """Joins the island's distributed group `join` on the launch thread, in order with the
        tasks around it, once every launched computation is over; then `done(error)` ("" when it
        joined). Segments of older generations can no longer run (their runs were dropped)."""
        self.runners.group.announce(join.generation, join.process_id)

        def switch() -> None:
            done(switch_group(join, self.runners, self._segments.values()))

        with self._cond:
            self._inbox.append(Exclusive(switch))
            self._cond.notify_all()

    def _run_exclusive(self, item: Exclusive) -> None:
        """Runs `item` with nothing launched still computing."""
        for task in list(self._inflight.values()):
            if task.values is not None:
                try:
                    jax.block_until_ready(task.values)
                except Exception:
                    pass  # its own completion reports the failure
        item.fn()

    def peer_lost(self, peer: str, reason: str = "connection lost") -> None:
        """Another worker is gone: the tasks that need it fail, naming it."""
        self._feed(st.PeerLost(peer, reason))

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._done_q.put(None)

    # ---- launch thread ----
    def _launch_loop(self) -> None:
        name_native_thread()
        try:
            self._launch_until_stopped()
        except InvariantError as e:  # only with PATHWAYS_VALIDATE: a bug, made loud
            log.critical("InvariantError in the worker's state machine: %s", e)
            os._exit(70)

    def _launch_until_stopped(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or bool(self._inbox)
                                    or len(self._completions) > COMPLETIONS_BOUND)
                if self._stop:
                    return
                inbox, self._inbox = self._inbox, []
            if len(self._completions) >= COMPLETIONS_BATCH:
                self._take_completions()
            for stimulus in inbox:
                if isinstance(stimulus, Exclusive):
                    self._run_exclusive(stimulus)
                    continue
                if isinstance(stimulus, st.Enqueued):
                    for task in stimulus.tasks:  # compiled on first sight; its launch reports errors
                        info = task.info  # type: ignore[attr-defined]
                        if info is not None:
                            c = info.communicates
                            task.communicates = c = self.runners.communicates(info) if c is None else c
                            if c and self._completions:  # its `after` then names only what still runs
                                self._take_completions()
                if isinstance(stimulus, st.Reset):
                    self._resets_taken += 1  # the launches from here on are of the new epoch
                self._carry_out(self.state.handle(stimulus))
            if self._ready_now:
                self._complete_inline()

    def _take_completions(self) -> None:
        done: list[st.Task] = []
        while self._completions:
            done.append(self._completions.popleft())
        todo = self._tell_launched()  # a task is launched before it completes
        todo.extend(self.state.handle(st.Completed(done)))
        self._carry_out(todo)

    def _tell_launched(self) -> list[st.Instruction]:
        launched, self._launched = self._launched, []
        return self.state.handle(st.Launched(launched)) if launched else []

    def _carry_out(self, todo: list[st.Instruction]) -> None:
        """Carries out the instructions in order, feeding each launch's outcome back (which may
        release more, appended to `todo`). Successful launches are told in batches: at the end
        of the list when a collective is held (only launches release it), else with the next
        completions (hot path: one stimulus less per message)."""
        i = 0
        while True:
            if i == len(todo):
                if self._launched and (self.state.held is not None or len(self._launched) >= COMPLETIONS_BATCH):
                    todo.extend(self._tell_launched())
                    continue
                return
            ins = todo[i]
            i += 1
            task: Task = ins.task  # type: ignore[assignment]
            if isinstance(ins, st.Launch):
                if ins.after:
                    self._drain(ins.after)
                if not task.communicates and self._defer_if_waiting(task):
                    todo.extend(self.state.handle(st.InputsMissing(task)))
                elif self._launch_safely(task):
                    self._launched.append(task)
                else:
                    todo.extend(self.state.handle(st.LaunchFailed(task)))
            else:
                if ins.free_inputs:
                    for inp in task.input_ids:
                        self.store.fail(inp, ins.error)
                self._fail(task, ins.error, ins.report)

    def _launch_safely(self, task: Task) -> bool:
        """Launches the task; False when it failed (and was reported)."""
        self._launching = task
        try:
            return self._launch(task)
        except Exception as e:  # a bug here must not kill the worker
            log.exception("launching %s failed", task.label)
            self._fail(task, f"{type(e).__name__}: {e}")
            return False
        finally:
            self._launching = None

    # A task without collectives only reads buffers, so when an input has not arrived yet (a
    # transfer from another island) it is set aside and launched when the input lands, and the
    # tasks behind it go on: micro-batches of a pipeline overlap instead of queueing behind each
    # other's transfers (the machine decides; this registers the wake-up).
    def _defer_if_waiting(self, task: Task) -> bool:
        missing = self.store.pending_of(task.input_ids)
        if not missing:
            return False
        left = [len(missing)]
        lock = threading.Lock()

        def arrived() -> None:
            with lock:
                left[0] -= 1
                done = left[0] == 0
            if done:
                self._feed(st.InputsReady(task))

        for b in missing:
            self.store.on_settled(b, arrived)
        return True

    def _inputs_of(self, run_id: int, input_ids: Sequence[int]) -> list[Any]:
        """Input values, waiting for those still pending (re-checking for a drop, and for a new
        registration: `OldEpoch`)."""
        while True:
            try:
                return self.store.wait_all(input_ids, timeout=0.5)  # no wait when they are all ready
            except TimeoutError:
                reason = self._drop_hints.get(run_id)
                if reason is not None:
                    raise BufferFailed(reason) from None
                if self._resets != self._resets_taken:
                    raise OldEpoch(self._reset_reason) from None

    def _launch(self, task: Task) -> bool:
        info = task.info
        if info is None:
            self._fail(task, "its segment was never registered on this worker")
            return False
        if info.stale:
            self._fail(task, info.stale)
            return False
        if len(task.input_ids) != info.structure.num_inputs or len(task.output_ids) != len(info.structure.keep):
            self._fail(task, f"the task has {len(task.input_ids)} inputs and {len(task.output_ids)} outputs; "
                             f"its segment takes {info.structure.num_inputs} and gives {len(info.structure.keep)}")
            return False
        try:
            inputs = self._inputs_of(task.run_id, task.input_ids)
        except BufferFailed as e:
            self._fail(task, f"an input failed: {e}")
            return False
        except OldEpoch as e:  # unreported, as the Reset fails the old epoch's tasks not launched
            self._fail(task, f"an input never came before the worker registered again ({e})", report=False)
            return False
        if info.runner is None and self._ready_now:  # building it may compile for seconds: report those first
            self._complete_inline()
        try:
            runner = self.runners.runner(info)
        except Exception as e:
            self._fail(task, str(e))
            return False
        start = time.time_ns()
        try:
            values = runner(inputs)
        except Exception as e:
            if info.fused:  # its first launch: maybe it does not fuse; run its nodes one by one
                log.info("fused segment %s failed (%s); running its nodes one by one", info.label, e)
                self.runners.unfuse(info)
                return self._launch(task)
            self._fail(task, str(e) if isinstance(e, NodeFailed) else f"{type(e).__name__}: {e}")
            return False
        info.fused = False  # it launched: from now on a failure is the computation's, not fusion's
        if info.donates:  # its donated inputs are gone: later readers must fail, not crash XLA
            gone = [b for b, v in zip(task.input_ids, inputs, strict=False) if getattr(v, "is_deleted", bool)()]
            self.store.consumed(gone, f"buffer donated to {info.label}: it no longer exists (donate_argnums)")
        if info.out_nbytes is None:
            info.out_nbytes = [held_nbytes(v) for v in values]
        task.nbytes = self.store.launched(task.output_ids, values, task.input_ids, info.out_nbytes)
        task.values, task.start_ns = values, start
        self._inflight[id(task)] = task
        if self._handed == self._handed_done and not info.routes and all_ready(values):
            self._ready_now.append(task)  # computed inline: no completion thread needed
            if task.prompt or len(self._ready_now) >= INLINE_BATCH:  # prompt: the controller waits for it
                self._complete_inline()
        else:
            if self._ready_now:  # they launched first: they complete first
                self._complete_inline()
            self._handed += 1
            self._done_q.put(task)
        return True

    def _drain(self, tasks: Sequence[st.Task]) -> None:
        """Waits for these launched computations (on the devices of a collective) to complete."""
        for t in tasks:
            values = t.values  # type: ignore[attr-defined]
            if values is not None:
                try:
                    jax.block_until_ready(values)
                except Exception:
                    pass  # its own completion reports the failure

    def stale_starts(self, older_than_s: float) -> list[cpb.NodeEvent]:
        """'Started' events for tasks running longer than `older_than_s` (for hang
        detection); quick tasks only ever report their completion."""
        cutoff = time.time_ns() - int(older_than_s * 1e9)
        out = []
        for t in list(self._inflight.values()):
            if t.start_ns < cutoff and not t.reported_start and t.info is not None:
                t.reported_start = True
                out.append(cpb.NodeEvent(run_id=t.run_id, segment=t.segment, seq=t.seq, start_ns=t.start_ns,
                                         local_devices=t.info.structure.devices))
        return out

    def _fail(self, task: Task, error: str, report: bool = True) -> None:
        """Fails the task with `error`, led by the task's label unless it names a node already.
        Its outputs here fail with its run's own error as it is when that is the error (the
        controller's Drop): a client waiting on one reads the words the controller fails the run
        with, whichever of the two answers first."""
        message = error if error.startswith(task.label) or names_a_node(task, error) else f"{task.label}: {error}"
        with self._failed_lock:
            self._failed += 1
        stored = error if self._drop_hints.get(task.run_id) == error else message
        for out in task.output_ids:
            self.store.fail(out, stored)
        for inp in task.input_ids:
            self.store.consumer_done(inp)
        routes = task.info.routes if task.info is not None else []
        for j, route in enumerate(routes):
            if route.output_index < len(task.output_ids):
                out_id = task.output_ids[route.output_index]
                self.sender.send_error(task.route_id(j, out_id), route, message)
                self.store.consumer_done(out_id)
        if report:
            now = time.time_ns()
            devices = task.info.structure.devices if task.info is not None else ()
            self.report([cpb.NodeEvent(run_id=task.run_id, segment=task.segment, seq=task.seq, start_ns=now,
                                       end_ns=now, ok=False, error=message, local_devices=devices)],
                        task.prompt, self.backlog(), 0)
