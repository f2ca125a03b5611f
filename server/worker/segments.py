"""Registered segments and how each runs: its nodes' executables, fused or one by one.

Who owns which fact about a segment:
- the controller (server/controller/segments.py) owns the cut of a program into segments, their
  wiring, outputs, routes and devices; `SegmentInfo.of` takes them from the wire as given;
- this worker owns how a segment runs (its parts, fused or not, server/worker/fusion.py) and
  whether it communicates: that is read off its compiled executables
  (`Executable.has_collectives`, exact after SPMD partitioning), not the client's guess.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.pathways.v1 import worker_pb2 as wpb

from .executable import Executable, ExecutableCache
from .fusion import FusedExecutable, Runner, Segment, run_parts, run_unfused
from .group import IslandGroup

log = logging.getLogger(__name__)


@dataclass
class SegmentInfo:
    """A registered segment and what the worker derives from it once."""

    definition: wpb.SegmentDef
    structure: Segment
    labels: list[str]
    routes: list[wpb.OutputRoute]
    devices: frozenset[int]
    communicates: bool | None = None  # known once its executables exist
    runner: Runner | None = None
    fused: bool = False  # its runner fuses nodes and its first launch has not succeeded yet
    out_nbytes: list[int] | None = None  # per output, read off its first launch (shapes are static)
    donates: bool = False  # a node of it donates inputs (known once its runner exists)
    stale: str = ""  # why it can no longer run (its island group generation was replaced)

    @classmethod
    def of(cls, d: wpb.SegmentDef, group: IslandGroup | None = None) -> SegmentInfo:
        """From the wire; a group segment's device numbers turned into this worker's numbering
        (server/worker/group.py). Raises ValueError for a segment of another group generation."""
        if d.group_generation:
            if group is None or d.group_generation != group.announced:
                have = group.announced if group is not None else 0
                raise ValueError(f"segment {d.segment_id} is for island group generation {d.group_generation}, "
                                 f"this worker is in generation {have}")
            d = _in_local_numbers(d, group)
        s = Segment.of(d)
        return cls(d, s, [n.label for n in d.nodes], list(d.routes), frozenset(s.devices))

    @property
    def label(self) -> str:
        return self.definition.label

    @property
    def size(self) -> int:
        return len(self.definition.nodes)


def _in_local_numbers(d: wpb.SegmentDef, group: IslandGroup) -> wpb.SegmentDef:
    out = wpb.SegmentDef()
    out.CopyFrom(d)
    out.local_devices[:] = [group.local_device_number(x) for x in d.local_devices]
    for n in out.nodes:
        n.local_devices[:] = [group.local_device_number(x) for x in n.local_devices]
    return out


class Runners:
    """Builds (once per registered segment) how a segment runs on this worker's devices."""

    def __init__(self, devices: Sequence[Any]) -> None:
        self.devices = list(devices)
        self.group = IslandGroup()  # this worker's island group (a single-host island: none)
        self.cache = ExecutableCache()
        self.functions: dict[str, wpb.FunctionBlob] = {}
        # fused executables by structure, while a registered segment still uses them (segments
        # of different programs with one structure share one)
        self._fused: weakref.WeakValueDictionary[Segment, FusedExecutable] = weakref.WeakValueDictionary()
        # PATHWAYS_FUSE=0 runs a segment's nodes one by one (debugging, benchmarks)
        self.fuse = os.environ.get("PATHWAYS_FUSE", "1") != "0"

    def communicates(self, info: SegmentInfo) -> bool:
        """Whether the segment has a collective once compiled (the client's flag is a
        conservative guess made before SPMD partitioning: a data-sharded elementwise pw.jit has
        no collective once compiled). False when it cannot compile: its launch reports why."""
        if info.communicates is None:
            try:
                info.communicates = any(e.has_collectives for e in self.node_executables(info))
            except Exception:
                return False
        return info.communicates

    def runner(self, info: SegmentInfo) -> Runner:
        """How the segment runs: per part (nodes on the same devices), its node's executable, a
        fused executable, or node by node; the parts one after the other."""
        if info.runner is not None:
            return info.runner
        seg = info.structure
        exes = self.node_executables(info)
        parts = seg.parts()
        runners, collective = [], []
        for part in parts:
            nodes = slice(part.first, part.first + len(part.segment.function_ids))
            runner, fused = self._part_runner(part.segment, exes[nodes], info.labels[nodes])
            runners.append(runner)
            collective.append(any(e.has_collectives for e in exes[nodes]))
            info.fused = info.fused or fused
        info.donates = any(e.donate for e in exes)
        if len(parts) == 1:
            info.runner = runners[0]
        else:
            info.runner = functools.partial(run_parts, seg, parts, runners, collective)
        return info.runner

    def rebuild(self, devices: Sequence[Any]) -> None:
        """The backend was replaced (the island's group changed): every compiled program is of the
        old one. Segments build their runners again on first use."""
        self.devices = list(devices)
        self.cache.clear()
        self._fused.clear()

    def unfuse(self, info: SegmentInfo) -> None:
        """Its fused first launch failed: from now on it runs node by node."""
        for part in info.structure.parts():
            self._fused.pop(part.segment, None)
        info.runner = functools.partial(run_unfused, info.structure, self.node_executables(info), info.labels)
        info.fused = False

    def node_executables(self, info: SegmentInfo) -> list[Executable]:
        """Each node's executable on its devices; errors name the node."""
        seg = info.structure
        exes = []
        for fid, devs, label in zip(seg.function_ids, seg.node_devices, info.labels, strict=True):
            blob = self.functions.get(fid)
            if blob is None:
                raise RuntimeError(f"{label}: function {fid[:12]} was never sent to this worker")
            try:
                devices = [self.group.device(i, self.devices) for i in devs]
                exes.append(self.cache.get_or_compile(fid, blob.exported, devices, tuple(blob.donate)))
            except Exception as e:
                raise RuntimeError(f"{label}: cannot compile {blob.name or fid[:12]}: {e}") from e
        return exes

    def _part_runner(self, seg: Segment, exes: list[Executable], labels: list[str]) -> tuple[Runner, bool]:
        """(runner, fused) for nodes on the same devices."""
        if len(exes) == 1 and seg.is_identity() and len(seg.keep) == len(exes[0].out_avals):
            return exes[0], False
        if self.fuse and len(exes) > 1 and not any(e.donate for e in exes):
            fused = self._fused.get(seg)
            if fused is None:
                try:
                    fused = FusedExecutable(seg, exes)
                except Exception as e:
                    log.info("not fusing %s: %s", ", ".join(labels), e)
            if fused is not None:
                self._fused[seg] = fused
                return fused, True
        return functools.partial(run_unfused, seg, exes, labels), False


def switch_group(join: Any, runners: Runners, segments: Iterable[SegmentInfo]) -> str:
    """(launch thread, nothing in flight) Moves the worker into the island group `join` (a
    cpb.JoinGroup); returns "" or why it could not (it is then in no group, its devices its own).
    Every compiled program belonged to the old backend; segments of another generation are stale."""
    group = runners.group
    error = ""
    try:
        devices = group.join(join.generation, join.coordinator, join.process_id, join.num_processes,
                             join.gloo_host, list(join.members), list(join.member_addresses))
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        log.error("joining island group generation %d failed: %s", join.generation, error)
        devices = group.join(0, "", 0, 1, "", [])
    runners.rebuild(devices)
    for info in segments:
        info.runner = None
        generation = info.definition.group_generation
        if generation and generation != group.generation:
            info.stale = f"island group generation {generation} was replaced by {group.generation or 'none'}"
    log.info("island group: generation %d, process %d of %d", group.generation, group.process_id,
             group.num_processes)
    return error
