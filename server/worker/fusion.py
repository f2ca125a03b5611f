"""Running a registered segment: its nodes' exported functions, fused or one by one.

A segment (see server/controller/segments.py) is consecutive nodes of a program on one worker;
it holds one seq of the worker's gang order. Its *parts* are its maximal runs of consecutive
nodes on the same devices (most segments are one part). The worker executes each part as ONE
XLA computation (each node's exported function called in order inside one jit): one launch
instead of one per node, and values that never leave the part are never materialized; a chain
of calls of one function (a traced loop) becomes a loop in it, not N inlined copies. Parts
follow each other through JAX's async dispatch (an input on other devices of the worker is a
device-to-device copy), as the same calls would in one JAX process. Fused executables are
cached by the part's structure (functions, wiring, devices), so every run of a program, and
every program with the same structure, reuses the same one. A part that cannot be fused (a
node donates an input, or fusing fails) runs its nodes one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from schemas.pathways.v1 import worker_pb2 as wpb

from .executable import Executable, Runnable, call_exported

CHAIN_MIN = 4  # identical chained calls from which a fused part loops instead of inlining


@dataclass(frozen=True)
class Segment:
    """A segment's structure, free of buffer ids and of the program it came from.

    The controller owns the cut, the wiring and the devices (`of` takes them from the wire as
    given); the worker owns what follows from them for execution (`parts`, `chains`).

    `wiring[k]` lists node k's inputs: (0, i) = external input i, (1, m, j) = output j of
    segment node m. `keep` lists the (node, output) pairs the segment returns. Node k runs on
    the worker-local devices `node_devices[k]`; `devices` is all of them, first seen first.
    """

    function_ids: tuple[str, ...]
    wiring: tuple[tuple[tuple[int, ...], ...], ...]
    keep: tuple[tuple[int, int], ...]
    devices: tuple[int, ...]
    node_devices: tuple[tuple[int, ...], ...]

    @property
    def num_inputs(self) -> int:
        return 1 + max((w[1] for ws in self.wiring for w in ws if w[0] == 0), default=-1)

    @classmethod
    def of(cls, d: wpb.SegmentDef) -> Segment:
        wiring = []
        for n in d.nodes:
            if len(n.input_outputs) != len(n.inputs):
                raise ValueError(f"segment {d.label!r}: malformed wiring")
            wiring.append(tuple((0, i) if i >= 0 else (1, -1 - i, j)
                                for i, j in zip(n.inputs, n.input_outputs, strict=True)))
        for k, ws in enumerate(wiring):
            if any(w[0] == 1 and not 0 <= w[1] < k for w in ws):
                raise ValueError(f"segment {d.label!r}: node {k} reads a node that is not before it")
        # the controller owns the segment's devices (server/controller/segments.py): taken as
        # given, only checked for consistency
        devices = tuple(d.local_devices)
        node_devices = tuple(tuple(n.local_devices) or devices for n in d.nodes)
        if not devices or len(set(devices)) != len(devices):
            raise ValueError(f"segment {d.label!r}: its devices {list(devices)} are empty or repeat")
        within = set(devices)
        for k, devs in enumerate(node_devices):
            if not within.issuperset(devs):
                raise ValueError(f"segment {d.label!r}: node {k} runs on {list(devs)}, outside the segment's devices")
        return cls(
            function_ids=tuple(n.function_id for n in d.nodes),
            wiring=tuple(wiring),
            keep=tuple((o.node, o.output) for o in d.outputs),
            devices=devices,
            node_devices=node_devices,
        )

    def parts(self) -> list[Part]:
        """Its maximal runs of consecutive nodes on the same devices, each as a segment of its
        own; one part (the segment itself) when every node shares its devices."""
        bounds: list[tuple[int, int]] = []
        for k, devs in enumerate(self.node_devices):
            if bounds and self.node_devices[bounds[-1][0]] == devs:
                bounds[-1] = (bounds[-1][0], k + 1)
            else:
                bounds.append((k, k + 1))
        if len(bounds) == 1:
            return [Part(self, tuple((0, i) for i in range(self.num_inputs)), self.keep, 0)]
        read_after: list[set[tuple[int, int]]] = []  # per part: (node, output)s read by later parts
        for _, end in bounds:
            read_after.append({(w[1], w[2]) for ws in self.wiring[end:] for w in ws if w[0] == 1 and w[1] < end})
        parts = []
        for (start, end), later in zip(bounds, read_after, strict=True):
            sources: dict[tuple[int, ...], int] = {}
            wiring = []
            for ws in self.wiring[start:end]:
                local: list[tuple[int, ...]] = []
                for w in ws:
                    if w[0] == 1 and w[1] >= start:
                        local.append((1, w[1] - start, w[2]))
                    else:
                        local.append((0, sources.setdefault(w, len(sources))))
                wiring.append(tuple(local))
            kept = sorted({(n, o) for n, o in later | set(self.keep) if start <= n < end})
            devs = self.node_devices[start]
            sub = Segment(self.function_ids[start:end], tuple(wiring), tuple((n - start, o) for n, o in kept),
                          devs, (devs,) * (end - start))
            parts.append(Part(sub, tuple(sources), tuple(kept), start))
        return parts

    def chains(self, min_length: int = CHAIN_MIN) -> dict[int, tuple[int, tuple[tuple[int, ...], ...]]]:
        """Runs of at least `min_length` consecutive calls of one function where each call after
        the first reads the one before it, always the same way, besides inputs from outside the
        run, and nothing but the next call reads a call's outputs before the run's last:
        first node -> (end, wiring of the repeated calls), the wiring's (2, j) meaning output j of
        the call before. A fused part runs each as its first call and a loop over the rest, so
        compile time and code size do not grow with the run's length (a 512-call chain: ~5 s to
        compile inlined, ~0.1 s as a loop)."""
        n = len(self.function_ids)
        readers: dict[int, set[int]] = {}  # node -> the nodes reading it (n: the segment returns it)
        for k, ws in enumerate(self.wiring):
            for w in ws:
                if w[0] == 1:
                    readers.setdefault(w[1], set()).add(k)
        for m, _ in self.keep:
            readers.setdefault(m, set()).add(n)

        def relative(j: int) -> tuple[tuple[int, ...], ...]:
            return tuple((2, w[2]) if w[0] == 1 and w[1] == j - 1 else w for w in self.wiring[j])

        out: dict[int, tuple[int, tuple[tuple[int, ...], ...]]] = {}
        start = 0
        while start < n - 1:
            rel = relative(start + 1)
            ok = any(w[0] == 2 for w in rel) and all(w[0] != 1 or w[1] < start for w in rel)
            end = start + 1
            while (ok and end < n and self.function_ids[end] == self.function_ids[start]
                   and relative(end) == rel and readers.get(end - 1) == {end}):
                end += 1
            if end - start >= min_length:
                out[start] = (end, rel)
                start = end
            else:
                start += 1
        return out

    def is_identity(self) -> bool:
        """One node that reads the external inputs in order and returns all its outputs in order:
        the node's executable is the segment (checked against its output count by the caller)."""
        return (len(self.wiring) == 1 and self.wiring[0] == tuple((0, i) for i in range(len(self.wiring[0])))
                and [j for _, j in self.keep] == list(range(len(self.keep))))


@dataclass(frozen=True)
class Part:
    """Consecutive nodes of a segment on the same devices, as a segment of its own (`segment`).

    `sources[i]` is where its external input i comes from in the whole segment: (0, i) = the
    segment's external input i, (1, m, j) = output j of segment node m (an earlier part's).
    `produces` names, as segment-wide (node, output) pairs, what it returns, in order.
    """

    segment: Segment
    sources: tuple[tuple[int, ...], ...]
    produces: tuple[tuple[int, int], ...]
    first: int  # its first node's index in the segment


Runner = Callable[[Sequence[Any]], list[Any]]


def run_parts(segment: Segment, parts: Sequence[Part], runners: Sequence[Runner],
              collective: Sequence[bool], ext: Sequence[Any]) -> list[Any]:
    """Launches the parts in order, each reading the segment's inputs and earlier parts' outputs.

    A part with a collective waits for the earlier parts first: on CPU, a collective computation
    launched while another computation is in flight can deadlock (docs/facts.md, "JAX on CPU")."""
    values: dict[tuple[int, int], Any] = {}
    for part, run, waits in zip(parts, runners, collective, strict=True):
        if waits and values:
            jax.block_until_ready(list(values.values()))
        args = [ext[s[1]] if s[0] == 0 else values[(s[1], s[2])] for s in part.sources]
        values.update(zip(part.produces, run(args), strict=True))
    return [values[k] for k in segment.keep]


def run_unfused(segment: Segment, exes: Sequence[Executable], labels: Sequence[str],
                ext: Sequence[Any]) -> list[Any]:
    """Calls the nodes one by one (each launch asynchronous; one with a collective after the
    earlier ones completed); errors name the failing node."""
    outs: list[list[Any]] = []
    for exe, ws, label in zip(exes, segment.wiring, labels, strict=True):
        args = [ext[w[1]] if w[0] == 0 else outs[w[1]][w[2]] for w in ws]
        if exe.has_collectives and outs:
            jax.block_until_ready(outs)  # an earlier node's failure surfaces as its own
        try:
            outs.append(exe(args))
        except Exception as e:
            raise NodeFailed(f"{label}: {type(e).__name__}: {e}") from e
    return [outs[k][j] for k, j in segment.keep]


class NodeFailed(RuntimeError):
    """A node of an unfused segment failed to launch; the message names it."""


class FusedExecutable(Runnable):
    """Several exported functions called in order inside one jit."""

    def __init__(self, segment: Segment, exes: Sequence[Executable]) -> None:
        self.segment = segment
        self.exes = list(exes)
        n_ext = segment.num_inputs
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
        chains = segment.chains()

        def fused(*ext: Any) -> tuple[Any, ...]:
            outs: list[tuple[Any, ...]] = []
            k = 0
            while k < len(wiring):
                exp = exported[k]
                outs.append(call_exported(exp, [ext[w[1]] if w[0] == 0 else outs[w[1]][w[2]] for w in wiring[k]]))
                if k not in chains:
                    k += 1
                    continue
                end, rel = chains[k]
                fixed = [None if w[0] == 2 else ext[w[1]] if w[0] == 0 else outs[w[1]][w[2]] for w in rel]

                def step(_: Any, prev: tuple[Any, ...], exp: Any = exp, rel: Any = rel, fixed: Any = fixed) -> Any:
                    return call_exported(exp, [prev[w[1]] if w[0] == 2 else x for w, x in zip(rel, fixed, strict=True)])

                last = jax.lax.fori_loop(0, end - k - 1, step, outs[k])
                outs += [()] * (end - k - 2) + [last]  # the calls in between: read by nothing else
                k = end
            return tuple(outs[k][j] for k, j in keep)

        self._jitted = jax.jit(fused, in_shardings=self.in_shardings, out_shardings=self.out_shardings)
        self._init_call_path()

    @property
    def name(self) -> str:
        return f"fused[{len(self.exes)}]"
