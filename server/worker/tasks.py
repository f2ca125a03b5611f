"""The executor's records: a task (one run's execution of a registered segment, with what its
launch produced) and the launch thread's other work, plus helpers over tasks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from . import state as st
from .segments import SegmentInfo


@dataclass(eq=False, slots=True, kw_only=True)
class Task(st.Task):
    segment: int
    input_ids: list[int]
    output_ids: list[int]
    # per route of its segment: the id the receiver stores that output under (0: the output's own)
    route_ids: list[int] = field(default_factory=list)
    info: SegmentInfo | None  # None: the segment was never registered here (reported at launch)
    label: str
    prompt: bool = False  # the controller waits for its end (sequential dispatch)
    # once launched, until completed:
    values: list[Any] | None = None  # one per output id
    start_ns: int = 0
    nbytes: int = 0  # of the outputs
    reported_start: bool = False

    def route_id(self, route: int, output_id: int) -> int:
        """The id route `route` delivers its output under."""
        return self.route_ids[route] if route < len(self.route_ids) and self.route_ids[route] else output_id


@dataclass(slots=True)
class Exclusive:
    """Work for the launch thread alone, in order with the stimuli around it (not a stimulus of
    the state machine): joining an island group."""

    fn: Callable[[], None]



def info_of(task: Task) -> SegmentInfo:
    """A launched task's segment (a task without one never launches)."""
    info = task.info
    if info is None:
        raise RuntimeError(f"{task.label} was launched without a segment")
    return info


def wait_outputs(task: Task) -> str:
    """Blocks until the task's outputs are computed; its error, or ''."""
    try:
        jax.block_until_ready(task.values)
        return ""
    except Exception as e:
        return f"{task.label}: {type(e).__name__}: {e}"


def names_a_node(task: Task, error: str) -> bool:
    return task.info is not None and any(error.startswith(label + ":") for label in task.info.labels)
