"""The worker's pure core (server/worker/state.py), event by event, asserting the exact
instructions: gang order, deferral of tasks waiting for inputs, collectives held until every
earlier task launched and started after the computations on their devices, drops, skipped
seqs, a peer lost mid-order, resets, and validation with the recent stimuli."""

from __future__ import annotations

import pytest

from server.invariants import InvariantError
from server.worker.state import (
    Completed,
    Dropped,
    Enqueued,
    Fail,
    InputsMissing,
    InputsReady,
    Launch,
    Launched,
    LaunchFailed,
    PeerLost,
    Reset,
    Skipped,
    Task,
    WorkerState,
)

D01 = frozenset({0, 1})


def task(seq: int, run: int = 1, collective: bool = False, devices: frozenset[int] = D01,
         peers: tuple[str, ...] = ()) -> Task:
    return Task(seq=seq, run_id=run, communicates=collective, devices=devices, peers=frozenset(peers))


def machine() -> WorkerState:
    return WorkerState(validate_each=True)


def launch_all(m: WorkerState, *tasks: Task) -> None:
    """Feeds a successful launch of each task, which must release nothing."""
    for t in tasks:
        assert m.handle(Launched([t])) == []


def test_tasks_launch_strictly_in_seq_order_whatever_order_they_arrive_in() -> None:
    m = machine()
    t1, t2, t3 = task(1), task(2), task(3)
    assert m.handle(Enqueued([t3])) == []
    assert m.handle(Enqueued([t2])) == []
    assert m.handle(Enqueued([t1])) == [Launch(t1), Launch(t2), Launch(t3)]
    launch_all(m, t1, t2, t3)
    assert m.in_flight == {1: t1, 2: t2, 3: t3} and m.next_seq == 4
    assert m.handle(Completed([t1, t2])) == []
    assert m.in_flight == {3: t3} and m.backlog == 1


def test_skipped_seqs_count_as_done_and_stale_ones_are_ignored() -> None:
    m = machine()
    t1, t3 = task(1), task(3)
    assert m.handle(Enqueued([t1])) == [Launch(t1)]
    launch_all(m, t1)
    assert m.handle(Enqueued([t3])) == []
    assert m.handle(Skipped([2, 1])) == [Launch(t3)]  # 1 is already past: ignored
    assert m.next_seq == 4


def test_a_task_waiting_for_an_input_does_not_hold_up_the_tasks_behind_it() -> None:
    m = machine()
    t1, t2 = task(1), task(2)
    assert m.handle(Enqueued([t1, t2])) == [Launch(t1), Launch(t2)]
    assert m.handle(InputsMissing(t1)) == []
    assert m.handle(Launched([t2])) == []
    assert m.waiting == {1: t1} and m.in_flight == {2: t2}
    assert m.handle(InputsReady(t1)) == [Launch(t1)]
    assert m.handle(Launched([t1])) == [] and m.waiting == {}


def test_a_collective_waits_for_every_earlier_task_to_launch_and_for_its_devices() -> None:
    m = machine()
    t1, t2, c3 = task(1), task(2, devices=frozenset({7})), task(3, collective=True)
    assert m.handle(Enqueued([t1, t2, c3])) == [Launch(t1), Launch(t2)]
    assert m.handle(InputsMissing(t1)) == []
    # t2 launched, but t1 waits for its input: the collective is held
    assert m.handle(Launched([t2])) == []
    assert m.held is c3
    assert m.handle(InputsReady(t1)) == [Launch(t1)]
    # every earlier task launched: the collective starts after what is in flight on ITS devices
    assert m.handle(Launched([t1])) == [Launch(c3, after=(t1,))]


def test_tasks_behind_a_held_collective_keep_the_gang_order() -> None:
    m = machine()
    t1, c2, t3 = task(1), task(2, collective=True), task(3)
    assert m.handle(Enqueued([t1, c2, t3])) == [Launch(t1)]
    assert m.handle(InputsMissing(t1)) == []
    assert m.queued == {3: t3}  # not launched before the collective ahead of it
    assert m.handle(InputsReady(t1)) == [Launch(t1)]
    assert m.handle(Launched([t1])) == [Launch(c2, after=(t1,)), Launch(t3)]


def test_one_collective_starts_only_after_the_previous_one_on_its_devices_completed() -> None:
    m = machine()
    c1, c2 = task(1, collective=True), task(2, collective=True)
    c3 = task(3, collective=True, devices=frozenset({5}))
    assert m.handle(Enqueued([c1, c2, c3])) == [Launch(c1)]
    assert m.handle(Launched([c1])) == [Launch(c2, after=(c1,))]
    assert m.handle(Completed([c1])) == []
    assert m.handle(Launched([c2])) == [Launch(c3)]  # other devices: nothing to wait for
    m.handle(Completed([c2]))
    c4 = task(4, collective=True)
    assert m.handle(Launched([c3])) == []
    assert m.handle(Enqueued([c4])) == [Launch(c4)]  # c2 completed: its devices are free


def test_a_failed_launch_releases_the_order_behind_it() -> None:
    m = machine()
    t1, c2 = task(1), task(2, collective=True)
    assert m.handle(Enqueued([t1, c2])) == [Launch(t1)]
    assert m.handle(LaunchFailed(t1)) == [Launch(c2)]
    assert m.in_flight == {}


def test_a_dropped_run_fails_its_tasks_at_once_freeing_their_inputs_and_later_ones_on_arrival() -> None:
    m = machine()
    t1, t2, t3, c4 = task(1, run=7), task(2, run=8), task(3, run=7), task(4, run=9, collective=True)
    assert m.handle(Enqueued([t1, t2, t3, c4])) == [Launch(t1), Launch(t2), Launch(t3)]
    assert m.handle(InputsMissing(t1)) == []
    launch_all(m, t2)
    assert m.handle(InputsMissing(t3)) == []
    # run 7 is dropped while two of its tasks wait: both fail, and the collective behind them starts
    assert m.handle(Dropped([7], "cancelled")) == [
        Fail(t1, "cancelled", free_inputs=True), Fail(t3, "cancelled", free_inputs=True), Launch(c4, after=(t2,))]
    assert m.waiting == {}
    late = task(5, run=7)
    assert m.handle(Enqueued([late])) == [Fail(late, "cancelled")]  # its inputs may be others' too
    assert m.handle(InputsReady(t1)) == []  # a wake-up for a failed task is ignored


def test_a_dropped_task_still_queued_fails_and_its_seq_counts_as_done() -> None:
    m = machine()
    t2, t3 = task(2, run=3), task(3, run=4)
    assert m.handle(Enqueued([t2, t3])) == []
    assert m.handle(Dropped([3], "gone")) == [Fail(t2, "gone", free_inputs=True)]
    t1 = task(1, run=4)
    assert m.handle(Enqueued([t1])) == [Launch(t1), Launch(t3)]


def test_a_lost_peer_fails_the_tasks_that_need_it_naming_it_and_nothing_else_waits() -> None:
    m = machine()
    t1 = task(1, peers=("worker-b",))
    t2 = task(2)
    c3 = task(3, collective=True, peers=("worker-c",))
    t4 = task(4, peers=("worker-b",))
    c5 = task(5, collective=True)
    assert m.handle(Enqueued([t1, t2, c3, t4, c5])) == [Launch(t1), Launch(t2)]
    assert m.handle(InputsMissing(t1)) == []  # its input comes from worker-b
    launch_all(m, t2)
    assert m.held is c3
    error = "peer worker-b was lost (connection lost)"
    # t1 (waiting for its input) and t4 (queued) fail naming the peer; the held collective goes
    # on, and the one behind t4 is not stuck
    assert m.handle(PeerLost("worker-b")) == [Fail(t1, error), Fail(t4, error), Launch(c3, after=(t2,))]
    assert m.handle(Launched([c3])) == [Launch(c5, after=(t2, c3))]
    late = task(6, peers=("worker-b",))
    assert m.handle(Enqueued([late])) == [Fail(late, error)]  # one that arrives later fails at once
    assert m.handle(Launched([c5])) == []
    assert m.backlog == 3  # t2, c3, c5 in flight


def test_a_peer_lost_while_its_collective_is_held_fails_it_and_the_order_goes_on() -> None:
    m = machine()
    t1, c2, t3 = task(1), task(2, collective=True, peers=("worker-b",)), task(3)
    assert m.handle(Enqueued([t1, c2, t3])) == [Launch(t1)]
    assert m.handle(InputsMissing(t1)) == []
    assert m.handle(PeerLost("worker-b", "killed")) == [Fail(c2, "peer worker-b was lost (killed)"), Launch(t3)]
    assert m.handle(Launched([t3])) == []
    assert m.handle(InputsReady(t1)) == [Launch(t1)]


def test_a_reset_fails_work_not_launched_unreported_and_restarts_the_order() -> None:
    m = machine()
    t1, t2, c3, t5 = task(1), task(2), task(3, collective=True), task(5)
    assert m.handle(Enqueued([t1, t2, c3, t5])) == [Launch(t1), Launch(t2)]
    launch_all(m, t1)
    assert m.handle(InputsMissing(t2)) == []
    assert m.handle(Reset("the controller restarted")) == [
        Fail(t2, "the controller restarted", report=False), Fail(c3, "the controller restarted", report=False),
        Fail(t5, "the controller restarted", report=False)]
    assert m.next_seq == 1 and m.backlog == 1 and m.draining == [t1]  # t1 still computes
    n1, n2 = task(1, collective=True), task(2, collective=True, devices=frozenset({2}))
    # the new order's collective on t1's devices waits for it (two collective computations at
    # once deadlock on CPU); one on other devices does not
    assert m.handle(Enqueued([n1, n2])) == [Launch(n1, (t1,))]
    assert m.handle(InputsReady(t2)) == []  # old epoch: ignored
    assert m.handle(Launched([n1])) == [Launch(n2)] and m.in_flight == {1: n1}
    assert m.handle(Completed([t1])) == [] and m.draining == []
    assert m.handle(Launched([n2])) == []
    n3 = task(3, collective=True)
    assert m.handle(Enqueued([n3])) == [Launch(n3, (n1,))]  # t1 is no longer waited for


def test_validation_failure_carries_the_recent_stimuli() -> None:
    m = machine()
    t1 = task(1)
    m.handle(Enqueued([t1]))
    m.in_flight[5] = task(5)  # corrupt: a seq past the head of the order is in flight
    with pytest.raises(InvariantError) as e:
        m.handle(Launched([t1]))
    assert "task(seq=5" in str(e.value).lower() and "head 2" in e.value.problem
    assert [s.text.split("(")[0] for s in e.value.history] == ["Enqueued", "Launched"]


def test_validation_is_off_unless_asked_and_the_log_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PATHWAYS_VALIDATE", raising=False)
    assert not WorkerState().validate_each
    monkeypatch.setenv("PATHWAYS_VALIDATE", "1")
    m = WorkerState()
    assert m.validate_each
    for seq in range(1, 200):
        t = task(seq)
        assert m.handle(Enqueued([t])) == [Launch(t)]
        m.handle(Launched([t]))
        m.handle(Completed([t]))
    assert len(m.history()) == 64 and m.backlog == 0
