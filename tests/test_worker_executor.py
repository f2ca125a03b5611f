"""The worker's executor in-process: its real launch and completion threads around the state
machine, a real buffer store and real JAX on this process's CPU device (no controller: the
test plays its part, enqueueing tasks and reading the reported events)."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

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
    register(ex, lambda x: x + 1, "inc", segment_id=1, label="p/0 inc")
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


def test_tasks_behind_a_waiting_one_that_read_its_outputs_wait_for_them_and_run_in_order(executor: Rig) -> None:
    """A task deferred for a transfer, and the tasks after it that read its output (a training step
    behind one waiting for its upload): they wait for their pending inputs and run in order once
    the transfer lands."""
    ex, store, events = executor
    ex.submit(wpb.Enqueue(tasks=[task(1, run=1, inp=10, out=20), task(2, run=2, inp=20, out=21),
                                 task(3, run=3, inp=21, out=22)]))
    time.sleep(0.2)
    assert events.empty() and ex.backlog() == 3
    store.put(10, X, X.nbytes, from_peer=True)  # the transfer lands
    done = [next_event(events) for _ in range(3)]
    assert [(e.run_id, e.ok) for e in done] == [(1, True), (2, True), (3, True)]
    np.testing.assert_array_equal(np.asarray(store.wait(22, timeout=10)), X + 3)
    assert ex.backlog() == 0


def test_a_dropped_run_fails_its_waiting_task_with_the_reason_and_the_order_goes_on(executor: Rig) -> None:
    ex, store, events = executor
    ex.submit(wpb.Enqueue(tasks=[task(1, run=1, inp=10, out=20)]))
    ex.drop([1], "run 1 was cancelled", skipped_seqs=[2])
    failed = next_event(events)
    assert (failed.run_id, failed.seq, failed.ok) == (1, 1, False)
    assert failed.error == "p/0 inc: run 1 was cancelled"
    with pytest.raises(BufferFailed) as lost:  # its run's own words, as the controller fails the run with
        store.wait(20, timeout=10)
    assert str(lost.value) == "run 1 was cancelled"
    store.put(12, X, X.nbytes, owner="client:1", client_ref=True)
    ex.submit(wpb.Enqueue(tasks=[task(3, run=3, inp=12, out=22)]))  # seq 2 was skipped: 3 is next
    done = next_event(events)
    assert (done.run_id, done.seq, done.ok) == (3, 3, True)


def test_a_task_of_an_unregistered_segment_fails_naming_it(executor: Rig) -> None:
    ex, _, events = executor
    ex.submit(wpb.Enqueue(tasks=[wpb.Task(run_id=5, segment=2, seq=1, segment_id=99, input_ids=[], output_ids=[30])]))
    failed = next_event(events)
    assert not failed.ok and failed.error == "segment 2: its segment was never registered on this worker"


def _slow(x: jax.Array) -> jax.Array:
    """x + 0, after 40 matrix products (tens of ms on CPU: never complete when its launch returns)."""
    m = jax.numpy.ones((256, 256), x.dtype) * x[0]
    m = jax.lax.fori_loop(0, 40, lambda i, m: jax.numpy.tanh(m @ m), m)
    return x + 0 * jax.numpy.sum(m)


def register(ex: Executor, f: Any, name: str, segment_id: int, label: str) -> None:
    """A one-node segment of `f` on device 0, reading its input 0 and producing output 0."""
    fn = export_jit(f, mesh_shape=(1,), axis_names=("x",), args=(X,), name=name)
    ex.submit(wpb.Enqueue(
        functions=[wpb.FunctionBlob(function_id=fn.function_id, exported=fn.exported, name=name)],
        segments=[wpb.SegmentDef(
            segment_id=segment_id, local_devices=[0], label=label,
            nodes=[wpb.SegmentNode(function_id=fn.function_id, inputs=[0], input_outputs=[0], label=label,
                                   local_devices=[0])],
            outputs=[wpb.SegmentOutput(node=0, output=0)])]))


def register_slow(ex: Executor) -> None:
    register(ex, _slow, "slow", segment_id=2, label="p/1 slow")


@pytest.mark.timeout(60)
def test_a_message_of_small_computations_completes_them_on_the_launch_thread_in_order(executor: Rig) -> None:
    ex, store, events = executor
    store.put(100, X, X.nbytes, owner="client:1", client_ref=True)
    n = 8  # a chain: each task reads the one before it
    ex.submit(wpb.Enqueue(tasks=[task(i, run=i, inp=99 + i, out=100 + i) for i in range(1, n + 1)]))
    got = [next_event(events) for _ in range(n)]
    assert [(e.run_id, e.seq, e.ok) for e in got] == [(i, i, True) for i in range(1, n + 1)]
    np.testing.assert_array_equal(np.asarray(store.wait(100 + n, timeout=10)), X + n)
    assert ex.completed_inline > 0  # XLA ran them inline: the completion thread was not needed
    assert ex.backlog() == 0


@pytest.mark.timeout(120)
def test_a_computation_still_running_completes_on_the_completion_thread_and_those_after_it_wait(
        executor: Rig) -> None:
    """(On one device XLA runs a device's computations in order, so the small ones are not computed
    before the slow one either; what is checked is that they go to the completion thread after it,
    and that the launch thread completes small ones again once nothing is open.)"""
    ex, store, events = executor
    register_slow(ex)
    store.put(100, X, X.nbytes, owner="client:1", client_ref=True)

    def slow_then_two(seq: int, inp: int) -> list[cpb.NodeEvent]:
        slow = wpb.Task(run_id=seq, segment=1, seq=seq, segment_id=2, input_ids=[inp], output_ids=[inp + 1],
                        output_visible=[True], owner="client:1")
        # the next one reads what the slow one reads, not its output: computed as its launch returns
        ex.submit(wpb.Enqueue(tasks=[slow, task(seq + 1, run=seq + 1, inp=inp, out=inp + 2),
                                     task(seq + 2, run=seq + 2, inp=inp + 2, out=inp + 3)]))
        return [next_event(events) for _ in range(3)]

    slow_then_two(1, 100)  # the first launches compile (each executable again for inputs of new shardings)
    slow_then_two(4, 103)
    inline = ex.completed_inline
    got = slow_then_two(7, 106)
    assert [(e.run_id, e.seq, e.ok) for e in got] == [(7, 7, True), (8, 8, True), (9, 9, True)]
    assert got[0].end_ns <= got[1].end_ns <= got[2].end_ns
    np.testing.assert_array_equal(np.asarray(store.wait(109, timeout=10)), np.asarray(store.wait(106)) + 2)
    assert ex.completed_inline == inline  # launched while the slow one ran: they completed after it
    # once nothing is open, small ones complete inline again
    ex.submit(wpb.Enqueue(tasks=[task(10, run=10, inp=109, out=110)]))
    assert (next_event(events).seq, ex.completed_inline) == (10, inline + 1)
    np.testing.assert_array_equal(np.asarray(store.wait(110, timeout=10)), np.asarray(store.wait(106)) + 3)
    assert [seq for _, _, seq in ex.recent_order] == list(range(1, 11))


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Executor, BufferStore, list[Any]]]:
    """An executor whose reports and runner builds are logged in order, in one list:
    ("report", [(run, seq), ...], prompt) and ("build", segment label)."""
    monkeypatch.setenv("PATHWAYS_VALIDATE", "1")
    log: list[Any] = []

    def report(evs: list[cpb.NodeEvent], prompt: bool, backlog: int | None, nbytes: int) -> None:
        log.append(("report", [(e.run_id, e.seq) for e in evs], prompt))

    store, sender = BufferStore(), TransferSender()
    ex = Executor(store, jax.devices("cpu")[:1], report, sender)
    build = ex.runners.runner

    def logged_build(info: Any) -> Any:
        if info.runner is None:
            log.append(("build", info.label))
        return build(info)

    monkeypatch.setattr(ex.runners, "runner", logged_build)
    register(ex, lambda x: x + 1, "inc", segment_id=1, label="p/0 inc")
    yield ex, store, log
    ex.stop()
    sender.close()


def reported(log: list[Any], n: int) -> list[tuple[int, int]]:
    """Waits until `n` task events were reported; their (run, seq) in report order."""
    deadline = time.monotonic() + 60
    while sum(len(entry[1]) for entry in log if entry[0] == "report") < n:
        assert time.monotonic() < deadline, f"fewer than {n} events reported: {log}"
        time.sleep(0.01)
    return [rs for entry in log if entry[0] == "report" for rs in entry[1]]


@pytest.mark.timeout(60)
def test_a_prompt_task_completed_inline_is_reported_at_once_not_with_the_tasks_after_it(
        batches: tuple[Executor, BufferStore, list[Any]]) -> None:
    ex, store, log = batches
    store.put(100, X, X.nbytes, owner="client:1", client_ref=True)
    ex.submit(wpb.Enqueue(tasks=[task(1, run=1, inp=100, out=101)]))  # compiles the runner first
    reported(log, 1)
    log.clear()
    first = task(2, run=2, inp=101, out=102)
    first.report_promptly = True  # the controller waits for its event before it sends more
    ex.submit(wpb.Enqueue(tasks=[first, *(task(i, run=i, inp=99 + i, out=100 + i) for i in range(3, 7))]))
    assert reported(log, 5) == [(i, i) for i in range(2, 7)]
    assert log[0] == ("report", [(2, 2)], True)  # alone and prompt: not held for the other four
    np.testing.assert_array_equal(np.asarray(store.wait(106, timeout=10)), X + 6)


@pytest.mark.timeout(120)
def test_tasks_completed_inline_are_reported_before_a_launch_that_builds_a_runner(
        batches: tuple[Executor, BufferStore, list[Any]]) -> None:
    """Building a segment's runner may compile for seconds: what already completed is reported
    first, not after it."""
    ex, store, log = batches
    register_slow(ex)
    store.put(100, X, X.nbytes, owner="client:1", client_ref=True)
    ex.submit(wpb.Enqueue(tasks=[task(1, run=1, inp=100, out=101)]))
    reported(log, 1)
    log.clear()
    slow = wpb.Task(run_id=3, segment=1, seq=3, segment_id=2, input_ids=[101], output_ids=[103],
                    output_visible=[True], owner="client:1")
    ex.submit(wpb.Enqueue(tasks=[task(2, run=2, inp=101, out=102), slow]))
    assert reported(log, 2) == [(2, 2), (3, 3)]
    assert [entry[0] for entry in log][:2] == ["report", "build"], log
    assert log[0][1] == [(2, 2)] and log[1] == ("build", "p/1 slow")
