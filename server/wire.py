"""Bulk bytes on the transfer paths (the IFRT proxy's, the worker's Fetch) without protobuf's copies.

Parsing a message with a large `bytes` field and reading the field copies the bytes (upb makes
a new `bytes` object on every access), and building one copies them into the message and again
to serialize it. The host-buffer messages (`GrpcHostBufferStoreRequest`,
`GrpcHostBufferLookupResponse`: nothing but `bytes data = 1`) and the worker's `PutBufferRequest`
are read and written here straight from and into the wire format instead, and the worker's
`FetchChunk` written: a field is a view of the bytes gRPC received, and a message is its bytes
behind a 1-6 byte header. Wire format:
https://protobuf.dev/programming-guides/encoding/.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

VARINT, I64, LEN, I32 = 0, 1, 2, 5


class WireError(ValueError):
    """Bytes that are not a well-formed message of the expected kind."""


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("truncated varint")
        b = buf[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not b & 0x80:
            return value, pos


def fields(data: bytes | memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field in order: an int for varints and fixed
    widths, a view (no copy) for length-delimited fields."""
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    pos, end = 0, len(buf)
    while pos < end:
        tag, pos = _varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        if wire == VARINT:
            value, pos = _varint(buf, pos)
            yield number, wire, value
        elif wire == LEN:
            size, pos = _varint(buf, pos)
            if pos + size > end:
                raise WireError("length-delimited field past the end")
            yield number, wire, buf[pos : pos + size]
            pos += size
        elif wire in (I64, I32):
            width = 8 if wire == I64 else 4
            if pos + width > end:
                raise WireError("fixed-width field past the end")
            yield number, wire, int.from_bytes(buf[pos : pos + width], "little")
            pos += width
        else:
            raise WireError(f"wire type {wire}")


def data_field(raw: bytes) -> memoryview:
    """Field 1 (`bytes data`) of a message that has nothing else; the last occurrence wins, as
    protobuf's own parser does. WireError for anything else."""
    out = memoryview(b"")
    for number, wire, value in fields(raw):
        if number != 1 or wire != LEN:
            raise WireError(f"unexpected field {number}")
        assert isinstance(value, memoryview)
        out = value
    return out


def data_length(raw: bytes) -> int:
    """The length of the data in a serialized `{bytes data = 1}` that holds it once and nothing
    else (what `data_message` makes: a worker's `FetchData`, a `GrpcHostBufferLookupResponse`);
    reads the header only. WireError for anything else."""
    if not raw:
        return 0
    view = memoryview(raw)
    if view[0] != (1 << 3 | LEN):
        raise WireError(f"a message that is not one data field (tag byte {view[0]:#x})")
    size, pos = _varint(view, 1)
    if pos + size != len(view):
        raise WireError(f"a data field of {size} bytes in a {len(view)}-byte message")
    return size


def uvarint(value: int) -> bytes:
    """`value` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def len_field(number: int, size: int) -> bytes:
    """The tag and length of a length-delimited field `number` of `size` bytes (its body follows)."""
    return uvarint(number << 3 | LEN) + uvarint(size)


def data_message(data: bytes | memoryview) -> bytes:
    """The serialized message `{bytes data = 1}` holding `data` (one copy of it)."""
    return b"".join((len_field(1, len(data)), data)) if len(data) else b""


def put_buffer_request(buffer_id: int, owner: str, dtype: str, shape: Sequence[int],
                       parts: Sequence[bytes | memoryview], offset: int = 0, total_bytes: int = 0,
                       part_of: bytes = b"") -> bytes:
    """A serialized `pathways.v1.PutBufferRequest` (worker.proto: buffer_id = 1, array = 2
    {dtype = 1, shape = 2 (packed), data = 3}, owner = 3, offset = 4, total_bytes = 5, part_of = 7:
    `part_of`, a serialized `PartOf`) whose data is `parts`, one after another: the bytes are
    copied once, here, instead of into a message and again to serialize it."""
    size = sum(len(p) for p in parts)
    dt = dtype.encode()
    packed = b"".join(uvarint(int(d)) for d in shape)
    head = (len_field(1, len(dt)) + dt if dt else b"") + (len_field(2, len(packed)) + packed if packed else b"")
    head += len_field(3, size) if size else b""
    owned = owner.encode()
    return b"".join((
        uvarint(1 << 3 | VARINT) + uvarint(buffer_id) if buffer_id else b"",
        len_field(2, len(head) + size), head, *parts,
        len_field(3, len(owned)) + owned if owned else b"",
        uvarint(4 << 3 | VARINT) + uvarint(offset) if offset else b"",
        uvarint(5 << 3 | VARINT) + uvarint(total_bytes) if total_bytes else b"",
        len_field(7, len(part_of)) + part_of if part_of else b"",
    ))


def fetch_chunk_message(data: bytes | memoryview, dtype: str, shape: Sequence[int], last: bool) -> bytes:
    """A serialized `pathways.v1.FetchChunk` {array {dtype, shape, data}, last} (`dtype` and
    `shape` are left out when empty, as the first chunk alone carries them): one copy of `data`."""
    dt = dtype.encode()
    packed = b"".join(uvarint(int(d)) for d in shape)
    head = (len_field(1, len(dt)) + dt if dt else b"") + (len_field(2, len(packed)) + packed if packed else b"")
    head += len_field(3, len(data)) if len(data) else b""
    array_size = len(head) + len(data)
    return b"".join((len_field(1, array_size) if array_size else b"", head, data,
                     uvarint(2 << 3 | VARINT) + b"\x01" if last else b""))


@dataclass(frozen=True)
class Array:
    """A parsed `pathways.v1.ArrayProto` whose `data` is a view of the received bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview
    shm_name: str


@dataclass(frozen=True)
class PutBuffer:
    """A parsed `pathways.v1.PutBufferRequest` (its `owner` is ignored by the worker)."""

    buffer_id: int
    array: Array
    offset: int = 0  # a piece of a larger array (worker.proto): where its bytes go
    total_bytes: int = 0
    again: bool = False  # sent again after a stream that ended before acknowledging it
    part_of: bytes = b""  # a serialized `PartOf`: the array is this worker's part of a global one


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(value: memoryview) -> str:
    try:
        return bytes(value).decode()
    except UnicodeDecodeError:
        raise WireError("a string field is not UTF-8") from None


def _array(raw: memoryview) -> Array:
    dtype, shape, data, shm_name = "", [], memoryview(b""), ""
    for number, wire, value in fields(raw):
        if number == 1 and wire == LEN:
            assert isinstance(value, memoryview)
            dtype = _text(value)
        elif number == 2 and wire == LEN:  # packed
            assert isinstance(value, memoryview)
            pos = 0
            while pos < len(value):
                d, pos = _varint(value, pos)
                shape.append(_int64(d))
        elif number == 2 and wire == VARINT:
            assert isinstance(value, int)
            shape.append(_int64(value))
        elif number == 3 and wire == LEN:
            assert isinstance(value, memoryview)
            data = value
        elif number == 4 and wire == LEN:
            assert isinstance(value, memoryview)
            shm_name = _text(value)
        elif number in (1, 2, 3, 4):
            raise WireError(f"ArrayProto field {number} with wire type {wire}")
    return Array(dtype, tuple(shape), data, shm_name)


def put_buffer(raw: bytes) -> PutBuffer:
    """Parses a serialized `PutBufferRequest` without copying its array's bytes (protobuf's
    parser copies them, and again on each read of `data`). WireError when malformed, or when
    the array comes in more than one piece (which protobuf would merge; no encoder does it)."""
    buffer_id, array, offset, total, again, part_of = 0, None, 0, 0, False, b""
    for number, wire, value in fields(raw):
        if number == 1 and wire == VARINT:
            assert isinstance(value, int)
            buffer_id = value
        elif number == 6 and wire == VARINT:
            again = bool(value)
        elif number == 4 and wire == VARINT:
            assert isinstance(value, int)
            offset = value
        elif number == 5 and wire == VARINT:
            assert isinstance(value, int)
            total = value
        elif number == 2 and wire == LEN:
            if array is not None:
                raise WireError("the array in more than one piece")
            assert isinstance(value, memoryview)
            array = _array(value)
        elif number == 3 and wire == LEN:
            assert isinstance(value, memoryview)
            _text(value)
        elif number == 7 and wire == LEN:
            assert isinstance(value, memoryview)
            part_of = bytes(value)
        elif number in (1, 2, 3, 4, 5, 6, 7):
            raise WireError(f"PutBufferRequest field {number} with wire type {wire}")
    return PutBuffer(buffer_id, array or Array("", (), memoryview(b""), ""), offset, total, again, part_of)
