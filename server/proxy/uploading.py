"""A proxy session's uploads: host bytes stored in the workers' buffer stores of its slice
(cluster_backend.py's `SliceSession` holds these as a mixin).

An upload goes to the worker holding its devices; a replicated one over devices of several
workers as a copy to each of them (`put`); a sharded one over devices of several members of the
island's group in parts, each member receiving and holding only its own devices' shards, as a
run over those devices leaves its results (`put_spread`; from shards staged on the first
worker, `put_spread_staged`); any other (or that one while the group forms) to the slice's
first worker, from which the runs reading it elsewhere have it sent. A staged upload (a host
buffer of 4 MiB or more, streamed on to the slice's first worker before the client says which
devices it is for: staging.py) then moves, worker to worker, to where `put` would have stored
it (`settle_staged`: the dispatcher's `move`, worker.proto `BufferSend` and `BufferKeep`); one
sharded over several workers stays there whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from schemas.arrays import byte_view, resolve_dtype
from schemas.pathways.v1 import worker_pb2 as wpb

from .. import wire
from ..controller.errors import ControllerError
from . import bulk
from .backend import ArraySpec, BackendError
from .bulk_staging import BulkStaging
from .corking import FlushCork
from .handles import HostData, Staged
from .holdings import Holdings
from .host_watch import HostWatch
from .placing import holders_of, spread_members
from .shardings import Index
from .staging import Staging
from .workers import WorkerChannels

# A worker's PutBuffers takes one message per array, and workers accept messages up to 64 MiB
# (server/worker/transfer.py); this leaves room for the message's other fields.
MAX_UPLOAD_BYTES = (64 << 20) - (64 << 10)
UPLOAD_PIECE_BYTES = 4 << 20  # a larger array goes in pieces of this size (worker/uploads.py)


class Uploading:
    """The upload half of a proxy session (cluster_backend.SliceSession, which sets these)."""

    _ids: Iterator[int]
    _owner: str
    _held: Holdings
    _workers: WorkerChannels
    _watch: HostWatch  # ends a call to a worker once its host is lost (host_watch.py)
    _metadata: tuple[tuple[str, str], ...]
    _controls: Any
    _cork: FlushCork
    _slices: Any
    name: str

    def _holders(self) -> Any:
        raise NotImplementedError

    def _worker(self, address: str) -> Any:
        raise NotImplementedError

    def free(self, buffer_ids: Sequence[int]) -> None:
        raise NotImplementedError

    async def get(self, buffer_id: int) -> HostData:
        raise NotImplementedError

    async def put(self, devices: Sequence[int], dtype: str, shape: tuple[int, ...], data: bytes | HostData,
                  replicated: bool = False) -> int:
        """Stores an array for the slice's virtual `devices` (under the slice's placement now) on
        the worker holding them all where one does; `replicated` (every device holds the whole
        array) on each worker holding some of them, under one id; else on the slice's first
        worker: the runs reading it elsewhere have it sent there."""
        host = data if isinstance(data, HostData) else HostData([data])
        holders = holders_of(self._holders(), devices) if devices else ()
        if len(holders) == 1 or (replicated and holders):
            return (await self._upload([(dtype, shape, host)], holders))[0]
        return (await self._upload([(dtype, shape, host)]))[0]

    async def put_spread(self, devices: Sequence[int], op_sharding: bytes, domains: Sequence[Index], dtype: str,
                         shape: tuple[int, ...], data: bytes | HostData) -> int | None:
        """Stores an array sharded over the slice's virtual `devices` (its sharding's, in order:
        `op_sharding`, a serialized xla.OpSharding over them; `domains`, each device's shard) in
        parts where they are on several members of the island's group: each member gets the
        bytes of the distinct shards on its devices only, and holds its part of the global array
        under the buffer's id (worker.proto `PartOf`), as a run over those devices leaves its
        outputs (holdings.py `others`, `spread`). None (nothing stored) where the devices are on
        one worker, or while the island's group forms (its parts need the group's devices): uploads
        do not wait for it, and `put` stores such an array whole."""
        found = self._spread_over(devices)
        if found is None:
            return None
        placement, members = found
        gang = placement.gang
        part_of = wpb.PartOf(global_shape=list(shape), op_sharding=op_sharding,
                             devices=[gang.devices[v] for v in devices],
                             group_generation=gang.generation).SerializeToString()
        raw = data.tobytes() if isinstance(data, HostData) else data
        value = np.frombuffer(raw, resolve_dtype(dtype)).reshape(shape)
        buffer_id = next(self._ids)
        uploads = []
        for address, positions in members:
            mine = dict.fromkeys(tuple((s.start, s.stop) for s in domains[k]) for k in positions)
            shards = [value[tuple(slice(a, b) for a, b in dom)] for dom in mine]
            host = HostData([byte_view(s) for s in shards if s.size])
            count = sum(s.size for s in shards)
            uploads.append(self._upload_to(address, [buffer_id], [(dtype, (count,), host)], part_of))
        done = await asyncio.gather(*uploads, return_exceptions=True)
        addresses = [a for a, _ in members]
        self._held.made([buffer_id], addresses[0], tuple(addresses[1:]), placement.generation)
        failed = [d for d in done if isinstance(d, BaseException)]
        if failed:  # the parts stored go, and so does a part a worker refused (held failed for readers)
            self.free([buffer_id])
            raise failed[0]
        self._held.spread[buffer_id] = (frozenset(devices), tuple(devices), ArraySpec(dtype, shape))
        return buffer_id

    async def put_spread_staged(self, devices: Sequence[int], op_sharding: bytes, domains: Sequence[Index],
                                dtype: str, shape: tuple[int, ...],
                                shards: Sequence[tuple[Sequence[int], Staged, tuple[int, ...]]]) -> int | None:
        """`put_spread` for an array whose shards' host buffers were all staged (`shards`: each
        one's shard indices, staging and shape), without reading them back here: each staging
        becomes a buffer where it was staged, those another member needs move there worker to
        worker (the dispatcher's `move`), and each member makes its part of the ones on its
        devices (`PartOf.sources`); then they go. None (nothing done) where `put_spread` stores
        nothing."""
        manager = self._controls.sessions
        found = self._spread_over(devices) if manager is not None else None
        if found is None:
            return None
        placement, members = found
        gang = placement.gang
        made: list[int] = []
        try:
            of: dict[tuple[tuple[int, int], ...], int] = {}  # a shard's domain -> the buffer holding it
            for indices, staged, hb_shape in shards:
                made.append(await staged.finish(dtype, hb_shape))
                for i in indices:
                    of.setdefault(tuple((s.start, s.stop) for s in domains[i]), made[-1])
            plan = [(address, [of[d] for d in dict.fromkeys(tuple((s.start, s.stop) for s in domains[k])
                                                           for k in positions)]) for address, positions in members]
            wanted: dict[int, list[str]] = {}
            for address, ids in plan:
                for b in ids:
                    wanted.setdefault(b, []).append(address)
            for b, targets in wanted.items():
                home = self._held.address_of(b)
                others = [a for a in targets if a != home]
                if others:
                    keep = home in targets
                    if not manager.dispatcher.move(b, self._owner, home, others, keep_source=keep):
                        gone = [a for a in (home, *others) if manager.dispatcher.host_by_address(a) is None]
                        raise BackendError("UNAVAILABLE", f"moving a shard of this array between the slice's "
                                           f"workers failed: the worker at {', '.join(gone) or home} is no longer "
                                           "registered (its host was lost or is reconnecting); the slice is "
                                           "remapped or degraded: see `pwctl slice list`")
                    self._held.stored([b], [home, *others] if keep else others)
            self._cork.decided(run=False)
            self._cork.waiting()  # the moves go now: the members wait for them
            buffer_id = next(self._ids)
            numbers = [gang.devices[v] for v in devices]
            done = await asyncio.gather(*(self._upload_to(
                address, [buffer_id], [(dtype, (0,), HostData([]))], wpb.PartOf(
                    global_shape=list(shape), op_sharding=op_sharding, devices=numbers,
                    group_generation=gang.generation, sources=ids).SerializeToString()) for address, ids in plan),
                return_exceptions=True)
            addresses = [a for a, _ in plan]
            self._held.made([buffer_id], addresses[0], tuple(addresses[1:]), placement.generation)
            failed = [d for d in done if isinstance(d, BaseException)]
            if failed:
                self.free([buffer_id])
                raise failed[0]
            self._held.spread[buffer_id] = (frozenset(devices), tuple(devices), ArraySpec(dtype, shape))
            return buffer_id
        finally:
            if made:  # the shards' buffers go once the parts are made of them (or not)
                self.free(made)

    def _spread_over(self, devices: Sequence[int]) -> tuple[Any, list[tuple[str, list[int]]]] | None:
        """The slice's placement now and the members of the island's group holding `devices`
        (each with the positions of its devices among them) where they are on several members
        and the group formed; else None: such an upload is stored whole (`put`)."""
        if len(holders_of(self._holders(), devices)) < 2:
            return None
        try:
            placement = self._slices.current(self.name)  # the group formed: its generation now
        except ControllerError:
            return None
        members = spread_members(placement, devices)
        return None if members is None else (placement, members)

    async def _upload(self, arrays: Sequence[tuple[str, tuple[int, ...], HostData]],
                      addresses: Sequence[str] = ()) -> list[int]:
        """Uploads `arrays` to each of `addresses` (none: the slice's first worker), under the
        same ids; an array on several workers is a copy on each (holdings.py `copies`)."""
        addresses = list(addresses) or [self._holders().first.address]
        ids = [next(self._ids) for _ in arrays]
        done = await asyncio.gather(*(self._upload_to(a, ids, arrays) for a in addresses), return_exceptions=True)
        stored = [a for a, d in zip(addresses, done, strict=True) if not isinstance(d, BaseException)]
        failed = [d for d in done if isinstance(d, BaseException)]
        if failed:
            if stored:  # the copies that were made go
                self._held.stored(ids, stored)
                self.free(ids)
            raise failed[0]
        self._held.stored(ids, stored)
        return ids

    async def _upload_to(self, address: str, ids: Sequence[int],
                         arrays: Sequence[tuple[str, tuple[int, ...], HostData]], part_of: bytes = b"") -> None:
        """Uploads `arrays` to worker `address` under `ids`; `part_of`: each is a part of a
        global array (`put_spread`)."""
        self._worker(address)
        links, counts = self._workers.bulk, self._workers.counts
        nbytes = sum(len(d) for _, _, d in arrays)
        if links is not None and all(len(d) for _, _, d in arrays) and (
                nbytes >= bulk.BULK_MIN_BYTES or all(len(d) <= bulk.SMALL_PUT_BYTES for _, _, d in arrays)):
            link = await links.take(address, self._watch, "uploading to")
            if link is not None:  # on the worker's transfer port (bulk.py); else by gRPC
                if counts is not None and nbytes >= bulk.BULK_MIN_BYTES:
                    counts.started("upload", "tcp", nbytes)
                await bulk.put_arrays(links, link, address, self._watch, self._owner, ids, arrays, part_of)
                return
        if counts is not None and nbytes >= bulk.BULK_MIN_BYTES:
            counts.started("upload", "grpc", nbytes)

        def requests() -> Any:
            for buffer_id, (dtype, shape, data) in zip(ids, arrays, strict=True):
                if len(data) <= MAX_UPLOAD_BYTES:  # serialized from the parts (wire.py): one copy
                    yield wire.put_buffer_request(buffer_id, self._owner, dtype, shape, data.parts,
                                                  part_of=part_of)
                else:  # over one worker message: in pieces, which the worker copies into one array
                    for start in range(0, len(data), UPLOAD_PIECE_BYTES):
                        piece = data.slice(start, start + UPLOAD_PIECE_BYTES)
                        yield wire.put_buffer_request(buffer_id, self._owner, dtype if start == 0 else "",
                                                      shape if start == 0 else (), piece.parts, start, len(data),
                                                      part_of if start == 0 else b"")

        try:
            await self._watch.unless_lost(address, self._workers.put_raw(address)(requests(), metadata=self._metadata),
                                          "uploading to")
        except grpc.RpcError as e:
            raise BackendError("UNAVAILABLE", f"uploading to worker {address} failed: {e.details()}") from None

    def stage(self, nbytes: int) -> Staging:
        """A staged upload of `nbytes` host bytes to the slice's first worker (staging.py); once
        its devices are known it moves where they are (`settle_staged`). Where the slice cannot
        take it now (degraded, its first worker's host lost) the array made of it fails with why
        (`Staging.failed`: the client's HostBufferStore must not, see `Staging.write`)."""
        try:
            address = self._holders().first.address
        except BackendError as e:
            return Staging.failed(self, e, nbytes)
        buffer_id = next(self._ids)

        def by_grpc() -> Staging:
            if self._workers.counts is not None and nbytes >= bulk.BULK_MIN_BYTES:
                self._workers.counts.started("upload", "grpc", nbytes)
            try:
                call = self._workers.put_raw(address)(metadata=self._metadata)
                guard = self._watch.guard(address, call, "uploading to")  # for the staging's whole life
            except BackendError as e:
                return Staging.failed(self, e, nbytes)
            return Staging(self, call, address, buffer_id, self._owner, nbytes, guard)

        links = self._workers.bulk
        if links is None:
            return by_grpc()
        # on the worker's transfer port where the session has a connection to it (bulk_staging.py)
        return BulkStaging(self, links, self._watch, address, buffer_id, self._owner, nbytes, by_grpc,
                           self._workers.counts)

    def settle_staged(self, buffer_id: int, devices: Sequence[int], replicated: bool) -> None:
        """A staged upload, stored on the slice's first worker before the client said which
        devices it is for, goes where `put` would have stored it: to the worker holding all of
        `devices`, or, `replicated`, a copy to each worker holding some of them, worker to
        worker (the dispatcher's `move`: nothing comes back here). Else it stays."""
        manager = self._controls.sessions
        home = self._held.home.get(buffer_id)
        if manager is None or home is None or not devices:
            return
        try:
            holders = holders_of(self._holders(), devices)
        except BackendError:  # the slice is degraded: its next use says so
            return
        if not holders or (len(holders) > 1 and not replicated) or holders == (home,):
            return
        targets = [a for a in holders if a != home]
        if not manager.dispatcher.move(buffer_id, self._owner, home, targets, keep_source=home in holders):
            return
        self._held.stored([buffer_id], holders)
        self._cork.decided(run=False)  # sent with the session's next flush

    def adopt(self, buffer_id: int, address: str) -> None:
        """Records a buffer a staged upload stored on worker `address`."""
        self._held.stored([buffer_id], [address])
