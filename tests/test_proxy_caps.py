"""Hostile lists and handles on a real cluster's proxy service (issue 28): every repeated field a
handler iterates is bounded before its entries are looked at (handle lists by
`handles.MAX_HANDLES`, or by the session's handle limit for DestructArray and DeleteArray; device
lists and shard lists by the session's devices or the array's shards; shapes and strides by
`shardings.MAX_RANK`; a remap's intervals by the output array's shards), and answered with one
INVALID_ARGUMENT naming the field and its cap; and a client may not take a handle in the range the
server makes its own in (>= 2**62), which made the server's next handles fail "already in use".
The session stays usable after each refusal. Requests are sent by hand (test_proxy_stream.Raw),
as a hostile client would."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from conftest import LocalCluster
from test_proxy_protocol import P
from test_proxy_stream import Raw, raw_session

from bench.chaos.proxyreqs import fill_compile, fill_make_array
from server.proxy import shardings as sh
from server.proxy.handles import MAX_HANDLES, SERVER_HANDLE_BASE, HandleError, HandleTable
from server.proxy.shardings import MAX_RANK

pytestmark = [pytest.mark.timeout(240), pytest.mark.cluster(islands=1, devices=1)]

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
SESSION_LIMIT = HandleTable().limit
X = struct.pack("<4f", 1, 2, 3, 4)


def status(resp: Any) -> tuple[int, str]:
    return resp.response_metadata.status.code, resp.response_metadata.status.message


async def upload(s: Raw, host: int, array: int) -> None:
    """A float32[4] array [1, 2, 3, 4] under the client's handle `array`."""
    await s.store(host, X)
    resp = await s.ask(lambda r: fill_make_array(r.make_array_from_host_buffer_request, P, host, array, 0))
    assert status(resp) == (0, ""), status(resp)


async def usable(s: Raw, host: int, array: int) -> None:
    """The session still makes an array and reads it back."""
    await upload(s, host, array)
    assert await s.read_back(array, host + 1) == X


def hlo_sharding(r: Any, devices: list[int]) -> None:
    hlo = P.cls("xla.ifrt.HloShardingProto")()
    hlo.devices.device_ids.extend(devices)
    r.serialized_sharding.type_name = sh.HLO
    r.serialized_sharding.data = hlo.SerializeToString()


def compile_options(devices: int) -> bytes:
    """Serialized `xla::ifrt::XlaCompileOptions` whose device assignment names `devices` partitions."""
    options = P.cls("xla.CompileOptionsProto")()
    assignment = options.executable_build_options.device_assignment
    assignment.replica_count = 1
    assignment.computation_count = devices
    for _ in range(devices):
        assignment.computation_devices.add().replica_device_ids.append(0)
    inner = options.SerializeToString()
    return b"\x0a" + _varint(len(inner)) + inner


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def remap_plan(r: Any, array: int, **interval: list[int]) -> None:
    """A RemapArrays of `array` (float32[4] on device 0) into one array like it, with one mapping."""
    r.array_handles.append(array)
    plan = r.plan
    for spec in (plan.input_specs.add(), plan.output_specs.add()):
        spec.dtype.kind = P.cls("xla.ifrt.DTypeProto").Kind.Value("KIND_F32")
        spec.shape.dims.append(4)
        sh.to_proto(sh.Sharding((0,)), spec.sharding, P)
    m = plan.mappings.add()  # shard 0 of input 0 to shard 0 of output 0, unless `interval` says otherwise
    for name, default in {"from_start": [0], "from_end": [1], "from_step": [1],
                          "to_start": [0], "to_end": [1], "to_step": [1]}.items():
        getattr(m, name).extend(interval.get(name, default))


def test_oversized_lists_are_refused_naming_the_field_and_its_cap(cluster: LocalCluster) -> None:
    over = MAX_HANDLES + 1
    many = list(range(1 << 20, (1 << 20) + over))  # handles nobody holds: looked at one by one, each would fail

    def shards_spec(r: Any, hosts: tuple[int, ...] = (900, 901), strides: int = 0) -> None:
        """A spec of a float32[4] array on one device, its shard 0 in each host buffer of `hosts`
        (never stored: they would be waited for), each with `strides` byte strides."""
        spec = r.make_arrays_from_host_buffer_shards_request.specs.add()
        spec.array_spec.dtype.kind = P.cls("xla.ifrt.DTypeProto").Kind.Value("KIND_F32")
        spec.array_spec.shape.dims.append(4)
        sh.to_proto(sh.Sharding((0,)), spec.array_spec.sharding, P)
        for host in hosts:
            spec.addressable_shard_indices.add().indices.append(0)
            b = spec.host_buffers.add(host_buffer_handle=host)
            b.dtype.kind = spec.array_spec.dtype.kind
            b.shape.dims.append(4)
            b.byte_strides.strides.extend([4] * strides)

    refused: list[tuple[Callable[[Any], None], str]] = [
        (lambda r: r.loaded_executable_execute_request.args_handles.extend(many),
         f"loaded_executable_execute_request.args_handles: {over} entries, at most {MAX_HANDLES}"),
        (lambda r: r.check_value_ready_request.value_handles.extend(many),
         f"check_value_ready_request.value_handles: {over} entries, at most {MAX_HANDLES}"),
        (lambda r: r.copy_arrays_request.array_handles.extend(many),
         f"copy_arrays_request.array_handles: {over} entries, at most {MAX_HANDLES}"),
        (lambda r: r.copy_arrays_request.device_ids.extend([0] * 5000),
         "copy_arrays_request.device_ids: 5000 entries, at most 1 (the session's devices)"),
        (lambda r: r.remap_arrays_request.array_handles.extend(many),
         f"remap_arrays_request.array_handles: {over} entries, at most {MAX_HANDLES}"),
        (lambda r: [r.remap_arrays_request.plan.output_specs.add() for _ in range(over)],
         f"remap_arrays_request.plan.output_specs: {over} entries, at most {MAX_HANDLES}"),
        (lambda r: [r.remap_arrays_request.plan.mappings.add() for _ in range(over)],
         f"remap_arrays_request.plan.mappings: {over} entries, at most {MAX_HANDLES}"),
        (lambda r: r.assemble_array_from_single_device_arrays_request.single_device_array_handles.extend(many[:5000]),
         "assemble_array_from_single_device_arrays_request.single_device_array_handles: 5000 entries, at most 1 "
         "(the session's devices)"),
        (lambda r: r.disassemble_into_single_device_arrays_request.result_handles.extend(many[:5000]),
         "disassemble_into_single_device_arrays_request.result_handles: 5000 entries, at most 1 (the session's "
         "devices)"),
        (lambda r: [r.make_arrays_from_host_buffer_shards_request.specs.add() for _ in range(over)],
         f"make_arrays_from_host_buffer_shards_request.specs: {over} entries, at most {MAX_HANDLES}"),
        (shards_spec, "make_arrays_from_host_buffer_shards_request.specs.host_buffers: 2 entries, at most 1 (the "
         "array's shards)"),
        (lambda r: shards_spec(r, (900,), 5000), f"byte strides of 5000 dimensions: at most {MAX_RANK}"),
        (lambda r: r.destruct_array_request.array_handle.extend(range(1, SESSION_LIMIT + 2)),
         f"destruct_array_request.array_handle: {SESSION_LIMIT + 1} entries, at most {SESSION_LIMIT} (a session's "
         "handles)"),
        (lambda r: r.delete_array_request.array_handle.extend(range(1, SESSION_LIMIT + 2)),
         f"delete_array_request.array_handle: {SESSION_LIMIT + 1} entries, at most {SESSION_LIMIT} (a session's "
         "handles)"),
        (lambda r: (fill_compile(r.compile_request), setattr(r.compile_request.compile_options, "data",
                                                             compile_options(5000))),
         "compile options' device_assignment.computation_devices: 5000 entries, at most 1 (the session's devices)"),
        (lambda r: (fill_make_array(r.make_array_from_host_buffer_request, P, 902, 903, 0),
                    hlo_sharding(r.make_array_from_host_buffer_request.sharding, [0] * 5000)),
         f"{sh.HLO}.devices.device_ids: 5000 entries, at most 1 (the session's devices)"),
        (lambda r: (fill_make_array(r.make_array_from_host_buffer_request, P, 902, 904, 0),
                    r.make_array_from_host_buffer_request.byte_strides.strides.extend([4] * 5000)),
         f"byte strides of 5000 dimensions: at most {MAX_RANK}"),
    ]

    async def main() -> None:
        async with raw_session(cluster) as s:
            await upload(s, 10, 11)
            for fill, message in refused:
                resp = await asyncio.wait_for(s.ask(fill), 30)
                assert status(resp) == (INVALID, message)
            # a remap's intervals are counted, not made: 2**40 shards into a 1-shard array
            for interval, message in (
                ({"from_end": [1 << 40]}, "remap_arrays_request.plan.mappings: intervals naming more than 1 "
                 "shards (the output array's)"),
                ({"to_start": [0] * 5000, "to_end": [1] * 5000, "to_step": [1] * 5000},
                 "remap_arrays_request.plan.mappings intervals: 5000 entries, at most 1 (the output array's "
                 "shards)"),
                ({"from_end": []}, "a remap mapping with 1 interval starts, 0 ends and 1 steps"),
            ):
                resp = await asyncio.wait_for(s.ask(lambda r, i=interval: remap_plan(r.remap_arrays_request, 11,
                                                                                       **i)), 30)
                assert status(resp) == (INVALID, message)
            # an oversized result list is not marked failed handle by handle: its handles stay unknown
            resp = await s.ask(lambda r: r.remap_arrays_request.result_handles.extend(many))
            assert status(resp) == (INVALID, f"0 outputs, {over} result handles")
            resp = await s.ask(lambda r: r.check_value_ready_request.value_handles.append(many[-1]))
            assert status(resp) == (grpc.StatusCode.NOT_FOUND.value[0], f"unknown handle {many[-1]}")
            # at the caps, each is answered as before; the session goes on
            resp = await s.ask(lambda r: remap_plan(r.remap_arrays_request, 11))
            assert status(resp) == (0, ""), status(resp)
            resp = await s.ask(lambda r: r.destruct_array_request.array_handle.extend([*many[:MAX_HANDLES], 11]))
            assert status(resp) == (0, "")
            await usable(s, 20, 21)

    asyncio.run(main())


def test_a_client_handle_in_the_servers_range_is_refused_and_the_servers_own_still_work(
        cluster: LocalCluster) -> None:
    async def main() -> None:
        async with raw_session(cluster) as s:
            # the session's first server-made handle is SERVER_HANDLE_BASE: a client taking it made
            # the server's own (a DeleteArray's future here) fail "handle ... is already in use"
            await s.store(1, X)
            resp = await s.ask(lambda r: fill_make_array(r.make_array_from_host_buffer_request, P, 1,
                                                         SERVER_HANDLE_BASE, 0))
            message = (f"handle {SERVER_HANDLE_BASE} is in the server's range (2**62 and above): a client picks "
                       "handles below it")
            assert status(resp) == (INVALID, message)
            await upload(s, 2, 5)
            compiled = await s.ask(lambda r: fill_compile(r.compile_request))
            assert status(compiled) == (0, ""), status(compiled)
            exe = compiled.compile_response.loaded_executable_handle

            def execute(result: int) -> Callable[[Any], None]:
                def fill(r: Any) -> None:
                    e = r.loaded_executable_execute_request
                    e.loaded_executable_handle = exe
                    e.args_handles.append(5)
                    e.result_array_handle.append(result)
                return fill

            # an Execute's result handles (the per-call path) alike, however far into the range
            for taken in (SERVER_HANDLE_BASE + 6, (1 << 64) - 1):
                resp = await s.ask(execute(taken))
                assert status(resp) == (INVALID, message.replace(str(SERVER_HANDLE_BASE), str(taken)))
            # the server's own handles, past the one the refused Execute named, all work
            for _ in range(8):
                deleted = await s.ask(lambda r: r.delete_array_request.SetInParent())
                assert status(deleted) == (0, ""), status(deleted)
                future = deleted.delete_array_response.deletion_future_handle
                assert future >= SERVER_HANDLE_BASE
                done = await s.ask(lambda r, f=future: setattr(r.check_future_request, "future_handle", f))
                assert status(done) == (0, ""), status(done)
            resp = await s.ask(execute(6))  # the client's own range: x * 2
            assert status(resp) == (0, ""), status(resp)
            assert await s.read_back(6, 3) == struct.pack("<4f", 2, 4, 6, 8)

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_the_handle_table_takes_no_client_handle_of_the_servers_range_nor_marks_one() -> None:
    """HandleTable alone: `reserve` (a client's handle) refuses the server's range, `reserve_new`
    makes the server's own; a failed op marks a server-range handle only where it reserved it, and
    adds no failed handle past the table's limit."""
    table = HandleTable(limit=4)
    with pytest.raises(HandleError) as e:
        table.reserve(SERVER_HANDLE_BASE)
    assert (e.value.code, str(e.value)) == ("INVALID_ARGUMENT", f"handle {SERVER_HANDLE_BASE} is in the server's "
                                            "range (2**62 and above): a client picks handles below it")
    table.fail([SERVER_HANDLE_BASE, SERVER_HANDLE_BASE + 1], "INVALID_ARGUMENT", "refused")  # not reserved: unmarked
    assert table.peek(SERVER_HANDLE_BASE) is None and table.peek(SERVER_HANDLE_BASE + 1) is None
    made = table.reserve_new()
    assert made == SERVER_HANDLE_BASE  # the server's first handle is still its own
    table.fail([made, 7, 8, 9, 10], "INTERNAL", "the op failed")  # its own reserved one is marked
    with pytest.raises(HandleError) as e:
        table.get(made)
    assert str(e.value) == "the op failed"
    assert len(table) == 4 and table.peek(10) is None  # 7, 8, 9 marked; 10 past the limit
