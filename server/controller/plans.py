"""A program's plan for one placement of its slices: its segments (`segments.py`), the scheduler's
node specs, and what lets a run's per-segment work be shared (output layouts, task groups).
The dispatcher caches one per (program, dispatch mode) and checks it against the slices' and
hosts' epochs before each run (`plan_cache.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..scheduler import NodeSpec
from .errors import InvalidArgument
from .segments import PROGRAM_INPUT, Gang, SegmentPlan, cut, gathered_count, narrowed

if TYPE_CHECKING:
    from .cluster import HostInfo
    from .programs import ProgramRecord
    from .slices import Placement


@dataclass
class Plan:
    """A program's segments for one placement of its slices (cached per program)."""

    key: tuple[Any, ...]
    segments: list[SegmentPlan]
    specs: tuple[NodeSpec, ...]
    epoch: tuple[int, int] = (-1, -1)  # (slice epoch, host epoch) it was last checked at
    gathered: int = 0  # values of gang nodes gathered where they are read (segments.cut)
    addresses: frozenset[str] = frozenset()  # of the workers running its segments
    # segment -> its outputs' layout in `layouts`: (client output index or -1, (node, output)) per
    # output. A gang node's member segments share one (its parts of a value share its id), so a
    # run makes one id list per layout, not one per member.
    layout_of: list[int] = field(default_factory=list)
    layouts: list[tuple[tuple[int, tuple[int, int]], ...]] = field(default_factory=list)
    # segment -> its task group, or -1: the member segments of a gang node read and write the
    # same buffer ids, so a run's tasks for them differ only in segment, seq and segment id. A run
    # builds one `Task` per group and copies it per member (`Dispatcher._dispatch`).
    group_of: list[int] = field(default_factory=list)
    # segment -> its definition's id, and whether it reads a program input (the dispatcher's fast
    # path for a gang member, `Dispatcher._dispatch_all`, takes neither from the segment)
    segment_ids: list[int] = field(default_factory=list)
    reads_input: list[bool] = field(default_factory=list)
    # the generation of each of the program's slices (in name order) it was made for: a run planned
    # by its client on others is refused (RunProgram.slice_generations, `Dispatcher.submit`)
    generations: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        index: dict[tuple[tuple[int, tuple[int, int]], ...], int] = {}
        for seg in self.segments:
            layout = tuple(zip(seg.client_outputs, seg.outputs, strict=True))
            self.layout_of.append(index.setdefault(layout, len(index)))
        self.layouts = list(index)
        self.group_of = task_groups(self.segments, self.layout_of)
        self.segment_ids = [seg.definition.segment_id for seg in self.segments]
        self.reads_input = [any(source == PROGRAM_INPUT for source, _ in seg.inputs) for seg in self.segments]


def task_groups(segments: Sequence[SegmentPlan], layout_of: Sequence[int]) -> list[int]:
    """Per segment: its group (>= 0) when another segment's tasks carry the same ids in every
    run (same inputs, outputs, visibility and routes: the members of a gang node), else -1."""
    keys = []
    for seg in segments:
        # an input made by a segment is that segment's output list (shared by its layout)
        inputs = tuple((source if source < 0 else -3 - layout_of[source], k) for source, k in seg.inputs)
        keys.append((inputs, layout_of[seg.index], tuple(seg.visible), tuple(seg.read_later_here),
                     tuple(seg.route_keys)))
    count: dict[object, int] = {}
    for key in keys:
        count[key] = count.get(key, 0) + 1
    groups: dict[object, int] = {}
    return [groups.setdefault(key, len(groups)) if count[key] > 1 else -1 for key in keys]


def check_spread_inputs(plan: Plan, homes: Sequence[str]) -> None:
    """An input that is an array of a multi-host slice (its home lists every member's address,
    "a|b") stays where it is: each member reads its own part. Only computations on those
    members can read it."""
    spread = {k: home.split("|") for k, home in enumerate(homes) if "|" in home}
    if not spread:
        return
    for seg in plan.segments:
        for source, k in seg.inputs:
            if source == PROGRAM_INPUT and k in spread and not (
                    seg.definition.group_generation and seg.host.address in spread[k]):
                raise InvalidArgument(
                    f"input {k} is an array of a multi-host slice (its parts are on {', '.join(spread[k])}); "
                    f"{seg.definition.label} is not a computation of that slice's hosts: pass it within one "
                    "@pw.program (the parts are then gathered where they are read) or fetch it")


def input_hosts(plan: Plan, homes: Sequence[str],
                host_by_address: Callable[[str], HostInfo | None]) -> tuple[str, ...]:
    """Hosts holding the run's inputs that run none of its segments (the scheduler fails the
    run if one is lost: those inputs would never arrive). Raises InvalidArgument for an input
    held by a worker that is not ready: it would be waited for until the hang timeout."""
    own = plan.addresses
    out: dict[str, None] = {}
    for k, home in enumerate(homes):
        if not home or home in own:
            continue
        for address in home.split("|"):
            host = host_by_address(address)
            if host is None:
                raise InvalidArgument(f"input {k} is held by the worker at {address}, which is not ready "
                                      "(lost, or reconnecting): compute it again")
            if address not in own:
                out[host.name] = None
    return tuple(out)


def placement_key(placements: Mapping[str, Placement]) -> tuple[Any, ...]:
    """What a plan depends on in its slices' placements (by slice name): a cached plan whose key
    is this one is still right."""
    return tuple(
        (n, p.generation, p.host.name, p.host.address, tuple(p.local_devices),
         p.gang.generation if p.gang is not None else 0) for n, p in placements.items()
    )


def placed_plan(prog: ProgramRecord, placements: Mapping[str, Placement], key: tuple[Any, ...],
                epoch: tuple[int, int], segment_ids: Iterator[int], sequential: bool) -> Plan:
    """The program's segments under `placements` (its slices', by name; `key` their
    `placement_key`). Sequential dispatch keeps the nodes on different devices of a worker in
    segments of their own."""
    graph = prog.graph
    nodes = [placements[n.slice] for n in graph.nodes]
    # a node on part of its slice (or its devices in another order) names them (checked at
    # registration: programs.check_devices); on a slice spanning hosts it runs on the members
    # holding them only (segments.narrowed): one plain computation, or a smaller gang
    hosts: list[HostInfo] = []
    devices: list[list[int]] = []
    gangs: list[Gang | None] = []
    for n, p in zip(graph.nodes, nodes, strict=True):
        host, devs, gang = p.host, list(p.local_devices), p.gang
        if n.devices and gang is not None:
            host, devs, gang = narrowed(gang, n.devices)
        elif n.devices:
            devs = [p.local_devices[v] for v in n.devices]
        hosts.append(host)
        devices.append(devs)
        gangs.append(gang)
    segments = cut(prog, hosts, devices, [p.island for p in nodes], segment_ids, across_devices=not sequential,
                   gangs=gangs)
    return Plan(key, segments, tuple(s.spec for s in segments), epoch, gathered_count(segments),
                frozenset(s.host.address for s in segments),
                generations=[placements[n].generation for n in sorted(placements)])


class Placements(Protocol):
    """Where slices run (the slice service): `epoch` changes whenever any slice does."""

    epoch: int

    def placement(self, name: str) -> Placement:
        """Raises a ControllerError (NotFound, Rejected) when the slice cannot run now."""
        ...
