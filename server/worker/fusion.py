"""Fusing a run's consecutive nodes into one XLA computation.

A run is admitted atomically, so the nodes it has on one host occupy consecutive seqs of
that host's gang order. When consecutive nodes of one run also share their devices, the
worker may execute them as ONE computation (each node's exported function called in
order inside one jit) without changing what any device sees or in which order: one
launch instead of one per node, and intermediates that never leave the segment are never
materialized as buffers. Fused executables are cached by the segment's structure
(functions and wiring), so every run of a program reuses the same one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

from schemas.pathways.v1 import worker_pb2 as wpb

from .executable import Executable, Runnable

MAX_SEGMENT = 512


@dataclass(frozen=True)
class Segment:
    """The wiring of consecutive nodes of one run, in buffer-id-free terms.

    `wiring[k]` lists node k's inputs: (0, i) = external input i, (1, m, j) = output j of
    segment node m. `keep` lists the (node, output) pairs the segment returns: outputs the
    client holds, that go to other workers, or that later nodes outside it read.
    """

    function_ids: tuple[str, ...]
    wiring: tuple[tuple[tuple[int, ...], ...], ...]
    keep: tuple[tuple[int, int], ...]
    devices: tuple[int, ...]


@dataclass
class SegmentPlan:
    segment: Segment
    external_ids: list[int]  # buffer ids of the external inputs, in order
    reads: list[int]  # buffer ids whose consumer count the segment's launch releases
    internal_ids: list[int]  # outputs used only inside the segment (never stored)
    kept_ids: list[int]


def plan_segment(nodes: Sequence[wpb.NodeExec], consumers: dict[int, int]) -> SegmentPlan:
    """Derives a segment's structure. `consumers[b]` is how many enqueued readers buffer b
    has in the store: an output read more often than inside the segment must be kept."""
    produced: dict[int, tuple[int, int]] = {}
    ext_pos: dict[int, int] = {}
    external: list[int] = []
    internal_reads: dict[int, int] = {}
    wiring = []
    reads: list[int] = []
    for k, n in enumerate(nodes):
        w: list[tuple[int, ...]] = []
        for b in n.input_ids:
            if b in produced:
                w.append((1, *produced[b]))
                internal_reads[b] = internal_reads.get(b, 0) + 1
            else:
                if b not in ext_pos:
                    ext_pos[b] = len(external)
                    external.append(b)
                w.append((0, ext_pos[b]))
                reads.append(b)
        wiring.append(tuple(w))
        for j, o in enumerate(n.output_ids):
            produced[o] = (k, j)
    keep: list[tuple[int, int]] = []
    kept: list[int] = []
    internal: list[int] = []
    for k, n in enumerate(nodes):
        routed = {r.output_index for r in n.routes}
        for j, o in enumerate(n.output_ids):
            visible = j < len(n.output_visible) and n.output_visible[j]
            inside = internal_reads.get(o, 0)
            if visible or j in routed or consumers.get(o, 0) > inside:
                keep.append((k, j))
                kept.append(o)
                reads.extend([o] * inside)  # its internal reads were counted as consumers
            else:
                internal.append(o)
    seg = Segment(
        function_ids=tuple(n.function_id for n in nodes),
        wiring=tuple(wiring),
        keep=tuple(keep),
        devices=tuple(nodes[0].local_devices),
    )
    return SegmentPlan(seg, external, reads, internal, kept)


class FusedExecutable(Runnable):
    """Several exported functions called in order inside one jit."""

    def __init__(self, segment: Segment, exes: Sequence[Executable]) -> None:
        self.segment = segment
        self.exes = list(exes)
        n_ext = 1 + max((w[1] for ws in segment.wiring for w in ws if w[0] == 0), default=-1)
        in_avals: list[Any] = [None] * n_ext
        in_shardings: list[Any] = [None] * n_ext
        for k, ws in enumerate(segment.wiring):
            for pos, w in enumerate(ws):
                if w[0] == 0 and in_avals[w[1]] is None:
                    in_avals[w[1]] = self.exes[k].in_avals[pos]
                    in_shardings[w[1]] = self.exes[k].in_shardings[pos]
        self.in_avals = tuple(in_avals)
        self.in_shardings = tuple(in_shardings)
        self.out_shardings = tuple(self.exes[k].out_shardings[j] for k, j in segment.keep)
        self.has_collectives = any(e.has_collectives for e in self.exes)
        exported = [e.exported for e in self.exes]
        wiring, keep = segment.wiring, segment.keep

        def fused(*ext: Any) -> tuple[Any, ...]:
            outs: list[tuple[Any, ...]] = []
            for exp, ws in zip(exported, wiring, strict=True):
                leaves = [ext[w[1]] if w[0] == 0 else outs[w[1]][w[2]] for w in ws]
                args, kwargs = jax.tree.unflatten(exp.in_tree, leaves)
                outs.append(tuple(jax.tree.leaves(exp.call(*args, **kwargs))))
            return tuple(outs[k][j] for k, j in keep)

        self._jitted = jax.jit(fused, in_shardings=self.in_shardings, out_shardings=self.out_shardings)
        self._init_call_path()

    @property
    def name(self) -> str:
        return f"fused[{len(self.exes)}]"


def fusable(prev: wpb.NodeExec, node: wpb.NodeExec) -> bool:
    """Whether `node` may join a segment ending with `prev`: the next node of the same run (by node
    index, not only by seq) on the same devices. Consecutive seqs are not enough: with nodes 0 and 2
    of a run on this host and node 1 elsewhere (a -> b -> a), node 2 waits for node 1, which waits
    for node 0; fused, the segment would wait for an input that only its own first node produces."""
    return (node.run_id == prev.run_id and node.local_devices == prev.local_devices
            and node.node_index == prev.node_index + 1)
