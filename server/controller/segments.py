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
from dataclasses import dataclass

from schemas.pathways.v1 import worker_pb2 as wpb

from ..scheduler import NodeSpec
from .cluster import HostInfo
from .programs import ProgramRecord

MAX_SEGMENT_NODES = 512  # bounds a fused computation (and its compile time)
PROGRAM_INPUT = -1


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

    @property
    def size(self) -> int:
        return self.last - self.first + 1


def cut(prog: ProgramRecord, hosts: Sequence[HostInfo], devices: Sequence[Sequence[int]],
        islands: Sequence[str], ids: Iterator[int] | None = None, across_devices: bool = True) -> list[SegmentPlan]:
    """Segments of `prog` when node i runs on `devices[i]` (worker-local) of `hosts[i]` in `islands[i]`.

    `ids` yields the segment ids to register under (default 1, 2, ...). Without `across_devices`,
    a node on other devices than the one before it starts a new segment."""
    ids = ids if ids is not None else itertools.count(1)
    graph = prog.graph
    bounds: list[tuple[int, int]] = []
    for i in range(len(graph.nodes)):
        if bounds:
            first, last = bounds[-1]
            if (hosts[i].name == hosts[last].name and last - first + 1 < MAX_SEGMENT_NODES
                    and (across_devices or list(devices[i]) == list(devices[last]))):
                bounds[-1] = (first, i)
                continue
        bounds.append((i, i))
    segment_of = [0] * len(graph.nodes)
    for s, (first, last) in enumerate(bounds):
        for i in range(first, last + 1):
            segment_of[i] = s
    client_index = {key: k for k, key in enumerate(prog.outputs)}
    # (node, output) -> (segment, position in its outputs), filled as segments are planned
    returned: dict[tuple[int, int], tuple[int, int]] = {}
    plans: list[SegmentPlan] = []
    for s, (first, last) in enumerate(bounds):
        host = hosts[first]
        ext: dict[tuple[int, int], int] = {}  # source -> external input position
        inputs: list[tuple[int, int]] = []
        nodes: list[wpb.SegmentNode] = []
        deps: set[int] = set()
        used: dict[int, None] = {}  # the devices of its nodes, first seen first
        for i in range(first, last + 1):
            node = graph.nodes[i]
            used.update(dict.fromkeys(devices[i]))
            sn = wpb.SegmentNode(function_id=node.function_id, label=_node_label(prog, i),
                                 local_devices=list(devices[i]))
            for ref in node.inputs:
                if ref.WhichOneof("source") == "program_input":
                    source = (PROGRAM_INPUT, ref.program_input)
                else:
                    n, o = ref.node_output.node, ref.node_output.output
                    if n >= first:  # produced inside the segment
                        sn.inputs.append(-1 - (n - first))
                        sn.input_outputs.append(o)
                        continue
                    source = returned[(n, o)]
                    deps.add(source[0])
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
        for i in range(first, last + 1):
            for o in range(graph.nodes[i].num_outputs):
                readers = [r for r in prog.consumers.get((i, o), ()) if r > last]
                k = client_index.get((i, o), -1)
                if k < 0 and not readers:
                    continue  # used inside the segment only, or by nobody
                position = len(outputs)
                returned[(i, o)] = (s, position)
                outputs.append((i, o))
                client_outputs.append(k)
                read_later_here.append(any(hosts[r].name == host.name for r in readers))
                for address, reader in {hosts[r].address: hosts[r] for r in readers
                                        if hosts[r].name != host.name}.items():
                    routes.append(wpb.OutputRoute(output_index=position, address=address,
                                                  same_host=same_machine(reader, host)))
        label = _segment_label(prog, first, last)
        definition = wpb.SegmentDef(
            segment_id=next(ids), local_devices=list(used), nodes=nodes,
            outputs=[wpb.SegmentOutput(node=i - first, output=o) for i, o in outputs],
            routes=routes, label=label)  # whether it communicates is the worker's to read
        spec = NodeSpec(index=s, host=host.name, island=islands[first],
                        devices=tuple(host.device_ids[d] for d in used),
                        deps=tuple(sorted(deps)), label=label)
        plans.append(SegmentPlan(s, host, first, last, definition, spec, inputs, outputs, client_outputs,
                                 [k >= 0 for k in client_outputs], read_later_here))
    return plans


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
