"""Cutting a placed program into segments: the units of gang order.

A segment is a maximal run of consecutive nodes (by index) placed on one worker, whatever
devices of it each node uses. A run is admitted atomically, so the nodes it has on one worker
take consecutive seqs there anyway: giving the whole segment ONE seq changes no device's order,
and it lets the scheduler, the wire and the worker handle a run of a 128-node program on one
slice as one computation instead of 128, and the stages of a pipeline that share a worker as
one task whose hops between devices are JAX's, not the controller's. The worker executes each
run of consecutive nodes on the same devices as one fused XLA computation; values that never
leave it are never materialized.

Only index-consecutive nodes join (not merely nodes that end up with consecutive seqs): with
nodes 0 and 2 on worker A and node 1 elsewhere (a -> b -> a), a segment {0, 2} would wait for
node 1, which waits for node 0 inside it.

Everything here is pure: a placement in, segment plans out.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from schemas.pathways.v1 import worker_pb2 as wpb

from ..scheduler import NodeSpec
from .cluster import HostInfo
from .groups import GROUP_STRIDE
from .programs import ProgramRecord

MAX_SEGMENT_NODES = 512  # bounds a fused computation (and its compile time)
PROGRAM_INPUT = -1
GATHERED = -2  # an input (GATHERED, key): an output of a gang node gathered on the reader's host


@dataclass
class SegmentPlan:
    """One segment of a program under one placement."""

    index: int
    host: HostInfo
    first: int  # node indices first..last
    last: int
    definition: wpb.SegmentDef  # what the worker registers (segment_id set by the caller)
    spec: NodeSpec  # the scheduler's node
    # per external input: (PROGRAM_INPUT, program input) or (segment, index into its outputs)
    inputs: list[tuple[int, int]]
    outputs: list[tuple[int, int]]  # returned (node, output) pairs, as in definition.outputs
    client_outputs: list[int]  # per output: its index in the program's outputs, or -1
    visible: list[bool]  # per output: the client holds it
    # per output: a later segment on the same worker reads it (kept by sequential dispatch,
    # which enqueues that reader only later)
    read_later_here: list[bool]
    # per route of `definition`: the gathered value (key) it sends its part of, or -1
    route_keys: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.last - self.first + 1


@dataclass(frozen=True)
class Gang:
    """A node on a multi-host slice: one SPMD computation over the island's distributed group,
    executed by every member host that holds devices of the slice (server/controller/groups.py).

    `devices[v]` is virtual device v as group-wide number (process * GROUP_STRIDE + local index);
    `member_devices[m]` are the cluster device ids member m contributes (the scheduler's)."""

    generation: int
    members: tuple[HostInfo, ...]
    devices: tuple[int, ...]
    member_devices: tuple[tuple[int, ...], ...]
    # per virtual device: the index in `members` of the member holding it (empty: not known,
    # then the gang cannot be narrowed to part of its devices)
    member_of: tuple[int, ...] = ()


def narrowed(gang: Gang, devices: Sequence[int]) -> tuple[HostInfo, list[int], Gang | None]:
    """Where a node on virtual `devices` (distinct, in the node's order) of a multi-host slice
    placed as `gang` runs: on one member, (that host, its local device indices, None): a plain
    computation there; on several, (the first of them, the group-wide numbers, a gang of only
    those members, holding only those devices)."""
    if len(gang.member_of) != len(gang.devices):
        raise ValueError("a gang without its members' devices cannot be narrowed")
    involved = sorted({gang.member_of[v] for v in devices})
    if len(involved) == 1:
        return gang.members[involved[0]], [gang.devices[v] % GROUP_STRIDE for v in devices], None
    cluster: dict[int, int] = {}  # virtual device -> its cluster device id
    seen = [0] * len(gang.members)
    for v, m in enumerate(gang.member_of):
        cluster[v] = gang.member_devices[m][seen[m]]
        seen[m] += 1
    position = {m: k for k, m in enumerate(involved)}
    sub = Gang(gang.generation, tuple(gang.members[m] for m in involved), tuple(gang.devices[v] for v in devices),
               tuple(tuple(cluster[v] for v in devices if gang.member_of[v] == m) for m in involved),
               tuple(position[gang.member_of[v]] for v in devices))
    return sub.members[0], list(sub.devices), sub


def cut(prog: ProgramRecord, hosts: Sequence[HostInfo], devices: Sequence[Sequence[int]],
        islands: Sequence[str], ids: Iterator[int] | None = None, across_devices: bool = True,
        gangs: Sequence[Gang | None] | None = None) -> list[SegmentPlan]:
    """Segments of `prog` when node i runs on `devices[i]` (worker-local) of `hosts[i]` in `islands[i]`,
    or, where `gangs[i]` is set, on a multi-host slice (then `hosts[i]` and `devices[i]` are not read).

    `ids` yields the segment ids to register under (default 1, 2, ...). Without `across_devices`,
    a node on other devices than the one before it starts a new segment. A gang node is a segment
    per member host, alone (no neighbour fuses with it). An output of a gang node read elsewhere than on the
    same gang is gathered: each member sends its part to the reader's host (routes with a key),
    and the reader's input is (GATHERED, key)."""
    ids = ids if ids is not None else itertools.count(1)
    gangs = gangs if gangs is not None else [None] * len(hosts)
    graph = prog.graph
    bounds: list[tuple[int, int]] = []
    for i in range(len(graph.nodes)):
        if bounds and gangs[i] is None:
            first, last = bounds[-1]
            if (gangs[last] is None and hosts[i].name == hosts[last].name and last - first + 1 < MAX_SEGMENT_NODES
                    and (across_devices or list(devices[i]) == list(devices[last]))):
                bounds[-1] = (first, i)
                continue
        bounds.append((i, i))

    def where(i: int) -> list[HostInfo]:
        g = gangs[i]
        return list(g.members) if g is not None else [hosts[i]]

    client_index = {key: k for k, key in enumerate(prog.outputs)}
    # (node, output) -> {host name: (segment, position in its outputs)}, filled as segments are planned
    returned: dict[tuple[int, int], dict[str, tuple[int, int]]] = {}
    gathered: dict[tuple[int, int], int] = {}  # (node, output) of a gang node read elsewhere -> key
    plans: list[SegmentPlan] = []
    for first, last in bounds:
        gang = gangs[first]
        members = where(first)
        for m, host in enumerate(members):
            s = len(plans)
            ext: dict[tuple[int, int], int] = {}  # source -> external input position
            inputs: list[tuple[int, int]] = []
            nodes: list[wpb.SegmentNode] = []
            deps: set[int] = set()
            used: dict[int, None] = {}  # the devices of its nodes, first seen first
            for i in range(first, last + 1):
                node = graph.nodes[i]
                node_devices = list(gang.devices) if gang is not None else list(devices[i])
                used.update(dict.fromkeys(node_devices))
                sn = wpb.SegmentNode(function_id=node.function_id, label=_node_label(prog, i),
                                     local_devices=node_devices)
                for ref in node.inputs:
                    if ref.WhichOneof("source") == "program_input":
                        source = (PROGRAM_INPUT, ref.program_input)
                    else:
                        n, o = ref.node_output.node, ref.node_output.output
                        if n >= first:  # produced inside the segment
                            sn.inputs.append(-1 - (n - first))
                            sn.input_outputs.append(o)
                            continue
                        made = returned[(n, o)]
                        producer = gangs[n]
                        if producer is None:
                            source = next(iter(made.values()))
                            deps.add(source[0])
                        elif _same_gang(gang, producer):
                            source = made[host.name]  # this member's own part
                            deps.add(source[0])
                        else:  # the members' parts, gathered on this host (routes of the producer)
                            source = (GATHERED, gathered[(n, o)])
                            deps.update(seg for seg, _ in made.values())
                    if source not in ext:
                        ext[source] = len(inputs)
                        inputs.append(source)
                    sn.inputs.append(ext[source])
                    sn.input_outputs.append(0)
                nodes.append(sn)
            outputs: list[tuple[int, int]] = []
            client_outputs: list[int] = []
            read_later_here: list[bool] = []
            routes: list[wpb.OutputRoute] = []
            route_keys: list[int] = []
            for i in range(first, last + 1):
                for o in range(graph.nodes[i].num_outputs):
                    readers = [r for r in prog.consumers.get((i, o), ()) if r > last]
                    k = client_index.get((i, o), -1)
                    if k < 0 and not readers:
                        continue  # used inside the segment only, or by nobody
                    position = len(outputs)
                    returned.setdefault((i, o), {})[host.name] = (s, position)
                    outputs.append((i, o))
                    client_outputs.append(k)
                    read_later_here.append(any(h.name == host.name for r in readers for h in where(r)))
                    if gang is not None:
                        # read where it is by the same gang's members; anywhere else, each member
                        # sends its part to every reader's host (its own too) to be gathered there
                        away = {h.address: h for r in readers if not _same_gang(gangs[r], gang) for h in where(r)}
                        if away:
                            key = gathered.setdefault((i, o), len(gathered))
                            for address, reader in away.items():
                                routes.append(wpb.OutputRoute(
                                    output_index=position, address=address,
                                    same_host=reader.name != host.name and same_machine(reader, host)))
                                route_keys.append(key)
                        continue
                    for address, reader in {h.address: h for r in readers for h in where(r)
                                            if h.name != host.name}.items():
                        routes.append(wpb.OutputRoute(output_index=position, address=address,
                                                      same_host=same_machine(reader, host)))
                        route_keys.append(-1)
            label = _segment_label(prog, first, last)
            definition = wpb.SegmentDef(
                segment_id=next(ids), local_devices=list(used), nodes=nodes,
                outputs=[wpb.SegmentOutput(node=i - first, output=o) for i, o in outputs],
                routes=routes, label=label,  # whether it communicates is the worker's to read
                group_generation=gang.generation if gang is not None else 0)
            spec_devices = (gang.member_devices[m] if gang is not None
                            else tuple(host.device_ids[d] for d in used))
            spec = NodeSpec(index=s, host=host.name, island=islands[first], devices=spec_devices,
                            deps=tuple(sorted(deps)), label=label if gang is None else f"{label} @{host.name}")
            plans.append(SegmentPlan(s, host, first, last, definition, spec, inputs, outputs, client_outputs,
                                     [k >= 0 for k in client_outputs], read_later_here, route_keys))
    return plans


def _same_gang(a: Gang | None, b: Gang | None) -> bool:
    """Both nodes are gang nodes over the same members: each member reads its own part."""
    return a is not None and b is not None and a.members == b.members and a.generation == b.generation


def gathered_count(plans: Sequence[SegmentPlan]) -> int:
    """How many gathered values a plan has (one buffer id each per run)."""
    return max((k + 1 for p in plans for k in p.route_keys), default=0)


def same_machine(a: HostInfo, b: HostInfo) -> bool:
    """Hosts that share memory (shared-memory transfers between them)."""
    return bool(a.machine_id) and a.machine_id == b.machine_id


def _node_label(prog: ProgramRecord, i: int) -> str:
    return f"{prog.name}/{i} {prog.graph.nodes[i].name}".strip()


def _segment_label(prog: ProgramRecord, first: int, last: int) -> str:
    if first == last:
        return _node_label(prog, first)
    names = list(dict.fromkeys(prog.graph.nodes[i].name for i in range(first, last + 1)))
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{prog.name}/{first}-{last} ({shown})"
