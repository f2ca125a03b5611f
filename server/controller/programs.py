"""Registered programs and the compiled functions they call (content-addressed).

A program is a validated dataflow graph; registering the same graph twice gives the same
id. Function bytes are kept once per content hash and sent to each worker once.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

from schemas.pathways.v1 import controller_pb2 as cpb

from .errors import InvalidArgument


@dataclass(frozen=True)
class FunctionRecord:
    function_id: str
    name: str
    exported: bytes
    donate: tuple[int, ...]


@dataclass
class ProgramRecord:
    """A registered graph plus what the dispatcher derives from it once."""

    program_id: str
    graph: cpb.ProgramGraph
    owners: set[str] = field(default_factory=set)
    deps: list[tuple[int, ...]] = field(default_factory=list)  # node -> producer nodes it reads
    consumers: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (node, out) -> readers
    input_readers: list[list[int]] = field(default_factory=list)  # program input -> reader nodes
    outputs: list[tuple[int, int]] = field(default_factory=list)

    @functools.cached_property
    def name(self) -> str:
        return self.graph.name or self.program_id  # one str (a proto field read makes a new one each time)

    @functools.cached_property
    def slices(self) -> frozenset[str]:
        return frozenset(n.slice for n in self.graph.nodes)


def analyze(program_id: str, graph: cpb.ProgramGraph) -> ProgramRecord:
    """Checks the graph is a well-formed DAG in topological order and derives its edges."""
    rec = ProgramRecord(program_id=program_id, graph=graph)
    rec.input_readers = [[] for _ in range(graph.num_inputs)]
    for i, node in enumerate(graph.nodes):
        if not node.function_id or not node.slice:
            raise InvalidArgument(f"node {i} of program {graph.name!r} has no function or slice")
        if node.num_outputs < 0:
            raise InvalidArgument(f"node {i} of program {graph.name!r} has a negative output count")
        deps: list[int] = []
        for ref in node.inputs:
            src = ref.WhichOneof("source")
            if src == "program_input":
                if not 0 <= ref.program_input < graph.num_inputs:
                    raise InvalidArgument(f"node {i} reads program input {ref.program_input}, which does not exist")
                rec.input_readers[ref.program_input].append(i)
            elif src == "node_output":
                n, o = ref.node_output.node, ref.node_output.output
                if not 0 <= n < i or not 0 <= o < graph.nodes[n].num_outputs:
                    raise InvalidArgument(f"node {i} reads output {o} of node {n}: not an earlier node's output")
                rec.consumers.setdefault((n, o), []).append(i)
                if n not in deps:
                    deps.append(n)
            else:
                raise InvalidArgument(f"node {i} has an input with no source")
        rec.deps.append(tuple(deps))
    for ref in graph.outputs:
        if ref.WhichOneof("source") != "node_output":
            raise InvalidArgument("program outputs must be node outputs (the client returns inputs itself)")
        n, o = ref.node_output.node, ref.node_output.output
        if not 0 <= n < len(graph.nodes) or not 0 <= o < graph.nodes[n].num_outputs:
            raise InvalidArgument(f"program output refers to output {o} of node {n}, which does not exist")
        rec.outputs.append((n, o))
    if len(set(rec.outputs)) != len(rec.outputs):
        raise InvalidArgument("program outputs must be distinct")
    return rec


def check_devices(graph: cpb.ProgramGraph, slices: dict[str, tuple[int, bool]]) -> None:
    """Checks the nodes that run on part of their slice (`ProgramNode.devices`): distinct virtual
    devices of the slice. `slices`: slice name -> (its device count, whether it spans hosts). On
    a slice spanning hosts such a node runs on the hosts holding those devices only (one plain
    computation on one of them, or a gang of those: dispatch.py, segments.narrowed)."""
    for i, node in enumerate(graph.nodes):
        if not node.devices:
            continue
        count, _ = slices[node.slice]
        devices = list(node.devices)
        if len(set(devices)) != len(devices) or not all(0 <= v < count for v in devices):
            raise InvalidArgument(f"node {i} of program {graph.name!r} runs on devices {devices}: not distinct "
                                  f"devices of slice {node.slice!r} (0..{count - 1})")


def program_id_of(graph: cpb.ProgramGraph) -> str:
    digest = hashlib.sha256(graph.SerializeToString(deterministic=True)).hexdigest()
    return f"p-{digest[:12]}"


class ProgramRegistry:
    def __init__(self) -> None:
        self.functions: dict[str, FunctionRecord] = {}
        self.programs: dict[str, ProgramRecord] = {}

    def add_functions(self, infos: list[cpb.FunctionInfo]) -> list[str]:
        """Stores the bytes given; returns the ids still missing."""
        missing = []
        for f in infos:
            if f.function_id in self.functions:
                continue
            if not f.exported:
                missing.append(f.function_id)
                continue
            digest = hashlib.sha256(f.exported).hexdigest()
            if digest != f.function_id:
                raise InvalidArgument(f"function {f.name!r}: its bytes do not match its id")
            self.functions[f.function_id] = FunctionRecord(f.function_id, f.name, f.exported, tuple(f.donate))
        return missing

    def register(self, graph: cpb.ProgramGraph, owner: str) -> ProgramRecord:
        pid = program_id_of(graph)
        rec = self.programs.get(pid)
        if rec is None:
            rec = analyze(pid, graph)
            for node in graph.nodes:
                if node.function_id not in self.functions:
                    raise InvalidArgument(f"function {node.function_id[:12]} of node {node.name!r} was never sent")
            self.programs[pid] = rec
        rec.owners.add(owner)
        return rec

    def drop_owner(self, owner: str) -> list[str]:
        """Forgets `owner`; returns the ids of the programs nobody owns any more (dropped)."""
        dropped = []
        for pid in [p for p, r in self.programs.items() if owner in r.owners]:
            rec = self.programs[pid]
            rec.owners.discard(owner)
            if not rec.owners:
                del self.programs[pid]
                dropped.append(pid)
        return dropped

    def slice_counts(self) -> dict[str, int]:
        """Slice name -> how many registered programs are placed on it (one pass)."""
        counts: dict[str, int] = {}
        for r in self.programs.values():
            for name in set(r.slices):
                counts[name] = counts.get(name, 0) + 1
        return counts

    def slice_users(self, slice_name: str) -> list[ProgramRecord]:
        return [r for r in self.programs.values() if slice_name in r.slices]

    def slice_in_use(self, name: str) -> str | None:
        """Why slice `name` may not be deleted (registered programs use it), or None."""
        users = self.slice_users(name)
        if not users:
            return None
        owners = sorted({o for r in users for o in r.owners})
        return f"{len(users)} registered program(s) use it (owners: {', '.join(owners)})"
