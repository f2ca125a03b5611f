"""The worker's executor in-process: its real launch and completion threads around the state
machine, a real buffer store and real JAX on this process's CPU device (no controller: the
test plays its part, enqueueing tasks and reading the reported events)."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import jax
import numpy as np
import pytest

from pwctl.compile import export_jit
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb
from server.worker.buffers import BufferFailed, BufferStore
from server.worker.executor import Executor
from server.worker.transfer import TransferSender

X = np.arange(4, dtype=np.float32)
Rig = tuple[Executor, BufferStore, "queue.Queue[cpb.NodeEvent]"]


@pytest.fixture
def executor(monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    monkeypatch.setenv("PATHWAYS_VALIDATE", "1")  # the machine checks itself after every stimulus
    events: queue.Queue[cpb.NodeEvent] = queue.Queue()

    def report(evs: list[cpb.NodeEvent], prompt: bool, backlog: int | None, nbytes: int) -> None:
        for e in evs:
            events.put(e)

    store, sender = BufferStore(), TransferSender()
    ex = Executor(store, jax.devices("cpu")[:1], report, sender)
    assert ex.state.validate_each
    fn = export_jit(lambda x: x + 1, mesh_shape=(1,), axis_names=("x",), args=(X,), name="inc")
    ex.submit(wpb.Enqueue(
        functions=[wpb.FunctionBlob(function_id=fn.function_id, exported=fn.exported, name="inc")],
        segments=[wpb.SegmentDef(
            segment_id=1, local_devices=[0], label="p/0 inc",
            nodes=[wpb.SegmentNode(function_id=fn.function_id, inputs=[0], input_outputs=[0], label="p/0 inc",
                                   local_devices=[0])],
            outputs=[wpb.SegmentOutput(node=0, output=0)])]))
    yield ex, store, events
    ex.stop()
    sender.close()


def task(seq: int, run: int, inp: int, out: int) -> wpb.Task:
    return wpb.Task(run_id=run, segment=0, seq=seq, segment_id=1, input_ids=[inp], output_ids=[out],
                    output_visible=[True], owner="client:1")


def next_event(events: queue.Queue[cpb.NodeEvent]) -> cpb.NodeEvent:
    return events.get(timeout=30)


def test_a_task_waiting_for_a_transfer_lets_the_task_behind_it_run_and_runs_when_it_lands(executor: Rig) -> None:
    ex, store, events = executor
    store.put(11, X, X.nbytes, owner="client:1", client_ref=True)
    ex.submit(wpb.Enqueue(tasks=[task(1, run=1, inp=10, out=20), task(2, run=2, inp=11, out=21)]))
    first = next_event(events)
    assert (first.run_id, first.seq, first.ok) == (2, 2, True)
    np.testing.assert_array_equal(np.asarray(store.wait(21, timeout=10)), X + 1)
    assert ex.backlog() == 1 and events.empty()
    store.put(10, X * 2, X.nbytes, from_peer=True)  # the transfer lands
    second = next_event(events)
    assert (second.run_id, second.seq, second.ok) == (1, 1, True)
    np.testing.assert_array_equal(np.asarray(store.wait(20, timeout=10)), X * 2 + 1)
    assert ex.backlog() == 0


def test_a_dropped_run_fails_its_waiting_task_with_the_reason_and_the_order_goes_on(executor: Rig) -> None:
    ex, store, events = executor
    ex.submit(wpb.Enqueue(tasks=[task(1, run=1, inp=10, out=20)]))
    ex.drop([1], "run 1 was cancelled", skipped_seqs=[2])
    failed = next_event(events)
    assert (failed.run_id, failed.seq, failed.ok) == (1, 1, False)
    assert failed.error == "p/0 inc: run 1 was cancelled"
    with pytest.raises(BufferFailed, match="run 1 was cancelled"):
        store.wait(20, timeout=10)
    store.put(12, X, X.nbytes, owner="client:1", client_ref=True)
    ex.submit(wpb.Enqueue(tasks=[task(3, run=3, inp=12, out=22)]))  # seq 2 was skipped: 3 is next
    done = next_event(events)
    assert (done.run_id, done.seq, done.ok) == (3, 3, True)


def test_a_task_of_an_unregistered_segment_fails_naming_it(executor: Rig) -> None:
    ex, _, events = executor
    ex.submit(wpb.Enqueue(tasks=[wpb.Task(run_id=5, segment=2, seq=1, segment_id=99, input_ids=[], output_ids=[30])]))
    failed = next_event(events)
    assert not failed.ok and failed.error == "segment 2: its segment was never registered on this worker"
