"""The worker's executor: runs enqueued nodes in gang order on its devices.

One thread launches nodes strictly in the order of their per-host sequence numbers
(the island's gang order), never from gRPC handler threads (FACTS.md: JAX blocks the
launching thread when ~32 computations are in flight). A launch waits only for its
inputs; results are stored as JAX arrays still being computed, so computations
without collectives pipeline through JAX's async dispatch. A computation with a
collective starts only after everything in flight on its devices completed: on CPU,
two collective computations in flight at once deadlock.

A second thread waits for completions in launch order, sends outputs to consumers on
other workers, and reports node events (batched by the caller of `report`).
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
from dataclasses import dataclass
from typing import Any

import jax

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from .buffers import BufferFailed, BufferStore
from .executable import Executable, ExecutableCache
from .fusion import MAX_SEGMENT, FusedExecutable, Segment, fusable, plan_segment
from .transfer import TransferSender

log = logging.getLogger(__name__)

_SKIP = wpb.NodeExec(label="skipped")  # placeholder for a seq that will never be sent


@dataclass
class _Launched:
    """One launch: a single node, or a fused segment of consecutive nodes of one run."""

    nodes: list[wpb.NodeExec]
    values: dict[int, Any]  # output buffer id -> array (what was stored or must be sent)
    start_ns: int
    devices: frozenset[int]
    reported_start: bool = False


class Executor:
    def __init__(
        self,
        store: BufferStore,
        devices: Sequence[Any],
        report: Callable[[list[cpb.NodeEvent]], None],
        sender: TransferSender,
    ) -> None:
        self.store = store
        self.devices = list(devices)
        self.report = report
        self.sender = sender
        self.cache = ExecutableCache()
        self._functions: dict[str, wpb.FunctionBlob] = {}
        self._cond = threading.Condition()
        self._pending: dict[int, wpb.NodeExec] = {}
        self._next_seq = 1
        self._dropped: dict[int, str] = {}
        self._inflight: dict[int, _Launched] = {}
        self._exes: dict[tuple[str, tuple[int, ...]], Executable] = {}
        self._fused: dict[Segment, FusedExecutable] = {}
        self._fused_ok: set[Segment] = set()
        self._unfusable: set[Segment] = set()
        # PATHWAYS_FUSE=0 launches every node on its own (debugging, benchmarks)
        self.fuse = os.environ.get("PATHWAYS_FUSE", "1") != "0"
        self._busy_until: dict[frozenset[int], int] = {}
        self._deferred: dict[int, list[wpb.NodeExec]] = {}  # units waiting for an input (launch thread only)
        self._ready: list[int] = []  # deferred units whose inputs all arrived (under _cond)
        self._next_token = 0  # device set -> end of its last batch (ns)
        self._done_q: queue.Queue[_Launched | None] = queue.Queue()
        self._stop = False
        self.nodes_executed = 0
        self.recent_order: deque[tuple[int, int, int]] = deque(maxlen=1000)  # (run, node, seq)
        self._threads = [
            threading.Thread(target=self._launch_loop, name="pw-executor", daemon=True),
            threading.Thread(target=self._complete_loop, name="pw-completer", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- called from the controller link (event loop thread) ----
    def reset(self, reason: str) -> None:
        """A new registration: sequence numbers restart; work of the old epoch fails."""
        with self._cond:
            stale = [n for n in self._pending.values() if n is not _SKIP]
            stale += [n for unit in list(self._deferred.values()) for n in unit]
            self._deferred.clear()
            self._pending.clear()
            self._next_seq = 1
            self._cond.notify_all()
        for node in stale:
            self._fail_node(node, reason, report=False)

    def submit(self, enq: wpb.Enqueue) -> None:
        for blob in enq.functions:
            self._functions[blob.function_id] = blob
        with self._cond:
            for node in enq.nodes:
                for i, out in enumerate(node.output_ids):
                    visible = i < len(node.output_visible) and node.output_visible[i]
                    self.store.expect(out, node.owner, visible)
                for inp in node.input_ids:
                    self.store.add_consumer(inp, node.owner)
                for route in node.routes:
                    self.store.add_consumer(node.output_ids[route.output_index], node.owner)
                self._pending[node.seq] = node
            self._cond.notify_all()
        for send in enq.sends:
            self.store.add_consumer(send.buffer_id)
            self.store.on_settled(send.buffer_id, functools.partial(self._send_buffer, send))

    def drop(self, run_ids: Sequence[int], reason: str, skipped_seqs: Sequence[int] = ()) -> None:
        """Fails the nodes of these runs that have not run, unblocking any wait on them.

        `skipped_seqs` were assigned to nodes that will never be sent: they count as done.
        """
        with self._cond:
            for seq in skipped_seqs:
                if seq >= self._next_seq and seq not in self._pending:
                    self._pending[seq] = _SKIP
            self._cond.notify_all()
            for r in run_ids:
                self._dropped[r] = reason
            victims = [n for n in self._pending.values() if n is not _SKIP and n.run_id in self._dropped]
            victims += [n for unit in list(self._deferred.values()) for n in unit if n.run_id in self._dropped]
            if len(self._dropped) > 10_000:
                for r in list(self._dropped)[:5_000]:
                    del self._dropped[r]
        for node in victims:
            for inp in node.input_ids:
                self.store.fail(inp, reason)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._done_q.put(None)

    # ---- launch thread ----
    def _launch_loop(self) -> None:
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
            for token in ready:  # deferred units whose inputs arrived
                unit = self._deferred.pop(token, None)
                if unit is not None:
                    self._launch_unit(unit)
            i = 0
            while i < len(batch):
                node = batch[i]
                i += 1
                if node is _SKIP:
                    continue
                dropped = self._dropped.get(node.run_id)
                if dropped is not None:
                    self._fail_node(node, dropped)
                    continue
                unit = [node]
                if self.fuse:
                    while (i < len(batch) and len(unit) < MAX_SEGMENT and batch[i] is not _SKIP
                           and fusable(unit[-1], batch[i]) and self._blob_ok(batch[i])):
                        unit.append(batch[i])
                        i += 1
                if self._communicates(unit):
                    self._barrier()  # collectives keep the gang order exactly
                    self._launch_unit(unit)
                elif not self._defer_if_waiting(unit):
                    self._launch_unit(unit)

    def _launch_unit(self, unit: list[wpb.NodeExec]) -> None:
        try:
            if len(unit) > 1 and self._blob_ok(unit[0]) and self._launch_segment(unit):
                return
            for n in unit:
                self._launch(n)
        except Exception as e:  # a bug here must not kill the worker
            log.exception("launching %s failed", unit[0].label)
            for n in unit:
                self._fail_node(n, f"{type(e).__name__}: {e}")

    # Gang order binds computations that communicate: a unit with a collective starts only
    # after every earlier unit was launched (and, in _drain, completed on its devices). A
    # unit without one only reads buffers, so when an input has not arrived yet (a transfer
    # from another island) it is set aside and launched when the input lands, and the
    # units behind it go on: micro-batches of a pipeline overlap instead of queueing behind
    # each other's transfers. Every wait still points to an earlier unit of the global
    # order, so this cannot deadlock either.
    def _communicates(self, unit: list[wpb.NodeExec]) -> bool:
        for n in unit:
            if n.collective:
                return True
            if n.function_id not in self._functions:
                continue
            try:
                if self._executable(n).has_collectives:
                    return True
            except Exception:
                continue  # its launch reports the compile error
        return False

    def _defer_if_waiting(self, unit: list[wpb.NodeExec]) -> bool:
        produced = {o for n in unit for o in n.output_ids}
        needed = [b for n in unit for b in n.input_ids if b not in produced]
        missing = self.store.pending_of(needed)
        if not missing:
            return False
        token = self._next_token
        self._next_token += 1
        self._deferred[token] = unit
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
        """Launches every deferred unit (waiting for their inputs) before a collective."""
        while self._deferred:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or bool(self._ready))
                if self._stop:
                    return
                ready, self._ready = self._ready, []
            for token in ready:
                unit = self._deferred.pop(token, None)
                if unit is not None:
                    self._launch_unit(unit)

    def _inputs(self, node: wpb.NodeExec) -> list[Any]:
        return self._inputs_of(node.run_id, node.input_ids)

    def _inputs_of(self, run_id: int, input_ids: Sequence[int]) -> list[Any]:
        """Input values, waiting for those still pending (re-checking for a drop)."""
        values = self.store.ready_values(input_ids)
        while values is None:
            for i in input_ids:
                while True:
                    try:
                        self.store.wait(i, timeout=0.5)
                        break
                    except TimeoutError:
                        reason = self._dropped.get(run_id)
                        if reason is not None:
                            raise BufferFailed(reason) from None
            values = self.store.ready_values(input_ids)
        return values

    def _launch(self, node: wpb.NodeExec) -> None:
        try:
            inputs = self._inputs(node)
        except BufferFailed as e:
            self._fail_node(node, f"an input failed: {e}")
            return
        blob = self._functions.get(node.function_id)
        if blob is None:
            self._fail_node(node, f"function {node.function_id[:12]} was never sent to this worker")
            return
        try:
            exe = self._executable(node)
        except Exception as e:
            self._fail_node(node, f"cannot compile {blob.name or node.function_id[:12]}: {e}")
            return
        dev_set = frozenset(node.local_devices)
        if exe.has_collectives or node.collective:
            self._drain(dev_set)
        start = time.time_ns()
        try:
            outputs = exe(inputs)
        except Exception as e:
            self._fail_node(node, f"{type(e).__name__}: {e}")
            return
        self.store.launched(node.output_ids, outputs, node.input_ids)
        launched = _Launched([node], dict(zip(node.output_ids, outputs, strict=False)), start, dev_set)
        self._inflight[id(launched)] = launched
        self._done_q.put(launched)

    def _blob_ok(self, node: wpb.NodeExec) -> bool:
        blob = self._functions.get(node.function_id)
        return blob is not None and not blob.donate

    def _executable(self, node: wpb.NodeExec) -> Executable:
        key = (node.function_id, tuple(node.local_devices))
        exe = self._exes.get(key)
        if exe is None:
            blob = self._functions[node.function_id]
            devices = [self.devices[i] for i in node.local_devices]
            exe = self.cache.get_or_compile(node.function_id, blob.exported, devices, tuple(blob.donate))
            if len(self._exes) > 4096:
                self._exes.clear()
            self._exes[key] = exe
        return exe

    def _launch_segment(self, nodes: list[wpb.NodeExec]) -> bool:
        """Runs consecutive nodes of one run as one computation. False: run them one by one."""
        outputs = [o for n in nodes for o in n.output_ids]
        plan = plan_segment(nodes, self.store.consumer_counts(outputs))
        fused = self._fused.get(plan.segment)
        if fused is None:
            if plan.segment in self._unfusable:
                return False
            try:
                fused = FusedExecutable(plan.segment, [self._executable(n) for n in nodes])
            except Exception as e:
                log.info("not fusing %d nodes of %s: %s", len(nodes), nodes[0].label, e)
                self._unfusable.add(plan.segment)
                return False
            self._fused[plan.segment] = fused
            if len(self._fused) > 1024:
                self._fused.clear()
        try:
            inputs = self._inputs_of(nodes[0].run_id, plan.external_ids)
        except BufferFailed as e:
            for n in nodes:
                self._fail_node(n, f"an input failed: {e}")
            return True
        dev_set = frozenset(nodes[0].local_devices)
        if fused.has_collectives or any(n.collective for n in nodes):
            self._drain(dev_set)
        start = time.time_ns()
        try:
            values = fused(inputs)
        except Exception as e:
            if plan.segment not in self._fused_ok:  # first use: maybe it does not fuse
                log.info("fused segment of %s failed (%s); running its nodes one by one", nodes[0].label, e)
                self._fused.pop(plan.segment, None)
                self._unfusable.add(plan.segment)
                return False
            for n in nodes:
                self._fail_node(n, f"{type(e).__name__}: {e}")
            return True
        self._fused_ok.add(plan.segment)
        self.store.discard(plan.internal_ids)
        self.store.launched(plan.kept_ids, values, plan.reads)
        launched = _Launched(list(nodes), dict(zip(plan.kept_ids, values, strict=True)), start, dev_set)
        self._inflight[id(launched)] = launched
        self._done_q.put(launched)
        return True

    def _drain(self, devices: frozenset[int]) -> None:
        """Waits for every in-flight computation that touches these devices."""
        busy = [list(launched.values.values()) for launched in list(self._inflight.values())
                if launched.devices & devices]
        for outs in busy:
            try:
                jax.block_until_ready(outs)
            except Exception:
                pass  # its own completion reports the failure

    def stale_starts(self, older_than_s: float) -> list[cpb.NodeEvent]:
        """'Started' events for nodes running longer than `older_than_s` (for hang
        detection); quick nodes only ever report their completion."""
        cutoff = time.time_ns() - int(older_than_s * 1e9)
        out = []
        for launched in list(self._inflight.values()):
            if launched.start_ns < cutoff and not launched.reported_start:
                launched.reported_start = True
                for n in launched.nodes:
                    out.append(cpb.NodeEvent(run_id=n.run_id, node_index=n.node_index, seq=n.seq,
                                             start_ns=launched.start_ns, local_devices=n.local_devices))
        return out

    def _fail_node(self, node: wpb.NodeExec, error: str, report: bool = True) -> None:
        label = node.label or f"node {node.node_index}"
        message = error if error.startswith(label) else f"{label}: {error}"
        for out in node.output_ids:
            self.store.fail(out, message)
        for inp in node.input_ids:
            self.store.consumer_done(inp)
        for route in node.routes:
            out_id = node.output_ids[route.output_index]
            self.sender.send_error(out_id, route, message)
            self.store.consumer_done(out_id)
        if report:
            now = time.time_ns()
            self.report([cpb.NodeEvent(run_id=node.run_id, node_index=node.node_index, seq=node.seq,
                                       start_ns=now, end_ns=now, ok=False, error=message,
                                       local_devices=node.local_devices)])

    # ---- completion thread ----
    def _complete_loop(self) -> None:
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

    def _finish(self, batch: list[_Launched]) -> None:
        try:
            jax.block_until_ready([list(launched.values.values()) for launched in batch])
            errors: list[str] = [""] * len(batch)
        except Exception:
            errors = []
            for launched in batch:  # find which ones failed
                try:
                    jax.block_until_ready(list(launched.values.values()))
                    errors.append("")
                except Exception as e:
                    errors.append(f"{launched.nodes[0].label}: {type(e).__name__}: {e}")
        end = time.time_ns()
        # One wait completed the whole batch, so per-node times are not known: split the time the
        # batch's devices were busy evenly over its nodes, in launch order, per device set (the
        # controller charges device time from these spans; giving it all to the batch's first
        # node would bill one client for everyone's work and break proportional share).
        span_start: dict[frozenset[int], int] = {}
        counts: dict[frozenset[int], int] = {}
        for launched in batch:
            d = launched.devices
            span_start[d] = min(span_start.get(d, launched.start_ns), launched.start_ns)
            counts[d] = counts.get(d, 0) + len(launched.nodes)
        cursor: dict[frozenset[int], float] = {}
        steps: dict[frozenset[int], float] = {}
        for d, first in span_start.items():
            cursor[d] = max(first, self._busy_until.get(d, 0))
            steps[d] = max(0, end - cursor[d]) / counts[d]
            self._busy_until[d] = end
        events = []
        for launched, error in zip(batch, errors, strict=True):
            self._inflight.pop(id(launched), None)
            nodes = launched.nodes
            step = steps[launched.devices]
            for node in nodes:
                if error:
                    for out in node.output_ids:
                        self.store.fail(out, error)
                for route in node.routes:
                    out_id = node.output_ids[route.output_index]
                    value = launched.values.get(out_id)
                    if not error and value is not None:
                        self.sender.send(out_id, value, route.address, route.same_host,
                                         functools.partial(self.store.consumer_done, out_id))
                    else:
                        self.sender.send_error(out_id, route, error or "output missing")
                        self.store.consumer_done(out_id)
                self.recent_order.append((node.run_id, node.node_index, node.seq))
                events.append(cpb.NodeEvent(
                    run_id=node.run_id, node_index=node.node_index, seq=node.seq,
                    start_ns=int(cursor[launched.devices]), end_ns=int(cursor[launched.devices] + step),
                    ok=not error, error=error, local_devices=node.local_devices))
                cursor[launched.devices] += step
            self.nodes_executed += len(nodes)
        self.report(events)

    def _send_buffer(self, send: wpb.BufferSend) -> None:
        try:
            value = self.store.wait(send.buffer_id, timeout=0)
        except (BufferFailed, TimeoutError) as e:
            self.sender.send_error(send.buffer_id, wpb.OutputRoute(address=send.address), str(e))
            self.store.consumer_done(send.buffer_id)
            return
        self.sender.send(send.buffer_id, value, send.address, send.same_host,
                         lambda: self.store.consumer_done(send.buffer_id))
