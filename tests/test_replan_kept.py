"""The runs a `pw` client keeps to send again (pwctl/api/replan.py `Replans`) are let go of once
the controller says it handled them (RunsDone.last_run names the last run message it handled).

`handled` let go of the kept runs up to `last_run` only when `last_run` was itself kept: a report
naming a run refused and sent again (its refusal let go of it first) let go of none of the runs
sent before it, and their array inputs stayed held until a later report named a kept run (none
comes while no run is over). The kept runs are in the order sent, which is not that of their ids
(a call takes its run id before its uploads, outside the plan lock): `handled` goes by that order.

The state alone, no session: `handled`, `keep` and `sent_again` read nothing of the runtime.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import pytest

from pwctl.api.replan import Replans

if TYPE_CHECKING:
    from pwctl.api.runtime import Runtime

pytestmark = [pytest.mark.timeout(30)]


@dataclass
class _Run:
    """What is kept of a run (replan.py `Sent`); never sent again here."""

    slices: list[str] = field(default_factory=list)
    replans: int = 0

    def send_again(self, rt: Runtime) -> int:
        raise AssertionError("not sent again in these tests")


def _replans(*run_ids: int) -> Replans:
    replans = Replans(cast("Runtime", None), threading.Lock())
    for run_id in run_ids:
        replans.keep(run_id, _Run())
    return replans


def test_a_report_naming_a_run_sent_again_lets_go_of_the_runs_sent_before_it() -> None:
    replans = _replans(1, 2, 3, 4)
    replans.sent_again(3, 9)  # refused for its plan, sent again as run 9
    replans.keep(9, _Run())
    assert replans.unanswered([1, 2]) and not replans.unanswered([3])
    replans.handled(3)  # the controller handled every run up to 3 (it refused that one)
    assert not replans.unanswered([1, 2, 3])
    assert replans.unanswered([4]) and replans.unanswered([9])
    assert replans.kept() == 2
    replans.handled(9)
    assert replans.kept() == 0


def test_runs_are_let_go_of_in_the_order_sent_not_that_of_their_ids() -> None:
    replans = _replans(7, 5, 6)  # 5's call took its id first, 7's sent first
    replans.handled(7)
    assert not replans.unanswered([7]) and replans.unanswered([5]) and replans.unanswered([6])
    replans.sent_again(5, 8)
    replans.handled(5)
    assert replans.unanswered([6]) and replans.kept() == 1


def test_a_report_naming_a_run_not_kept_lets_go_of_none() -> None:
    replans = _replans(4, 5)
    replans.handled(3)  # sent before them, not kept (or let go of already)
    replans.handled(5)
    replans.handled(5)  # told again (more runs over, none handled since)
    assert replans.kept() == 0
    replans.keep(6, _Run())
    replans.handled(5)
    assert replans.unanswered([6])
