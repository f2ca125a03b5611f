"""When a worker sends its node events to the controller (server/worker/reporting.py; pure logic)."""

from __future__ import annotations

import pytest

from schemas.pathways.v1 import controller_pb2 as cpb
from server.worker.reporting import EventBuffer, ReportPolicy

POLICY = ReportPolicy(max_delay_s=0.05, max_events=4, low_water=2, min_interval_s=0.005, max_bytes=1000)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def done(run_id: int, ok: bool = True) -> cpb.NodeEvent:
    return cpb.NodeEvent(run_id=run_id, start_ns=1, end_ns=2, ok=ok, error="" if ok else "boom")


def started(run_id: int) -> cpb.NodeEvent:
    return cpb.NodeEvent(run_id=run_id, start_ns=1)  # a long task's 'started' (hang detection)


def buffer() -> tuple[EventBuffer, _Clock]:
    clock = _Clock()
    return EventBuffer(POLICY, clock), clock


def test_a_busy_worker_holds_its_events_until_the_first_is_max_delay_old() -> None:
    buf, clock = buffer()
    assert buf.due_in() is None
    assert buf.add([done(1)], backlog=10)  # the first one: the sender arms its timer
    assert buf.due_in() == pytest.approx(0.05)
    clock.t += 0.03
    assert not buf.add([done(2)], backlog=9)  # nothing new for the sender
    assert buf.due_in() == pytest.approx(0.02)
    clock.t += 0.02
    assert buf.due_in() == 0
    assert [e.run_id for e in buf.take()] == [1, 2]
    assert buf.due_in() is None and len(buf) == 0


@pytest.mark.parametrize("why", ["low backlog", "prompt", "failure", "max events", "big outputs"])
def test_events_go_at_once_when_someone_may_be_waiting(why: str) -> None:
    buf, clock = buffer()
    assert buf.add([done(1)], backlog=10)
    clock.t += 0.01
    if why == "low backlog":  # about to run dry: the controller must admit more work in time
        woke = buf.add([done(2)], backlog=2)
    elif why == "prompt":  # a sequential run's next node is sent only after this one
        woke = buf.add([done(2)], prompt=True, backlog=10)
    elif why == "failure":
        woke = buf.add([done(2, ok=False)], backlog=10)
    elif why == "big outputs":  # what the client dropped meanwhile is freed only after the report
        assert not buf.add([done(2)], backlog=10, nbytes=600)
        woke = buf.add([done(3)], backlog=10, nbytes=400)
    else:
        woke = buf.add([done(2), done(3), done(4)], backlog=10)
    assert woke and buf.due_in() == 0
    assert len(buf.take()) == {"max events": 4, "big outputs": 3}.get(why, 2)


def test_started_events_and_unknown_backlog_are_not_urgent() -> None:
    buf, _ = buffer()
    assert buf.add([started(1)])
    assert buf.due_in() == pytest.approx(0.05)


def test_sends_are_min_interval_apart_even_when_urgent() -> None:
    buf, clock = buffer()
    buf.add([done(1)], backlog=0)
    assert buf.due_in() == 0
    buf.take()
    clock.t += 0.001
    assert buf.add([done(2)], backlog=0)
    assert buf.due_in() == pytest.approx(0.004)
    clock.t += 0.004
    assert buf.due_in() == 0


def test_an_event_the_controller_waits_for_is_not_held_for_the_min_interval() -> None:
    """A prompt task's event (the controller answers a readiness check, or sends a sequential
    run's next node, only when it comes) goes at once even right after a send; what is held
    with it goes too, and the next send is min_interval after it again."""
    buf, clock = buffer()
    buf.add([done(1)], backlog=0)
    buf.take()
    clock.t += 0.001
    assert buf.add([done(2)], backlog=5)
    assert buf.due_in() == pytest.approx(0.05)  # held: max_delay after it came
    assert buf.add([done(3)], prompt=True, backlog=5)  # wake the sender: due now
    assert buf.due_in() == 0
    assert [e.run_id for e in buf.take()] == [2, 3]
    clock.t += 0.001
    assert buf.add([done(4)], backlog=0)  # urgent, not prompt: min_interval from the last send
    assert buf.due_in() == pytest.approx(0.004)


def test_urgency_ends_with_the_send() -> None:
    buf, clock = buffer()
    buf.add([done(1)], prompt=True, nbytes=900)
    buf.take()
    clock.t += 1.0
    assert buf.add([done(2)], backlog=10, nbytes=500)  # the bytes sent before count no more
    assert buf.due_in() == pytest.approx(0.05)
    assert not buf.add([done(3)], backlog=10, nbytes=400)
    assert buf.add([done(4)], backlog=1)  # became urgent: wake the sender again
    assert not buf.add([done(5)], backlog=0)  # already urgent
    assert buf.due_in() == 0
    assert not buf.add([])
