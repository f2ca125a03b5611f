"""The dispatcher's plans (plans.py), one per (program, dispatch mode), and what of them each
worker has registered.

A plan is made once and used by every run of its program until a slice of it or a host changed
(`Placements.epoch`, or a host up or lost: `host_changed`); it is then checked against its
slices' placements again and cut anew only where one of them differs (`placement_key`). A
segment is registered on its worker once: the dispatcher sends its definition, and the functions
the worker lacks, with the first task that needs it (dispatch.py `_dispatch`), and notes them in
`host_segments` and `host_functions`; a worker that comes back has neither. The segments of a
plan replaced by a new cut, or of a program no client uses any more, are forgotten on the
workers that registered them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from .plans import Placements, Plan, placed_plan, placement_key

if TYPE_CHECKING:
    from .programs import ProgramRecord


class PlanCache:
    """The plans of the programs runs were submitted for, and the segments and functions each
    worker has (by host name). `forgotten(host, segment_id)` has a worker forget a segment (the
    dispatcher's next flush tells it). The dispatcher reads and fills `host_segments` and
    `host_functions` itself, on its hot path: they are changed in place, never rebound."""

    def __init__(self, placements: Placements, forgotten: Callable[[str, int], None]) -> None:
        self.placements = placements  # where slices run (the slice service)
        self._forgotten = forgotten
        self._plans: dict[tuple[str, bool], Plan] = {}  # (program, sequential) -> its plan
        self.host_segments: dict[str, set[int]] = {}  # host -> segment ids registered there
        self.host_functions: dict[str, set[str]] = {}  # host -> function ids it has
        self._segment_ids = itertools.count(1)
        self._host_epoch = 0

    def plan(self, prog: ProgramRecord, sequential: bool) -> Plan:
        """The program's segments under its slices' current placement. Sequential dispatch
        (the baseline that waits for each computation before sending the next) keeps the nodes
        on different devices of a worker in segments of their own."""
        epoch = (self.placements.epoch, self._host_epoch)
        plan = self._plans.get((prog.program_id, sequential))
        if plan is not None and plan.epoch == epoch:
            return plan  # nothing about slices or hosts changed since it was made
        placements = {name: self.placements.placement(name) for name in sorted(prog.slices)}
        key = placement_key(placements)
        if plan is not None and plan.key == key:
            plan.epoch = epoch
            return plan
        if plan is not None:
            self._forget(plan)
        plan = placed_plan(prog, placements, key, epoch, self._segment_ids, sequential)
        self._plans[(prog.program_id, sequential)] = plan
        return plan

    def forget(self, program_ids: list[str]) -> None:
        """Programs no client uses any more: their segments leave the workers."""
        for pid in program_ids:
            for sequential in (False, True):
                plan = self._plans.pop((pid, sequential), None)
                if plan is not None:
                    self._forget(plan)

    def host_changed(self, name: str) -> None:
        """Host `name` came up or was lost: it has none of the segments and functions sent to it
        before, and every plan is checked against the hosts again before its next run."""
        self._host_epoch += 1
        self.host_functions.pop(name, None)
        self.host_segments.pop(name, None)

    def _forget(self, plan: Plan) -> None:
        for seg in plan.segments:
            sid = seg.definition.segment_id
            known = self.host_segments.get(seg.host.name)
            if known is not None and sid in known:
                known.discard(sid)
                self._forgotten(seg.host.name, sid)
