"""The proxy's executable requests: Compile, LoadedExecutableMetadata/Execute/Destruct.

A Compile registers the client's module with the cluster (backend `compile`, modules.py) and
answers a loaded-executable handle. Each Execute is one run through the scheduler, submitted
without waiting for it: its result handles name the run's output buffers at once, and later
requests that read them wait on the workers (CheckValueReady, CopyToHostBuffer). The first
Execute of an executable comes without result handles; the server picks them and says what the
outputs are (requirement 1 in FACTS); later ones carry the client's own.

Executes are submitted in the order they arrive: one that waits for an argument still being
uploaded holds the later ones, so a run that donates a buffer never overtakes one reading it.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import shardings as sh
from .answers import message_field
from .arrays import ArrayRecord, Buf, drop_buffers, materialize, unref_all, whole
from .backend import ArraySpec, CompiledInfo
from .handles import HandleError, Pending, bounded
from .layouts import DTYPES
from .shardings import Index, Sharding

if TYPE_CHECKING:
    from .service import Session

Message = Any
XLA_PROGRAM = "xla::ifrt::XlaProgram"
KINDS = {name: kind for kind, name in DTYPES.items()}  # numpy dtype name -> DTypeProto kind name


@dataclass(eq=False)
class LoadedExecutable:
    compiled: CompiledInfo
    device_ids: tuple[int, ...]
    submitted: asyncio.Lock  # the session's: executes go to the scheduler in arrival order
    # what every Execute of it answers alike, made at its first (`outputs`): the same for every
    # call, since the executable's outputs and devices never change
    _outputs: list[tuple[Sharding, list[Index], bytes]] | None = field(default=None, repr=False)

    def in_sharding(self, i: int) -> Sharding:
        if len(self.device_ids) == 1:
            return Sharding(self.device_ids)
        return Sharding(self.device_ids, self.compiled.in_shardings[i])

    def out_sharding(self, j: int) -> Sharding:
        if len(self.device_ids) == 1:
            return Sharding(self.device_ids)
        return Sharding(self.device_ids, self.compiled.out_shardings[j])

    def outputs(self, proto: Any) -> list[tuple[Sharding, list[Index], bytes]]:
        """Each output's sharding, its shards' domains, and its array descriptor in an Execute's
        answer (a serialized `LoadedExecutableExecuteResponse.Output` without its handle)."""
        if self._outputs is None:
            out_cls = proto.cls("xla.ifrt.proxy.LoadedExecutableExecuteResponse.Output")
            made = []
            for j, spec in enumerate(self.compiled.outputs):
                sharding = self.out_sharding(j)
                descriptor = out_cls()
                _output(descriptor, spec, sharding, 0, proto)
                made.append((sharding, sharding.domains(spec.shape), bytes(descriptor.SerializeToString())))
            self._outputs = made
        return self._outputs


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise HandleError("INVALID_ARGUMENT", "undecodable compile options")
        b = data[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not b & 0x80:
            return value, pos


def compile_options(data: bytes, proto: Any) -> Message:
    """The `xla.CompileOptionsProto` inside serialized `xla::ifrt::XlaCompileOptions` (its field
    1; the client's build has no descriptor for the wrapper, only for what it holds)."""
    pos, out = 0, proto.cls("xla.CompileOptionsProto")()
    while pos < len(data):
        tag, pos = _varint(data, pos)
        if tag & 7 == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise HandleError("INVALID_ARGUMENT", "undecodable compile options")
            if tag >> 3 == 1:
                try:
                    out.MergeFromString(data[pos : pos + size])
                except Exception:
                    raise HandleError("INVALID_ARGUMENT", "undecodable compile options") from None
            pos += size
        elif tag & 7 == 0:
            _, pos = _varint(data, pos)
        else:
            raise HandleError("INVALID_ARGUMENT", "undecodable compile options")
    return out


def device_ids(options: Message, most: int) -> tuple[int, ...]:
    """The devices of the compile's device assignment, partition by partition (at most `most`,
    the session's device count)."""
    assignment = options.executable_build_options.device_assignment
    bounded(assignment.computation_devices, "compile options' device_assignment.computation_devices", most,
            " (the session's devices)")
    if assignment.replica_count > 1:
        raise HandleError("UNIMPLEMENTED", f"programs over {assignment.replica_count} replicas (pmap): "
                          "not supported by the Pathways IFRT proxy server yet")
    return tuple(int(c.replica_device_ids[0]) for c in assignment.computation_devices if c.replica_device_ids)


def _done_future(session: Session) -> int:
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    handle = session.handles.new_handle()
    session.handles.put(handle, done)
    return handle


async def compile_program(session: Session, req: Message, resp: Message, proto: Any) -> None:
    r = req.compile_request
    if r.program.type_name != XLA_PROGRAM:
        raise HandleError("UNIMPLEMENTED", f"compiling a {r.program.type_name or '(none)'} program: the Pathways "
                          "IFRT proxy server compiles XLA (StableHLO) programs")
    if r.host_callbacks:
        raise HandleError("UNIMPLEMENTED", "host callbacks (jax.debug.print, pure_callback) cannot run through the "
                          "IFRT proxy")
    known = {d.id for d in session.backend.slice.devices}
    devices = device_ids(compile_options(r.compile_options.data, proto), len(known)) or (
        session.backend.slice.devices[0].id,)
    if not set(devices) <= known:
        raise HandleError("INVALID_ARGUMENT", f"devices {sorted(set(devices) - known)} are not the session's")
    compiled = await session.backend.compile(r.program.data, devices)
    handle = session.handles.new_handle()
    session.handles.put(handle, LoadedExecutable(compiled, devices, session.submitted))
    c = resp.compile_response
    c.loaded_executable_handle = handle
    c.name = compiled.name
    c.num_devices = len(devices)
    c.device_ids.extend(devices)
    c.addressable_device_ids.extend(devices)
    c.fingerprint_value = compiled.program_id.encode()
    c.ready_future_handle = _done_future(session)


def _layout(proto: Any, rank: int) -> Message:
    return proto.cls("xla.LayoutProto")(minor_to_major=list(reversed(range(rank))))


async def metadata(session: Session, req: Message, resp: Message, proto: Any) -> None:
    exe = session.handles.get(req.loaded_executable_metadata_request.loaded_executable_handle, LoadedExecutable)
    m = resp.loaded_executable_metadata_response
    # no shardings on one device (the module has none, and the client then keeps its own)
    if len(exe.device_ids) > 1:
        m.parameter_shardings.shardings.extend(
            sh.op_sharding_proto(exe.in_sharding(i), proto) for i in range(len(exe.compiled.inputs)))
        m.output_shardings.shardings.extend(
            sh.op_sharding_proto(exe.out_sharding(j), proto) for j in range(len(exe.compiled.outputs)))
    m.parameter_layouts_list.layouts.extend(_layout(proto, len(s.shape)) for s in exe.compiled.inputs)
    m.output_layouts_list.layouts.extend(_layout(proto, len(s.shape)) for s in exe.compiled.outputs)
    m.donated_input_indices.donated_input_indices.extend(exe.compiled.donated)


def _output(out: Message, spec: ArraySpec, sharding: Sharding, handle: int, proto: Any) -> None:
    dtype_cls = proto.cls("xla.ifrt.DTypeProto")
    out.dtype.kind = dtype_cls.DESCRIPTOR.fields_by_name["kind"].enum_type.values_by_name[KINDS[spec.dtype]].number
    out.shape.dims.extend(spec.shape)
    sh.to_proto(sharding, out.sharding, proto)
    out.array_handle = handle


class Pins:
    """An execute's references on its arguments' records (`refs`), taken before its first await,
    or, for an argument still being made, the moment it is made: a DestructArray that arrives
    after the execute (the client sends it right away) must not free a buffer the run reads."""

    def __init__(self, session: Session, count: int) -> None:
        self._session = session
        self.records: list[ArrayRecord | None] = [None] * count
        self.waits: list[asyncio.Future[None]] = []
        self._open = True

    def start(self, handles: list[int]) -> None:
        """Pins what exists now; raises for an unknown or failed handle (`release` still undoes)."""
        for i, h in enumerate(handles):
            value = self._session.handles.peek(h)
            if isinstance(value, Pending):
                # runs before the wakeup of a destruct that arrived later (callbacks run in order)
                value.done.add_done_callback(functools.partial(self._made, i, h))
                self.waits.append(value.done)
            else:
                self._take(i, h, strict=True)

    def _made(self, i: int, h: int, _: object) -> None:
        self._take(i, h)

    def _take(self, i: int, h: int, strict: bool = False) -> None:
        if not self._open or self.records[i] is not None:
            return
        rec = self._session.handles.get(h, ArrayRecord) if strict else self._session.handles.peek(h)
        if isinstance(rec, ArrayRecord):
            rec.refs += 1
            self.records[i] = rec

    def take_all(self, handles: list[int]) -> list[ArrayRecord]:
        """Every argument's record, once `waits` are done; raises the error of one that failed."""
        for i, h in enumerate(handles):
            self._take(i, h, strict=True)  # made meanwhile: its callback may not have run yet
        return [r for r in self.records if r is not None]

    def release(self) -> None:
        """Drops the references (after the run was submitted: a release waits for it)."""
        self._open = False
        unref_all(self._session, (rec for rec in self.records if rec is not None))
        self.records = [None] * len(self.records)


async def execute(session: Session, req: Message, resp: Message, proto: Any) -> bytes:
    """Answers the body of its `LoadedExecutableExecuteResponse` (serialized: answers.py)."""
    r = req.loaded_executable_execute_request
    # `device_ids` and `execute_options.non_donatable_input_indices` are never read, so not
    # `bounded`: no work here grows with them, and their decoding (before any handler runs, as
    # every field's) is bounded by the server's gRPC message size; a check would only add to the
    # hottest request
    exe = session.handles.get(r.loaded_executable_handle, LoadedExecutable)
    compiled = exe.compiled
    results = session.handles.reserve_all(r.result_array_handle, len(compiled.outputs))
    if results is None:
        raise HandleError("INVALID_ARGUMENT", f"{compiled.name} has {len(compiled.outputs)} outputs, "
                          f"the request names {len(r.result_array_handle)} result handles")
    handles = list(r.args_handles)
    if len(handles) != len(compiled.inputs):  # before any is looked at
        raise HandleError("INVALID_ARGUMENT", f"{compiled.name} takes {len(compiled.inputs)} arguments, "
                          f"got {len(handles)}")
    pins = Pins(session, len(handles))
    try:
        pins.start(handles)
        async with exe.submitted:
            for w in pins.waits:
                await asyncio.shield(w)
            args = pins.take_all(handles)
            if len(args) != len(compiled.inputs):
                raise HandleError("INVALID_ARGUMENT", f"{compiled.name} takes {len(compiled.inputs)} arguments, "
                                  f"got {len(args)}")
            for i, (a, spec) in enumerate(zip(args, compiled.inputs, strict=True)):
                if (a.dtype, a.shape) != (spec.dtype, spec.shape):
                    raise HandleError("INVALID_ARGUMENT", f"argument {i} of {compiled.name}: a {a.dtype}"
                                      f"{list(a.shape)} array where {spec.dtype}{list(spec.shape)} is expected")
            bufs: list[Buf] = []
            for a in args:  # most are one buffer already: no coroutine made for those
                buf = a.buffer()
                bufs.append(buf if buf is not None else await materialize(session, a))
            program = compiled.program_id
            # a donated buffer that another array (or another argument) still reads is not given up
            if compiled.donated and any(bufs[i].records > 1 or bufs.count(bufs[i]) > 1 for i in compiled.donated):
                program = compiled.keep_program_id or program
            ids, made = await session.backend.prepare(program, [b.id for b in bufs])
            try:
                buffers = session.backend.execute(program, ids)
            finally:
                if made:  # gathered copies it reads: freed behind the run
                    session.backend.free(made)
    except BaseException as e:
        code = getattr(e, "code", None)  # HandleError, BackendError
        code, message = (code, str(e)) if isinstance(code, str) else ("CANCELLED", "execute cancelled")
        session.handles.fail(results, code, message)
        raise
    finally:
        pins.release()
    # whether its outputs are spread over workers: decided per run (by the slice's placement
    # then, which a remap changes)
    spread = len(exe.device_ids) > 1 and bool(buffers) and session.backend.spread_over_workers(buffers[0])
    out_bufs = [Buf(b, spec.dtype, spec.shape, spread=spread) for b, spec in zip(buffers, compiled.outputs,
                                                                                strict=True)]
    outputs = exe.outputs(proto)
    enc = session.encoder
    parts = []
    # requirement 2: without fill_status the client CHECK-fails on a status handle
    if r.execute_options.fill_status:
        parts.append(enc.status_handle(_status_future(session, out_bufs)))
    for h, buf, (sharding, domains, descriptor) in zip(results, out_bufs, outputs, strict=True):
        session.handles.settle(h, whole(buf, sharding, domains))
        parts.append(message_field(enc.outputs_number, descriptor + enc.array_handle(h)))
    return message_field(enc.execute_number, b"".join(parts))


def _status_future(session: Session, bufs: list[Buf]) -> int:
    """A future that completes when the run is over: with its error if it failed. It holds the
    outputs meanwhile, so a client that drops them at once does not make it wait for buffers
    that are gone."""
    for b in bufs:
        b.records += 1

    async def finished() -> None:
        try:
            if bufs:
                # the execute's status, which the client may never ask for: not a blocking client
                await session.backend.ready([b.id for b in bufs], blocking=False)
        finally:
            drop_buffers(session, bufs)

    task = asyncio.ensure_future(finished())
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read by CheckFuture, or dropped
    handle = session.handles.new_handle()
    session.handles.put(handle, task)
    return handle


async def destruct(session: Session, req: Message, resp: Message, proto: Any) -> None:
    session.handles.pop(req.loaded_executable_destruct_request.loaded_executable_handle)
    resp.loaded_executable_destruct_response.SetInParent()


HANDLERS = {
    "compile_request": compile_program,
    "loaded_executable_metadata_request": metadata,
    "loaded_executable_execute_request": execute,
    "loaded_executable_destruct_request": destruct,
}
