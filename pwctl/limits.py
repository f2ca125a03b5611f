"""Bounds of request fields that the controller enforces and `pwctl` checks first, in one place for
both: the controller imports them from here (as it does pwctl.errors), and pwctl never imports
server code. Light on purpose: `pwctl submit --help` shows them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)

MAX_PRIORITY = 1000  # a job's priority (SubmitJobRequest.priority) is -MAX_PRIORITY..MAX_PRIORITY
MAX_WEIGHT = 1e6  # a job's (and a session's) proportional-share weight is a number in (0, MAX_WEIGHT]
DISPATCH_MODES = ("parallel", "sequential")  # a session's dispatch (Hello.dispatch; PWCTL_DISPATCH)


def share_problem(what: str, priority: int, weight: float) -> str:
    """What is wrong with a `what`'s ("job", "session") priority and proportional-share weight as the
    controller takes them (weight 0: not set, counted as 1: a request's field left at its default),
    in one line; "" when both are in range. One wording for a job's and a session's, which are
    checked alike: a job's driver's session gets its job's."""
    if abs(priority) > MAX_PRIORITY:
        return f"{what} priority {priority} is out of range: use -{MAX_PRIORITY}..{MAX_PRIORITY}"
    # not `weight <= 0 or weight > MAX_WEIGHT`: NaN is in no range (an infinite or NaN weight made
    # the scheduler's account of a session NaN, policy.catch_up: 0 * inf)
    if weight != 0 and not 0 < weight <= MAX_WEIGHT:
        return f"{what} weight {weight:g} is out of range: use a number in (0, {MAX_WEIGHT:g}]"
    return ""


def number_in(text: str, parse: Callable[[str], N], low: float, high: float) -> N | None:
    """`text` parsed (int or float) when it is a number in low..high, else None (NaN is in no
    range): the check behind a client's PWCTL_* amounts (pwctl/api/env.py) and a server's PATHWAYS_*
    tuning settings (server/envsetting.py), which each word their own error."""
    try:
        n = parse(text)
    except ValueError:
        return None
    return n if low <= n <= high else None
