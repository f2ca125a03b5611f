"""The executor's completion side (server/worker/executor.py): the completion thread, and the
launch thread's completing of tasks computed by the time their launch returned.

Completed tasks are waited for in launch order, their outputs sent to consumers on other
workers, one event per task reported (batched by the caller of `report`), and the tasks handed
back to the machine through `_completions` without waking the launch thread. `_finish` is run
by one thread at a time: the completion thread, or the launch thread while nothing handed to the
completion thread is open (`Executor._launch`).
"""

from __future__ import annotations

import functools
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from ..threadnames import name_native_thread
from .buffers import BufferFailed, BufferStore
from .readiness import computed_now
from .segments import Runners, SegmentInfo
from .spans import DeviceSpans
from .tasks import Task, info_of, wait_outputs
from .transfer import TransferSender

# Completed tasks reach the machine in batches of COMPLETIONS_BATCH (nothing waits on them there:
# a collective's `after` may name a completed task, whose wait returns at once); past
# COMPLETIONS_BOUND an idle launch thread is woken to take them.
COMPLETIONS_BATCH = 64
COMPLETIONS_BOUND = 1024
# A launched task is completed by the launch thread itself when its outputs are ready as the launch
# returns, it has at most this many outputs (checking costs ~0.5 µs each) and none travels to another
# worker; at most INLINE_BATCH of them wait for the end of the launch thread's pass.
INLINE_MAX_OUTPUTS = 16
INLINE_BATCH = 64


class Completion:
    """The completion methods of `Executor` (which sets these attributes up)."""

    store: BufferStore
    sender: TransferSender
    report: Callable[[list[cpb.NodeEvent], bool, int | None, int], None]
    runners: Runners
    recent_order: deque[tuple[int, int, int]]
    nodes_executed: int
    completed_inline: int
    _done_q: queue.Queue[Task | None]
    _inflight: dict[int, Task]
    _spans: DeviceSpans
    _completions: deque[Task]
    _completed: int
    _handed_done: int
    _ready_now: list[Task]

    def backlog(self) -> int:
        raise NotImplementedError

    def _feed(self, *stimuli: Any) -> None:
        raise NotImplementedError

    def _complete_inline(self) -> None:
        """(launch thread) Completes the tasks whose outputs were ready when their launch returned,
        as the completion thread would (it has nothing open: see `_launch`), without waking it: a
        small message's tasks then cost one thread hand-off less each."""
        batch, self._ready_now = self._ready_now, []
        self.completed_inline += len(batch)
        self._finish(batch)


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
            self._handed_done += len(batch)  # after its report: the launch thread may complete the next ones
            # the store decides when outputs are freed: hold no reference while idle
            first = item = None
            batch = []

    def _finish(self, batch: list[Task]) -> None:
        """Completes launched tasks (in launch order): waits for them, sends routed outputs, reports
        their events and hands them back to the machine. Called by the completion thread, or by the
        launch thread for tasks already complete while the completion thread has nothing open
        (never by both at once)."""
        # Tasks whose outputs travel to other workers are waited for one by one, in launch order,
        # and their outputs leave as soon as they are ready: a pipeline stage's micro-batch k goes
        # to the next stage while micro-batch k+1 still computes (waiting for the whole batch
        # would make stages take turns). The rest complete with one wait.
        errors: list[str] = [""] * len(batch)
        infos = [info_of(t) for t in batch]
        for i, task in enumerate(batch):
            if infos[i].routes:
                errors[i] = wait_outputs(task)
                self._send_outputs(task, infos[i], errors[i])
        try:
            jax.block_until_ready([t.values for t, info in zip(batch, infos, strict=True) if not info.routes])
        except Exception:
            for i, task in enumerate(batch):  # find which ones failed
                if not infos[i].routes:
                    errors[i] = wait_outputs(task)
        failed = any(errors)
        # read only where a Wait waits for them (the store looks first): no list on the hot path
        outputs = (b for task in batch for b in task.output_ids)
        if not failed:  # the Waits for them are answered now (waits.py), before the bookkeeping below
            self.store.computations.computed(outputs)
        group = self.runners.group
        for i, info in enumerate(infos):
            if errors[i] and info.definition.group_generation:
                errors[i] = group.explain(errors[i])  # names the peer that went away, where it can
        spans = self._spans.split([(t.devices, t.start_ns, info.size) for t, info in zip(batch, infos, strict=True)],
                                  time.time_ns())
        events = []
        nbytes = 0
        prompt = False
        for task, info, error, (start, end) in zip(batch, infos, errors, spans, strict=True):
            self._inflight.pop(id(task), None)
            task.values = None  # the store holds the outputs from here
            if error:
                for out in task.output_ids:
                    self.store.fail(out, error)
            self.recent_order.append((task.run_id, task.segment, task.seq))
            events.append(cpb.NodeEvent(
                run_id=task.run_id, segment=task.segment, seq=task.seq, start_ns=start,
                end_ns=end, ok=not error, error=error, local_devices=info.structure.devices))
            self.nodes_executed += info.size
            nbytes += task.nbytes
            prompt = prompt or task.prompt
        if failed:
            self.store.computations.computed(outputs)  # after their failure
        self._completed += len(batch)
        self._completions.extend(batch)  # for the machine, taken when the launch thread next wakes
        if len(self._completions) > COMPLETIONS_BOUND:
            self._feed()  # an idle launch thread takes them now
        self.report(events, prompt, self.backlog(), nbytes)

    def _send_outputs(self, task: Task, info: SegmentInfo, error: str) -> None:
        for j, route in enumerate(info.routes):
            out_id = task.output_ids[route.output_index]
            to_id = task.route_id(j, out_id)
            if not error and task.values is not None:
                self.sender.send(to_id, task.values[route.output_index], route.address, route.same_host,
                                 functools.partial(self.store.consumer_done, out_id))
            else:
                self.sender.send_error(to_id, route, error)
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



def all_ready(values: Sequence[Any]) -> bool:
    """Whether every output is computed already (a computation XLA ran inline during its launch);
    False for many outputs (not worth checking: a big step completes on the completion thread)."""
    if len(values) > INLINE_MAX_OUTPUTS:
        return False
    return all(computed_now(v) is True for v in values)  # deleted (None): the completion thread finds out
