"""The proxy's bulk-bytes wire format (server/wire.py) against protobuf's own parser and
serializer: what one writes the other reads, and malformed bytes are a WireError, never a crash."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb
from server import wire
from server.proxy import protocol as proto_mod
from server.proxy.handles import HostData

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 1 << 20, (1 << 20) + 5])
def test_data_messages_match_protobuf(size: int) -> None:
    p = proto_mod.protocol()
    data = bytes(i % 251 for i in range(size))
    # what the client sends is read without a copy
    raw = p.GrpcHostBufferStoreRequest(data=data).SerializeToString()
    view = wire.data_field(raw)
    assert isinstance(view, memoryview) and bytes(view) == data
    # what the server sends parses as the client's message
    assert p.GrpcHostBufferLookupResponse.FromString(wire.data_message(memoryview(data))).data == data
    assert wire.data_message(data) == p.GrpcHostBufferLookupResponse(data=data).SerializeToString()


def test_data_field_last_occurrence_wins_and_other_fields_are_refused() -> None:
    p = proto_mod.protocol()
    twice = wire.data_message(b"first") + wire.data_message(b"second")
    assert bytes(wire.data_field(twice)) == p.GrpcHostBufferStoreRequest.FromString(twice).data == b"second"
    assert bytes(wire.data_field(b"")) == b""
    for bad in (b"\x0a\x05abc", b"\x0a", b"\x10\x01", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x07",
                b"\x00\x01"):
        with pytest.raises(wire.WireError):
            wire.data_field(bad)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 1 << 20, (1 << 20) + 5])
def test_a_workers_fetch_data_is_a_lookup_response_on_the_wire(size: int) -> None:
    """FetchRequest.data_messages: the controller forwards the worker's messages to the jaxlib
    client unparsed, so they must be exactly what the client parses, with no unknown fields."""
    p = proto_mod.protocol()
    data = bytes(i % 251 for i in range(size))
    raw = wire.data_message(memoryview(data))
    assert raw == wpb.FetchData(data=data).SerializeToString()
    lookup = p.GrpcHostBufferLookupResponse.FromString(raw)
    assert lookup.data == data and lookup.SerializeToString() == raw  # nothing it does not know
    assert wire.data_length(raw) == size


def test_data_length_reads_one_data_field_and_refuses_anything_else() -> None:
    assert wire.data_length(b"") == 0
    assert wire.data_length(wire.data_message(b"abc")) == 3
    for bad in (wire.data_message(b"a") + wire.data_message(b"b"),  # two fields: not forwarded as one
                b"\x0a\x05abc", b"\x0a", b"\x0a\x01ab", b"\x10\x01",  # short, long, a varint field
                wpb.FetchChunk(error="boom", last=True).SerializeToString(),  # a FetchChunk is not one
                b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"):
        with pytest.raises(wire.WireError):
            wire.data_length(bad)


def test_host_data_joins_only_when_asked() -> None:
    one = b"abc"
    assert HostData([one]).tobytes() is one  # nothing to join
    parts = HostData([b"ab", memoryview(b"xcdx")[1:3], b"", b"e"])
    assert len(parts) == parts.nbytes == 5 and len(parts.parts) == 3
    assert parts.tobytes() == b"abcde"


@pytest.mark.parametrize(("buffer_id", "owner", "dtype", "shape", "size"), [
    (7, "client:proxy-ab", "float32", (2, 3), 24), ((1 << 40) | 5, "client:x", "bfloat16", (300,), 600),
    (0, "", "float32", (), 4), (3, "o", "int8", (0, 5), 0), (9, "o", "uint8", (1 << 20,), 1 << 20)])
def test_put_buffer_requests_match_protobuf(buffer_id: int, owner: str, dtype: str, shape: tuple[int, ...],
                                            size: int) -> None:
    data = bytes(i % 253 for i in range(size))
    parts = HostData([data[:5], memoryview(data)[5:11], data[11:]]).parts
    for offset, total in ((0, 0), (0, 3 * size), (size, 3 * size)):
        raw = wire.put_buffer_request(buffer_id, owner, dtype, shape, parts, offset, total)
        expected = wpb.PutBufferRequest(buffer_id=buffer_id, owner=owner, offset=offset, total_bytes=total,
                                        array=pb.ArrayProto(dtype=dtype, shape=list(shape), data=data))
        assert raw == expected.SerializeToString()
        assert wpb.PutBufferRequest.FromString(raw) == expected
        got = wire.put_buffer(raw)
        assert (got.offset, got.total_bytes) == (offset, total)



def test_put_buffer_requests_carry_the_part_they_are_of() -> None:
    part_of = wpb.PartOf(global_shape=[8, 2], op_sharding=b"\x08\x03", devices=[0, 65537], group_generation=4)
    raw = wire.put_buffer_request(5, "o", "float32", (8,), [bytes(32)], 0, 64, part_of.SerializeToString())
    expected = wpb.PutBufferRequest(buffer_id=5, owner="o", total_bytes=64, part_of=part_of,
                                    array=pb.ArrayProto(dtype="float32", shape=[8], data=bytes(32)))
    assert raw == expected.SerializeToString()
    got = wire.put_buffer(raw)
    assert wpb.PartOf.FromString(got.part_of) == part_of and got.total_bytes == 64
    assert wire.put_buffer(wire.put_buffer_request(5, "o", "float32", (8,), [bytes(32)])).part_of == b""
    with pytest.raises(wire.WireError):
        wire.put_buffer(b"\x38\x01")  # part_of as a varint


def test_host_data_slices_are_views_of_its_parts() -> None:
    raw = bytes(range(100))
    whole = HostData([raw[:10], memoryview(raw)[10:40], raw[40:]])
    for start, stop in [(0, 100), (0, 10), (5, 15), (10, 40), (39, 41), (99, 100), (50, 50)]:
        part = whole.slice(start, stop)
        assert part.tobytes() == raw[start:stop] and len(part) == stop - start
        assert all(isinstance(p, memoryview) for p in part.parts)


@pytest.mark.parametrize(("dtype", "shape", "size", "last"), [
    ("float32", (2, 3), 24, True), ("", (), 4096, False), ("bfloat16", (), 2, True), ("float32", (0,), 0, True),
    ("", (), 0, False)])
def test_fetch_chunk_messages_match_protobuf(dtype: str, shape: tuple[int, ...], size: int, last: bool) -> None:
    data = bytes(i % 241 for i in range(size))
    raw = wire.fetch_chunk_message(memoryview(data), dtype, shape, last)
    expected = wpb.FetchChunk(last=last)
    if dtype or shape or data:
        expected.array.CopyFrom(pb.ArrayProto(dtype=dtype, shape=list(shape), data=data))
    assert raw == expected.SerializeToString()
    assert wpb.FetchChunk.FromString(raw) == expected


@pytest.mark.parametrize("shape", [(2, 3), (), (0, 4), (1 << 40,)])
def test_put_buffers_are_parsed_as_protobuf_does(shape: tuple[int, ...]) -> None:
    data = bytes(range(200))
    for msg in (wpb.PutBufferRequest(buffer_id=(1 << 63) + 9, owner="client:x",
                                     array=pb.ArrayProto(dtype="float32", shape=list(shape), data=data)),
                wpb.PutBufferRequest(buffer_id=4, array=pb.ArrayProto(dtype="int8", shm_name="pw-seg"))):
        got = wire.put_buffer(msg.SerializeToString())
        assert got.buffer_id == msg.buffer_id
        assert (got.array.dtype, got.array.shape, bytes(got.array.data), got.array.shm_name) == (
            msg.array.dtype, tuple(msg.array.shape), msg.array.data, msg.array.shm_name)
    assert wire.put_buffer(b"").array.shape == ()
    unpacked = b"\x12\x06\x10\x02\x10\x03\x10\x05"  # array {shape: 2, 3, 5} written unpacked
    assert wire.put_buffer(unpacked).array.shape == tuple(wpb.PutBufferRequest.FromString(unpacked).array.shape) \
        == (2, 3, 5)
    negative = wpb.PutBufferRequest(array=pb.ArrayProto(shape=[-1])).SerializeToString()
    assert wire.put_buffer(negative).array.shape == (-1,)
    for bad in (b"\x12\x03\x0a\x02\xff\xfe", b"\x12\x05\x1a\x09abc", b"\x12\x00\x12\x00", b"\x0a\x01x"):
        with pytest.raises(wire.WireError):
            wire.put_buffer(bad)


FAULTS = """
import resource, sys
from server import heap
if sys.argv[1] == "reuse":
    assert heap.reuse_large_buffers()
def cycle():  # four 4 MiB messages in flight, then all freed: what a transfer does over and over
    blocks = [bytearray(4 << 20) for _ in range(4)]
    for b in blocks:
        b[::4096] = bytes(len(range(0, len(b), 4096)))
for _ in range(2):
    cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    cycle()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_controllers_heap_reuses_transfer_sized_buffers() -> None:
    """heap.reuse_large_buffers (the controller calls it): buffers of a few MiB, freed and made
    again, come back from the heap instead of being mapped (and page-faulted in) afresh."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root}

    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], env=env, cwd=root, capture_output=True,
                             text=True, timeout=50, check=True)
        return int(out.stdout.split()[-1])

    plain, reused = faults("plain"), faults("reuse")
    assert plain > 10 * 1024, plain  # glibc's defaults: most of each cycle's 16 MiB faults in again
    assert reused < 1024, reused  # kept for reuse: (nearly) none
