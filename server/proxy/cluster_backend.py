"""The controller's side of the proxy service: proxy sessions on the cluster's slices.

A proxy session runs on the slice the client named (`PATHWAYS_SLICE`), or on a fresh slice it
owns (`PATHWAYS_DEVICES` devices; default: every free device of the island with the most free
devices), released when the session ends (controller_backend.py opens them). The client sees
the slice's virtual devices 0..n-1 as its devices; the slice maps them onto physical devices as
it does for `pw` clients.

Arrays live in the workers' buffer stores, owned by the session (`client:proxy-<hex>`), so they
go with the session like a `pw` client's; the controller moves their bytes with the workers' own
RPCs (PutBuffers, Fetch, Wait). Where an upload goes is uploading.py's. An upload needs only which
worker holds which device (the slice's holders, server/controller/holders.py), not the island's
group that computations over a slice spanning hosts run in: uploads go on while it forms (at
start, after a remap), and downloads read where the buffer is; compiles and executes wait for
it (`_settled`, at most the controller's --group-wait, 60 s by default), then fail naming why it is not usable.

Compiles and executes go the way a `pw` client's do: each session is a `ClientSession` of the
controller's session manager; a compiled module is a function in a one-node program registered
through the manager (modules.py), and each execute is a run of it through the dispatcher and the
island's gang scheduler, with releases held behind earlier runs by the session's release barrier.
The dispatcher's flush of a session's runs and releases is held while its requests keep coming
(corking.py), so that a pipelined loop's executes reach the worker several to an `Enqueue`, and
the runs it held reach the scheduler together, in one pass.
Runs the controller refuses fail their outputs here (the workers never hear of them: failures.py).

A program over part of the slice's devices, or over them in another order, runs on those
(`ProgramNode.devices`); on a slice spanning hosts, on the workers holding them only (the
dispatcher's `segments.narrowed`): one worker's devices make a plain computation there, whose
outputs are whole on that worker; devices of several an SPMD computation of those members of the
island's group, whose outputs are spread over them (each holds its part). A run reading an output
spread over other devices than its own reads a copy gathered on those devices first (`prepare`).
Where a run's outputs are follows the slice's placement when it runs (placing.py), so a remap
between compile and run is followed; outputs spread over workers under an earlier placement
are refused with an error naming the remap (holdings.py `check_placed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

from .. import wire
from ..controller.client_session import ClientSession, LocalRun
from ..controller.errors import ControllerError
from ..credentials import SESSION_HEADER
from ..resource_manager import ResourceManager
from . import bulk, fetching
from .backend import ArraySpec, BackendError, CompiledInfo, DeviceInfo, SliceInfo
from .compiling import compile_on_worker
from .compose import gather_function
from .corking import FlushCork
from .failures import RunFailures
from .handles import HostData
from .holdings import Holdings
from .host_watch import HostWatch
from .modules import describe
from .placing import compiles_on, runs_on
from .uploading import Uploading
from .workers import WorkerChannels

log = logging.getLogger(__name__)

PLATFORMS = {"cpu": "cpu", "gpu": "cuda"}  # slice device kind -> the PJRT platform name clients see


# the longest a download or a readiness check waits for a computation (a worker whose host is
# lost ends it sooner: host_watch.py)
WAIT_S = 3600.0


class Slices(Protocol):
    """What proxy sessions need of the slice service (server/controller/slices.py)."""

    rm: ResourceManager

    def placement(self, name: str) -> Any: ...

    def current(self, name: str) -> Any: ...

    def holders(self, name: str) -> Any: ...

    async def settled(self, name: str, timeout: float | None = None) -> Any: ...

    def get(self, name: str) -> cpb.Slice: ...

    def create(self, spec: cpb.SliceSpec, dry_run: bool, owner: str) -> cpb.CreateSliceResponse: ...

    def release_owner(self, owner: str) -> None: ...

    async def written(self) -> None: ...


@dataclass(frozen=True)
class Controls:
    """What proxy sessions need of the rest of the controller."""

    release_buffers: Any  # (worker address, buffer ids) -> None: frees them after earlier runs
    release_owner: Any  # owner -> None: frees an owner's buffers on every worker, and its slices
    new_id_prefix: Any  # () -> int: a buffer-id prefix no live client holds
    token: str | None  # the cluster token the workers may require
    sessions: Any = None  # the SessionManager (server/controller/sessions.py): registrations, runs
    tls: Any = None  # the controller's TlsConfig (pwctl/tls.py): workers are reached over TLS; None: plaintext
    bulk_links: bool = True  # bulk bytes on the workers' TCP transfer ports where no TLS (bulk.py); off: gRPC
    transfers: Any = None  # the controller's TransferCounts (transfer_counts.py): the metrics' bulk transfers


def backend_error(e: ControllerError) -> BackendError:
    return BackendError(e.code.name, str(e))


def slice_info(sl: cpb.Slice) -> SliceInfo:
    kinds = {d.kind for d in sl.devices}
    kind = kinds.pop() if len(kinds) == 1 else "cpu"
    platform = PLATFORMS.get(kind, kind)
    devices = tuple(DeviceInfo(id=d.index, kind=kind) for d in sorted(sl.devices, key=lambda d: d.index))
    return SliceInfo(platform_name=platform, platform_version=f"pathways slice {sl.name}", platform_id=0,
                     devices=devices)


class SliceSession(Uploading):
    """One proxy session's slice and buffers; owns the slice when it created it."""

    def __init__(self, slices: Slices, controls: Controls, sl: cpb.Slice, owner: str, owns_slice: bool) -> None:
        self._slices = slices
        self._controls = controls
        self._owner = owner
        self._owns_slice = owns_slice
        self.name = sl.name
        self.slice = slice_info(sl)
        prefix = controls.new_id_prefix()
        self._ids = (prefix << 40 | n for n in itertools.count(1))
        self._client = ClientSession(client_id=owner.removeprefix("client:"), id_prefix=prefix,
                                     name="ifrt-proxy", job_id="", priority=0, weight=1.0, sequential=False)
        self._programs: dict[tuple[str, tuple[int, ...]], CompiledInfo] = {}  # content key -> program
        self._num_outputs: dict[str, int] = {}
        self._devices: dict[str, tuple[int, ...]] = {}  # program -> its virtual devices (empty: all)
        self._out_specs: dict[str, tuple[ArraySpec, ...]] = {}  # program -> its outputs, where known
        self._all = frozenset(range(len(self.slice.devices)))
        self._held = Holdings()  # where each buffer is (holdings.py)
        self._gather_functions: dict[tuple[str, tuple[int, ...], int], tuple[str, bytes]] = {}
        self._failures = RunFailures(self._client.queue)
        self._functions: dict[tuple[str, tuple[int, ...]], str] = {}  # server-made function, devices -> program
        self._watcher = asyncio.get_running_loop().create_task(self._failures.watch())
        # a call to a worker ends once the controller declares its host lost (host_watch.py)
        dispatcher = controls.sessions.dispatcher if controls.sessions is not None else None
        self._watch = HostWatch(dispatcher.host_by_address if dispatcher is not None else None,
                                dispatcher.hosts if dispatcher is not None else None)
        metadata = [("authorization", f"Bearer {controls.token}")] if controls.token else []
        credential = ""
        if controls.sessions is not None:  # the session credential workers check (server/credentials.py)
            credential = controls.sessions.credential(owner, prefix)
            metadata.append((SESSION_HEADER, credential))
        self._metadata = tuple(metadata)
        self._workers = WorkerChannels(controls.tls, credential, controls.token or "", self._metadata,
                                       controls.bulk_links, controls.transfers)
        self._cork = FlushCork(self._flush, asyncio.get_running_loop().call_soon)
        self._submits: list[Any] = []  # the runs held by the cork, for one scheduler pass (`_flush`)
        # a blocking client: it waited on the workers since its last execute, so it will likely
        # wait for the next one too (op-by-op); that run is made prompt (`ready`)
        self._blocking = False
        self._made_by: dict[int, int] = {}  # output of a prompt run -> the run (until freed)

    def _flush(self) -> None:
        """The cork's flush: the runs it held go to the scheduler in one pass, in the order they
        came (as a `pw` client's batch does), then the dispatcher sends what was decided."""
        manager = self._controls.sessions
        if manager is not None:
            submits, self._submits = self._submits, []
            try:
                manager.submit_batch(submits)
            except Exception as e:  # a bug: loud in the log; the held runs fail, so nobody waits on them
                log.exception("proxy: scheduling %d runs of %s failed", len(submits), self._owner)
                for sub in submits:
                    self._client.run_failed(sub.run.run_id, f"scheduling the run failed in the Pathways "
                                            f"controller (a bug): {e}")
                    manager.dispatcher.runs.pop(sub.run.run_id, None)
                    for where, ids in self._client.run_closed(sub.run.run_id):
                        manager.dispatcher.release(where, ids, self._owner)
            manager.dispatcher.flush()

    def _worker(self, address: str) -> tuple[str, wgrpc.WorkerStub]:
        return address, self._workers.stub(address)

    def _holders(self) -> Any:
        """Which worker holds each of the slice's devices now: all an upload needs, known while
        the island's group of a slice spanning hosts forms (server/controller/holders.py)."""
        try:
            return self._slices.holders(self.name)  # kept while nothing moved (slices.py)
        except ControllerError as e:
            raise backend_error(e) from None

    async def _settled(self) -> Any:
        """The slice's placement for a computation, waiting (at most --group-wait) while the
        island's group of a slice spanning hosts forms, as it does after a remap."""
        try:
            return await self._slices.settled(self.name)  # at most the controller's --group-wait
        except ControllerError as e:
            raise backend_error(e) from None

    def _manager(self) -> Any:
        if self._controls.sessions is None:
            raise BackendError("UNIMPLEMENTED", "this controller does not run programs for IFRT proxy clients")
        return self._controls.sessions

    async def compile(self, module: bytes, device_ids: Sequence[int]) -> CompiledInfo:
        key = (hashlib.sha256(module).hexdigest(), tuple(device_ids))
        known = self._programs.get(key)
        if known is not None:
            return known
        slice_ids = [d.id for d in self.slice.devices]
        # a program over part of the slice, or over its devices in another order, runs on those
        # (ProgramNode.devices), a one-device program too; on a slice spanning hosts, on the
        # workers holding them only (one of them: a plain computation there; several: an SPMD
        # computation of those members of the island's group)
        part = tuple(device_ids) if list(device_ids) != slice_ids else ()
        self._manager()
        # parsing the module imports jax the first time (seconds): not on the event loop
        # the workers compile a multi-device program now and say the output shardings XLA chose:
        # a result without a sharding is left to XLA's propagation
        propagate = len(device_ids) > 1
        info = await asyncio.to_thread(describe, module, self.slice.platform_name, "", propagate)
        if info.num_devices != len(device_ids):
            raise BackendError("INVALID_ARGUMENT", f"a module for {info.num_devices} devices compiled for "
                               f"{len(device_ids)}")
        keep = None
        if info.donated:  # the same module without donation, for inputs that other arrays share
            keep = await asyncio.to_thread(describe, module, self.slice.platform_name, ".keep", propagate)
        out_shardings = info.out_shardings
        if propagate:
            out_shardings = await self._compile_on_worker(info.name, info.exported, info.function_id,
                                                          info.donated, part, len(info.outputs))
        await self._settled()  # registering checks the slice's placement (nothing awaited until both are)
        program_id = self.register(info.name, info.exported, info.function_id, len(info.inputs),
                                   len(info.outputs), info.donated, part)
        keep_id = program_id
        if keep is not None:
            keep_id = self.register(keep.name, keep.exported, keep.function_id, len(keep.inputs),
                                    len(keep.outputs), (), part)
        for p in (program_id, keep_id):
            self._out_specs[p] = info.outputs
        compiled = CompiledInfo(program_id=program_id, name=info.name, inputs=info.inputs,
                                outputs=info.outputs, donated=info.donated, in_shardings=info.in_shardings,
                                out_shardings=out_shardings, keep_program_id=keep_id)
        self._programs[key] = compiled
        return compiled

    async def _compile_on_worker(self, name: str, exported: bytes, function_id: str, donated: Sequence[int],
                                 devices: Sequence[int], num_outputs: int) -> tuple[bytes | None, ...]:
        """Compiles a function on the slice's worker for the slice's virtual `devices` (empty:
        all, in order); the compiled output shardings (compiling.py)."""
        host, numbers, generation = compiles_on(await self._settled(), devices)
        address, stub = self._worker(host.address)
        blob = wpb.FunctionBlob(function_id=function_id, exported=exported, name=name, donate=list(donated))
        return await compile_on_worker(stub, self._metadata, address, blob, numbers, num_outputs, generation,
                                       self._watch)

    def _placement(self) -> Any:
        try:
            return self._slices.current(self.name)  # kept while nothing moved (slices.py)
        except ControllerError as e:
            raise backend_error(e) from None

    def register(self, name: str, exported: bytes, function_id: str, n_in: int, n_out: int,
                 donate: Sequence[int], devices: Sequence[int] = ()) -> str:
        """Registers a one-node program running one exported function on the slice (on its
        virtual `devices` in that order; empty: all of them); its id. The caller awaited
        `_settled` (registering a program checks its slice's placement)."""
        manager = self._manager()
        graph = cpb.ProgramGraph(
            name=f"proxy:{name}", num_inputs=n_in,
            nodes=[cpb.ProgramNode(function_id=function_id, slice=self.name, num_outputs=n_out, name=name,
                                   inputs=[cpb.ValueRef(program_input=i) for i in range(n_in)],
                                   devices=list(devices))],
            outputs=[cpb.ValueRef(node_output=cpb.NodeOutput(node=0, output=j)) for j in range(n_out)],
        )
        fn = cpb.FunctionInfo(function_id=function_id, name=name, exported=exported, donate=list(donate))
        reply = manager.register_program(self._client, cpb.RegisterProgram(graph=graph, functions=[fn]))
        if reply.error or not reply.program_id:
            raise BackendError("FAILED_PRECONDITION", f"registering {name}: {reply.error or 'refused'}")
        self._num_outputs[reply.program_id] = n_out
        self._devices[reply.program_id] = tuple(devices)
        return str(reply.program_id)

    def execute(self, program_id: str, inputs: Sequence[int]) -> list[int]:
        manager = self._manager()
        self._failures.drain()
        held = self._held
        homes = [held.address_of(b) for b in inputs]
        placement = self._placement()
        if held.placed_at:
            held.check_placed(inputs, placement.generation, self.name)
        address, on, others = runs_on(placement, self._devices.get(program_id, ()))
        if held.copies or held.others:
            homes = [held.input_home(b, home, (address, *others)) for b, home in zip(inputs, homes, strict=True)]
        self._worker(address)
        outputs = [next(self._ids) for _ in range(self._num_outputs[program_id])]
        run_id = next(self._ids)  # run ids are the cluster's, like buffer ids: unique by the prefix
        self._failures.ran(run_id, outputs)
        run = LocalRun(run_id, program_id, inputs, outputs, homes)
        prompt, self._blocking = self._blocking, False
        if prompt:
            for b in outputs:
                self._made_by[b] = run_id
        # its Submit waits with the cork, which hands it to the scheduler with the others it
        # held (`_flush`), once the session's requests pause (corking.py)
        manager.run(self._client, run, self._submits, prompt=prompt)
        self._cork.decided()
        held.made(outputs, address, others, placement.generation)
        specs = self._out_specs.get(program_id)
        if on is not None and specs is not None:
            over = self._all if len(on) == len(self._all) else frozenset(on)
            for b, spec in zip(outputs, specs, strict=True):
                held.spread[b] = (over, on, spec)
        return outputs

    def spread_over_workers(self, buffer_id: int) -> bool:
        """Whether the run that made this buffer left its parts on several workers (decided by
        the slice's placement when it ran, not when its program was compiled: a remap in between
        changes it); downloads then read a gathered copy (downloads.py)."""
        return buffer_id in self._held.others

    async def prepare(self, program_id: str, inputs: Sequence[int]) -> tuple[list[int], list[int]]:
        """The buffers a run of `program_id` reads instead of `inputs`, and those of them it made
        (the caller frees them once the run is submitted): an input whose parts are spread over
        other devices of the slice than the program's (a result of an SPMD computation over
        several workers) is read through a copy gathered on its own devices, replicated there,
        which every worker that reads it holds (or is sent) whole. Waits while the island's
        group forms (`_settled`): `execute`, which the caller calls next, needs it formed."""
        await self._settled()
        if not self._held.spread:
            return list(inputs), []
        devices = self._devices.get(program_id, ())
        mine = frozenset(devices) if devices else self._all
        ids, made = list(inputs), []
        for k, b in enumerate(inputs):
            spread = self._held.spread.get(b)
            if spread is not None and spread[0] != mine:
                ids[k] = await self.gather(b)
                made.append(ids[k])
        return ids, made

    async def gather(self, buffer_id: int, dtype: str = "", shape: tuple[int, ...] = ()) -> int:
        """A replicated copy of a result spread over workers (on the devices it is spread over,
        each of whose workers then holds it whole); the caller frees it. `dtype` and `shape`
        for a buffer whose spread is not known here (then over all the slice's devices)."""
        _, on, spec = self._held.spread.get(buffer_id, (self._all, (), ArraySpec(dtype, shape)))
        devices = on if on else tuple(range(len(self.slice.devices)))
        key = (spec.dtype, spec.shape, len(devices))
        made = self._gather_functions.get(key)
        if made is None:
            made = self._gather_functions[key] = await asyncio.to_thread(
                gather_function, spec.dtype, spec.shape, len(devices), self.slice.platform_name)
        whole = devices == tuple(range(len(self.slice.devices)))
        (copy,) = await self.run_function("proxy_gather", made[1], 1, [buffer_id], () if whole else devices, [spec])
        return copy

    async def run_function(self, name: str, exported: bytes, num_outputs: int, inputs: Sequence[int],
                           devices: Sequence[int] = (), outputs: Sequence[ArraySpec] = ()) -> list[int]:
        """Runs a server-made function on the slice's virtual `devices` (empty: all of them);
        `outputs`: its results' specs, for reading them on other devices later (`prepare`)."""
        function_id = hashlib.sha256(exported).hexdigest()
        program_id = self._functions.get((function_id, tuple(devices)))
        if program_id is None:
            await self._settled()
            program_id = self.register(name, exported, function_id, len(inputs), num_outputs, (), devices)
            self._functions[(function_id, tuple(devices))] = program_id
        if outputs:
            self._out_specs[program_id] = tuple(outputs)
        ids, made = await self.prepare(program_id, inputs)
        try:
            return self.execute(program_id, ids)
        finally:
            if made:
                self.free(made)

    def _address_of(self, buffer_id: int) -> str:
        return self._held.address_of(buffer_id)

    async def get(self, buffer_id: int) -> HostData:
        """A buffer's bytes (C order), whole: a download under downloads.STREAM_MIN_BYTES, read as
        its worker's `FetchData` messages (`lookup_messages`; on a bulk connection, where a small
        answer is read on the event loop, bulk.py), not counted among the bulk transfers. The
        fetch waits for the buffer; its run's failure ends it with that run's error, by cancelling
        the caller's task (`RunFailures.unless_failed_here`): a fetch's own (downloads.py), never
        the session's reader."""
        self._failures.check(buffer_id)
        self._address_of(buffer_id)
        self._cork.waiting()  # the run making it is on its way to the worker

        async def fetch() -> HostData:
            async with contextlib.aclosing(self.lookup_messages(buffer_id, counted=False)) as messages:
                return HostData([wire.data_field(message) async for message in messages])

        return await self._failures.unless_failed_here([buffer_id], fetch())

    def lookup_messages(self, buffer_id: int, offset: int = 0, length: int = 0,
                        counted: bool = True) -> AsyncGenerator[bytes, None]:
        """A buffer's bytes (C order; `length` > 0: that many from `offset`) as the worker's
        `FetchData` messages (`data_messages`), read as the consumer asks, which a HostBufferLookup
        sends on unchanged (downloads.py); a failed buffer is FAILED_PRECONDITION. `counted`: a bulk
        transfer (transfer_counts.py)."""
        address = self._address_of(buffer_id)
        request = wpb.FetchRequest(buffer_id=buffer_id, timeout_s=WAIT_S, offset=offset, length=length,
                                   data_messages=True)
        return bulk.data_messages(self._workers.bulk, request, address, self._watch, lambda: fetching.data_messages(
            self._workers.fetch_raw(address), request, self._metadata, address, self._watch),
            self._workers.counts if counted else None)

    async def ready(self, buffer_ids: Sequence[int], blocking: bool = True) -> None:
        """Returns once the buffers are computed (BackendError if one failed). An output of a
        prompt run (`execute`, a client that blocks on its calls) is computed once its run ended
        well: its workers report that at once, and the end is awaited here with no RPC; other
        buffers (uploads, outputs of runs sent while the client was pipelining, whose reports
        the workers may hold while busy: server/worker/reporting.py) are waited for on their
        workers (`Wait`). `blocking`: the client waits for this (not a status future of an
        execute): its next run is made prompt."""
        self._cork.waiting()  # what it waits for is on its way to the workers
        self._blocking = self._blocking or blocking
        by_worker: dict[str, list[int]] = {}
        made_by = self._made_by
        for b in buffer_ids:
            self._failures.check(b)
            run_id = made_by.get(b)
            if run_id is not None:
                over = self._client.when_over(run_id)
                if over is not None:
                    await asyncio.shield(over)  # shared by its waiters: a cancelled check must not cancel it
                    self._failures.check(b)
                continue
            by_worker.setdefault(self._address_of(b), []).append(b)
        for address, ids in by_worker.items():
            _, stub = self._worker(address)

            async def wait(stub: wgrpc.WorkerStub = stub, ids: list[int] = ids, address: str = address) -> Any:
                try:
                    call = stub.Wait(wpb.WaitRequest(buffer_ids=ids, timeout_s=WAIT_S), metadata=self._metadata)
                    return await self._watch.unless_lost(address, call, "waiting on")
                except grpc.RpcError as e:
                    raise BackendError("UNAVAILABLE", f"waiting on worker {address} failed: {e.details()}") from None

            reply = await self._failures.unless_failed(ids, wait())
            if reply.error:
                raise BackendError("FAILED_PRECONDITION", reply.error)
            if not reply.ready:
                raise BackendError("DEADLINE_EXCEEDED", f"buffers not ready after {WAIT_S:g} s")

    def free(self, buffer_ids: Sequence[int]) -> None:
        made_by = self._made_by
        for b in buffer_ids:
            made_by.pop(b, None)
        self._failures.forget(buffer_ids)
        by_worker = self._held.forget(buffer_ids)
        manager = self._controls.sessions
        for address, ids in by_worker.items():
            if manager is None:
                self._controls.release_buffers(address, ids)
            else:  # behind the session's earlier runs, which may read them (client_session.py)
                manager.release(self._client, address, ids)
        if by_worker and manager is not None:
            self._cork.decided(run=False)

    async def close(self) -> None:
        self._cork.flush()
        self._watcher.cancel()
        await self._workers.close()
        self._held.clear()
        if self._controls.sessions is not None:
            self._controls.sessions.dispatcher.client_gone(self._client.client_id)
        try:
            self._controls.release_owner(self._owner)  # its buffers everywhere, and a slice it made
            if self._owns_slice:
                await self._slices.written()
        except ControllerError as e:
            raise backend_error(e) from None
        log.info("proxy: session of %s on slice %s closed", self._owner, self.name)
