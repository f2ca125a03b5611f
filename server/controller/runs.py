"""A run as the dispatcher holds it (dispatch.py), and the fields of the tasks it makes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any

from schemas.pathways.v1 import worker_pb2 as wpb

from ..scheduler import DispatchedNode
from .client_session import ClientSession
from .cluster import HostInfo
from .plans import Plan
from .programs import ProgramRecord
from .segments import GATHERED, PROGRAM_INPUT, SegmentPlan


@dataclass(slots=True)
class RunState:
    run_id: int
    session: ClientSession
    program: ProgramRecord
    plan: Plan
    input_ids: list[int]
    input_homes: list[str]
    buffers: list[list[int]]  # segment -> ids of its outputs
    gathered: list[int]  # gathered value (segments.GATHERED) -> its id on the readers' hosts
    # sequential dispatch: outputs a later segment on the same worker reads are kept by the worker
    # (their reader is not enqueued yet, so the worker would free them); released when the run ends
    held_ids: dict[str, list[int]] = field(default_factory=dict)  # worker address -> held buffer ids
    templates: dict[int, wpb.Task] = field(default_factory=dict)  # task group (Plan.group_of) -> its task
    # its workers report its tasks' ends at once: the controller waits for them (a proxy client
    # blocking on its outputs: server/proxy/cluster_backend.py `ready`)
    prompt: bool = False

    def all_buffers(self) -> list[int]:
        """Every buffer its segments make (the program's outputs and its intermediates)."""
        return [b for ids in self.buffers for b in ids]


def never_reading(runs: Mapping[int, RunState], run_ids: Iterable[int],
                  lost: dict[int, str]) -> list[tuple[RunState, str, str]]:
    """Of `run_ids` (submission order), the runs that read a buffer of `lost` (buffer id -> why
    it will never be computed), each with the error it fails with (naming its first such input)
    and why its own outputs will never be computed: that input's why (the chain's first
    failure, as refusals name it: dispatch.py `refuse`). They join `lost`, so the reader's
    readers submitted after it are found in the same pass."""
    out = []
    for rid in run_ids:
        run = runs.get(rid)
        if run is None:
            continue
        for k, b in enumerate(run.input_ids):
            why = lost.get(b)
            if why is not None:
                out.append((run, f"input {k} (buffer {b:#x}) will never be computed: {why}", why))
                lost.update(dict.fromkeys(run.all_buffers(), why))
                break
    return out


def unmade_inputs_elsewhere(runs: Iterable[RunState], unmade: Set[int]) -> dict[str, list[int]]:
    """Per worker address, the `unmade` buffers (outputs of runs that failed before they
    started) that these runs read from there: an admitted reader had its input's home send it
    on (`Enqueue.sends`), which keeps the buffer pending there until a Drop's `never_ids` fails it."""
    out: dict[str, dict[int, None]] = {}
    for run in runs:
        own = run.plan.addresses
        for b, home in zip(run.input_ids, run.input_homes, strict=False):
            if b in unmade and home and home not in own:
                for address in home.split("|"):
                    if address not in own:
                        out.setdefault(address, {})[b] = None
    return {a: list(ids) for a, ids in out.items()}


def task_fields(run: RunState, d: DispatchedNode, seg: SegmentPlan, host: HostInfo,
                sends: dict[str, list[tuple[int, str]]]) -> dict[str, Any]:
    """A task's fields (`wpb.Task`); program inputs held elsewhere are added to `sends`."""
    inputs = []
    for source, k in seg.inputs:
        if source == PROGRAM_INPUT:
            bid = run.input_ids[k]
            home = run.input_homes[k]
            if home and home != host.address and "|" not in home:  # "|": on every member already
                sends.setdefault(home, []).append((bid, host.address))
            inputs.append(bid)
        elif source == GATHERED:
            inputs.append(run.gathered[k])
        else:
            inputs.append(run.buffers[source][k])
    outputs = run.buffers[d.node_index]
    visible = seg.visible
    if run.session.sequential and any(seg.read_later_here):
        visible = [v or h for v, h in zip(visible, seg.read_later_here, strict=True)]
        run.held_ids.setdefault(host.address, []).extend(
            b for b, v, h in zip(outputs, seg.visible, seg.read_later_here, strict=True) if h and not v)
    fields: dict[str, Any] = dict(run_id=d.run_id, segment=d.node_index, seq=d.seq,
                                  segment_id=seg.definition.segment_id, input_ids=inputs, output_ids=outputs,
                                  output_visible=visible, owner=run.session.owner,
                                  report_promptly=run.session.sequential or run.prompt)
    if run.gathered and any(k >= 0 for k in seg.route_keys):
        fields["route_ids"] = [run.gathered[k] if k >= 0 else 0 for k in seg.route_keys]
    return fields


def peer_inputs_by_host(run: RunState) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """Per host, the ids of what other workers send there for the run's segments: (its gathered
    values, segments.GATHERED inputs; the outputs routed to it from other hosts; those of them
    no client holds, the run's intermediates). A Drop of the run names them (controller.proto
    Drop.gathered_ids, routed_ids, unread_ids): their readers may never come."""
    out: dict[str, tuple[dict[int, None], dict[int, None], dict[int, None]]] = {}
    segments = run.plan.segments
    for seg in segments:
        gathered, routed, unread = out.setdefault(seg.host.name, ({}, {}, {}))
        for source, k in seg.inputs:
            if source == GATHERED:
                gathered[run.gathered[k]] = None
            elif source >= 0 and segments[source].host.name != seg.host.name:
                routed[run.buffers[source][k]] = None
                if not segments[source].visible[k]:
                    unread[run.buffers[source][k]] = None
    return {h: (list(g), list(r), list(u)) for h, (g, r, u) in out.items() if g or r}
