"""An array of a multi-host slice as this worker holds it: the parts of the global array that
live on its devices (a jax.Array that is not fully addressable), for fetching.

The client asks every member worker for its parts (`FetchRequest.parts`) and puts the global
array together (pwctl/api/futures.py); replicated shards are sent once. An upload of such a
part (`PutBufferRequest.part_of`: the IFRT proxy's upload of an array sharded over several
members) becomes the same kind of array (`uploaded_part`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas import arrays
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb

from .buffers import BufferStore
from .group import IslandGroup
from .shards import distinct_shards

__all__ = ["GATHER_IDLE_S", "Gathering", "joined_sources", "local_parts", "part_chunks", "part_sources",
           "uploaded_part"]

log = logging.getLogger(__name__)

# A buffer being gathered that got no part for this long fails and its parts go: its members
# send their parts as their shards of one computation are ready, seconds apart at most. A last
# resort: a run the controller drops (its hang timeout, 60 s by default, a lost host, a cancel)
# takes its gathered buffers with it at once (`Gathering.forget`, `unread`).
GATHER_IDLE_S = 120.0
MAX_ABANDONED = 4096  # buffers dropped while gathering, remembered to ignore their late parts


def local_parts(value: Any) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """(start index, data) of each distinct shard on this worker's devices."""
    return [(start, arrays.c_order(np.asarray(shard.data))) for start, shard in distinct_shards(value).items()]


def uploaded_part(flat: np.ndarray, raw_part_of: bytes, group: IslandGroup, local: list[Any]) -> Any:
    """This worker's part of an array sharded over devices of several members of its island
    group, from the bytes of its distinct shards (`flat`, 1-D: worker.proto, `PartOf`): a
    jax.Array of the global shape that is not fully addressable, as a multi-host run leaves its
    outputs (executable.py `_place` reads it in place, or reshards it collectively). ValueError
    saying what does not fit: another group generation (a remap under way), devices that are not
    the group's, a sharding that is not one, bytes that are not its shards' size."""
    import jax
    from jax._src.lib import xla_client as xc

    try:
        part_of = wpb.PartOf.FromString(raw_part_of)
    except Exception:
        raise ValueError("an undecodable part_of") from None
    if not group.active or part_of.group_generation != group.generation or group.announced != group.generation:
        joining = f", joining {group.announced}" if group.announced != group.generation else ""
        raise ValueError(f"a part of an array of island group generation {part_of.group_generation}, but this "
                         f"worker is in generation {group.generation}{joining} (the slice was re-placed: upload it "
                         f"again)")
    shape = tuple(int(d) for d in part_of.global_shape)
    if any(d < 0 for d in shape) or not part_of.op_sharding or not part_of.devices:
        raise ValueError(f"a part of a {list(shape)} array without a sharding or devices")
    try:
        devices = tuple(group.device(group.local_device_number(n), local) for n in part_of.devices)
    except (IndexError, ValueError):
        raise ValueError(f"devices {list(part_of.devices)} are not all devices of island group generation "
                         f"{group.generation}") from None
    if len(set(devices)) != len(devices):
        raise ValueError(f"a sharding over devices {list(part_of.devices)}, some twice")
    try:
        op = xc.OpSharding()
        op.ParseFromString(part_of.op_sharding)
        sharding = _named(devices, xc.HloSharding.from_proto(op), len(shape))
        index_map = sharding.devices_indices_map(shape)
    except Exception as e:
        raise ValueError(f"a sharding of a {list(shape)} array over {len(devices)} devices that is not "
                         f"one: {e}") from None
    index_of = {d: tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index_map[d], shape,
                                                                                      strict=True))
                for d in devices if d.process_index == group.process_id}
    distinct = list(dict.fromkeys(index_of.values()))  # in the order of their first device
    sizes = [math.prod(b - a for a, b in index) for index in distinct]
    if sum(sizes) != flat.size:
        raise ValueError(f"{flat.size} elements for the shards on this worker's devices of a {list(shape)} array "
                         f"({sum(sizes)} elements)")
    shards, at = {}, 0
    for index, size in zip(distinct, sizes, strict=True):
        shards[index] = flat[at:at + size].reshape(tuple(b - a for a, b in index))
        at += size
    arrays = [jax.device_put(shards[index], d) for d, index in index_of.items()]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def part_sources(raw_part_of: bytes) -> list[int]:
    """The buffers an uploaded part is made of (`PartOf.sources`; none: the message's bytes)."""
    try:
        return list(wpb.PartOf.FromString(raw_part_of).sources)
    except Exception:
        raise ValueError("an undecodable part_of") from None


def joined_sources(values: list[Any], dtype: np.dtype) -> np.ndarray:
    """The sources of an uploaded part (`part_sources`: arrays this worker holds) one after
    another, as the 1-D bytes `uploaded_part` reads; ValueError for one of another dtype."""
    arrays = [np.asarray(v) for v in values]
    for a in arrays:
        if a.dtype != dtype:
            raise ValueError(f"a source of dtype {a.dtype} for a part of dtype {dtype}")
    return np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.empty(0, dtype)


def _named(devices: tuple[Any, ...], hlo: Any, ndim: int) -> Any:
    """The NamedSharding that is the HLO sharding `hlo` over `devices` (tile assignment ids are
    positions in `devices`): a mesh of the tile assignment's shape, one axis per tiled dimension
    (the last one replicated where it says so). A NamedSharding, not a GSPMDSharding: JAX
    reshards an array that is not fully addressable from a NamedSharding only."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if hlo.is_replicated():
        return NamedSharding(Mesh(np.array(devices, dtype=object), ("_pw_r",)), PartitionSpec())
    dims = list(hlo.tile_assignment_dimensions())
    tiled = len(dims) - (1 if hlo.replicate_on_last_tile_dim() else 0)
    if not hlo.is_tiled() or hlo.subgroup_types() or tiled != ndim:
        raise ValueError(f"an HLO sharding {hlo} that is not a tiling of a {ndim}-d array")
    ids = list(hlo.tile_assignment_devices())
    if sorted(ids) != list(range(len(devices))):
        raise ValueError(f"an HLO sharding {hlo} over {len(devices)} devices")
    names = [f"_pw_t{i}" for i in range(len(dims))]
    mesh = Mesh(np.array([devices[i] for i in ids], dtype=object).reshape(dims), tuple(names))
    return NamedSharding(mesh, PartitionSpec(*(names[i] if dims[i] > 1 else None for i in range(ndim))))


def part_chunks(parts: list[tuple[tuple[int, ...], np.ndarray]], global_shape: tuple[int, ...],
                chunk: int) -> Iterator[wpb.FetchChunk]:
    """The FetchChunks of a parts reply (worker.proto, FetchChunk): `last` on the final one."""
    for k, (start, data) in enumerate(parts):
        raw = arrays.byte_view(data)
        n = max(1, -(-len(raw) // chunk))
        for i in range(n):
            piece = pb.ArrayProto(data=bytes(raw[i * chunk:(i + 1) * chunk]))
            c = wpb.FetchChunk(array=piece, part=k, last=k == len(parts) - 1 and i == n - 1)
            if i == 0:  # (the chunk holds a copy of `piece`)
                c.array.dtype, c.array.shape[:] = arrays.dtype_name(data.dtype), list(data.shape)
                c.part_start[:] = list(start)
                c.global_shape[:] = list(global_shape)
            yield c


@dataclass(slots=True)
class _Open:
    """A buffer being gathered: the array so far, the starts of the parts in it, the elements
    they cover, and when the last part came (time.monotonic)."""

    whole: np.ndarray
    seen: set[tuple[int, ...]] = field(default_factory=set)
    covered: int = 0
    last: float = 0.0


class Gathering:
    """Parts of multi-host slices' arrays arriving from their members (one Transfer stream each),
    by buffer id, until they cover the array. Identical parts (replicated shards, sent by every
    member that holds them) count once.

    An entry is made by the first part of a buffer and ends when its parts cover the array (the
    caller stores it). One that cannot end that way goes, with its memory:
    - at once when the controller drops the run that reads it here (`forget`: Drop.gathered_ids),
      whether or not its reader came (sequential dispatch sends a reader once its inputs' nodes
      finished: it may never come);
    - at once when the buffer fails (`drop`: a member's failure notice, a part that does not fit;
      the store's `on_failed`: a run dropped because a member's host was lost fails the inputs of
      its tasks here, a reader that failed);
    - at once when every reader enqueued here ended before it was whole and nothing else holds
      it (`unread`, the store's `on_unread`): a reader that arrives after its run was dropped
      fails on arrival, and the worker cannot tell whose input the parts are before it arrives
      (parts name no run). The buffer fails then, so its store entry goes too; a first part
      that comes after that is refused the same way;
    - at the next `sweep` when the buffer settled otherwise or the client released it;
    - at the next `sweep` after `idle_s` without a part: the buffer fails then, naming what is
      missing (a member gone without anyone dropping the run, a member that sent only some parts).
    Parts that come for a buffer dropped so are ignored (the last MAX_ABANDONED are remembered),
    so a late member does not start an entry nobody will finish."""

    def __init__(self, store: BufferStore | None = None, idle_s: float = GATHER_IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._open: dict[int, _Open] = {}
        self._abandoned: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()
        self._store = store
        self.idle_s = idle_s
        self._clock = clock
        if store is not None:
            store.on_failed = self.drop
            store.on_unread = self.unread

    def add(self, buffer_id: int, global_shape: tuple[int, ...], start: tuple[int, ...],
            part: np.ndarray) -> np.ndarray | None:
        """Adds one part; the whole array once its parts cover it, else None (also for a part of
        a buffer dropped already). Raises ValueError for a part that does not fit the array."""
        if len(start) != len(global_shape) or part.ndim != len(global_shape) or any(
                b < 0 or b + n > g for b, n, g in zip(start, part.shape, global_shape, strict=True)):
            raise ValueError(f"a part {list(part.shape)} at {list(start)} does not fit {list(global_shape)}")
        with self._lock:
            entry = self._open.get(buffer_id)
            if entry is None:
                if buffer_id in self._abandoned or (
                        self._store is not None and self._store.gathering_over(buffer_id)):
                    return None
                unread = self._store is not None and self._store.unread(buffer_id)
                if not unread:
                    entry = self._open[buffer_id] = _Open(np.empty(global_shape, part.dtype))
                else:
                    self._dropped(buffer_id)
            if entry is not None:
                return self._added(buffer_id, entry, global_shape, start, part)
        self._fail_unread(buffer_id)  # nobody here reads it any more: no entry, and the buffer goes
        return None

    def _added(self, buffer_id: int, entry: _Open, global_shape: tuple[int, ...], start: tuple[int, ...],
               part: np.ndarray) -> np.ndarray | None:
        """Puts the part into its entry (call with the lock held); the whole array once covered."""
        whole = entry.whole
        if whole.dtype != part.dtype or whole.shape != global_shape:
            raise ValueError(f"parts of buffer {buffer_id} disagree on dtype or shape")
        entry.last = self._clock()
        if start not in entry.seen:
            entry.seen.add(start)
            whole[tuple(slice(b, b + n) for b, n in zip(start, part.shape, strict=True))] = part
            entry.covered += part.size
        if entry.covered < whole.size:
            return None
        del self._open[buffer_id]
        return whole

    def drop(self, buffer_id: int) -> None:
        """Forgets the buffer's parts; later ones for it are ignored."""
        with self._lock:
            self._dropped(buffer_id)

    def forget(self, buffer_ids: list[int], reason: str) -> None:
        """The run these buffers were gathered for was dropped (controller.proto
        Drop.gathered_ids): nothing will read them, so their parts go now, parts still coming
        are ignored, and each buffer fails (a reader of the run enqueued here fails with
        `reason`; one arriving later fails with its run) or, whole already and held for a reader
        that never came, is freed."""
        with self._lock:
            for bid in buffer_ids:
                self._dropped(bid)
        if self._store is not None:
            for bid in buffer_ids:
                self._store.fail(bid, reason)
            self._store.unhold(buffer_ids)

    def unread(self, buffer_id: int) -> None:
        """The readers enqueued here ended before the buffer was whole (the store's `on_unread`):
        its parts go now and the buffer fails, freeing its store entry. Left alone when no part
        of it is here: it may be no gathered array at all (a whole one from a peer still comes,
        and is freed as it is stored); a first part of it that comes later is refused (`add`)."""
        with self._lock:
            if buffer_id not in self._open:
                return
            self._dropped(buffer_id)
        self._fail_unread(buffer_id)

    def _fail_unread(self, buffer_id: int) -> None:
        if self._store is not None:
            self._store.fail(buffer_id, f"gathering buffer {buffer_id:#x}: its readers here ended before "
                                        f"it was whole (their run dropped)")

    def _dropped(self, buffer_id: int) -> _Open | None:
        entry = self._open.pop(buffer_id, None)
        self._abandoned[buffer_id] = None
        self._abandoned.move_to_end(buffer_id)
        if len(self._abandoned) > MAX_ABANDONED:
            self._abandoned.popitem(last=False)
        return entry

    def sweep(self) -> int:
        """Drops the entries that can no longer end well (see the class); how many it dropped."""
        if not self._open:
            return 0
        now = self._clock()
        stale: list[tuple[int, _Open]] = []
        dropped = 0
        with self._lock:
            for bid, entry in list(self._open.items()):
                if self._store is not None and self._store.gathering_over(bid):
                    self._dropped(bid)
                    dropped += 1
                elif now - entry.last > self.idle_s:
                    self._dropped(bid)
                    stale.append((bid, entry))
        for bid, entry in stale:
            error = (f"gathering buffer {bid:#x}: no part of it came for {self.idle_s:g} s, with "
                     f"{entry.covered} of its {entry.whole.size} elements here (a member of its slice "
                     f"lost or sent only some parts)")
            log.warning("%s", error)
            if self._store is not None:
                self._store.fail(bid, error)
        return dropped + len(stale)

    def open_ids(self) -> list[int]:
        """The buffers being gathered (tests, stats)."""
        with self._lock:
            return list(self._open)

    def open_bytes(self) -> int:
        """The memory held by the buffers being gathered."""
        return self.stats()[1]

    def stats(self) -> tuple[int, int]:
        """(buffers being gathered, the bytes they hold), read together (WorkerStats)."""
        with self._lock:
            return len(self._open), sum(e.whole.nbytes for e in self._open.values())
