"""A proxy session's answers: written in the order they are ready, by one writer, and the small
ones made as bytes without building a message.

`AnswerWriter` owns the stream's writes (grpc.aio allows one write in flight per call): the
session's reader hands it each answer (`put`) and goes on reading; the writer task writes them
one after another. A reader that finds `MAX_QUEUED` answers, or `MAX_QUEUED_BYTES` bytes of them,
unwritten waits until the writer has caught up (`room`), so a client that never reads holds only
its own session's answers, and a bounded amount of them.

Pre-serialized answers (`Encoder`): an `IfrtResponse` is its `response_metadata` (the op id)
followed by the one response field of its kind; serialized messages concatenate into their
merge (https://protobuf.dev/programming-guides/encoding/), so an answer can be the op id's few
bytes joined to a body made once (a `DestructArrayResponse` is always empty) or from parts kept
per executable (an Execute's output descriptors differ per call only in their handles:
executables.py). Field numbers and types come from the installed client's descriptors.
"""

from __future__ import annotations

import asyncio
import collections
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf import descriptor

from .. import wire

MAX_QUEUED = 4096  # answers of one session written at most behind the reader
MAX_QUEUED_BYTES = 64 << 20  # and at most this many bytes of them (an answer can be as large as its request)


class AnswerWriter:
    """Writes a session's answers with `write` (the call's `context.write`), in `put` order.
    Full at `max_queued` answers or `max_bytes` bytes unwritten: a client that never reads, sending
    requests whose answers are large (a GetDefaultLayout of 100,000 dimensions answers 0.6 MB),
    made the controller hold up to 4,096 of them (the proxy fuzz: 0.5 GB in 20 s, still growing)."""

    def __init__(self, write: Callable[[bytes], Awaitable[None]], max_queued: int = MAX_QUEUED,
                 max_bytes: int = MAX_QUEUED_BYTES) -> None:
        self._write = write
        self._queue: collections.deque[bytes] = collections.deque()
        self._max = max_queued
        self._max_bytes = max_bytes
        self._bytes = 0  # of the queued answers
        self._wake: asyncio.Future[None] | None = None  # the idle writer waits on it
        self._space: asyncio.Future[None] | None = None  # a reader waits on it for room
        self._closed = False

    @property
    def full(self) -> bool:
        return len(self._queue) >= self._max or self._bytes >= self._max_bytes

    def put(self, answer: bytes) -> None:
        self._queue.append(answer)
        self._bytes += len(answer)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def close(self) -> None:
        """No more answers: `run` returns once the queued ones are written."""
        self._closed = True
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def room(self) -> None:
        """Returns once fewer than `max_queued` answers (and `max_bytes` bytes) wait to be written."""
        while self.full:
            if self._space is None or self._space.done():
                self._space = asyncio.get_running_loop().create_future()
            await self._space

    async def run(self) -> None:
        """The writer: writes every answer put, until `close` and the queue is empty."""
        queue = self._queue
        while True:
            while queue:
                answer = queue.popleft()
                await self._write(answer)
                self._bytes -= len(answer)
                if self._space is not None and not self._space.done() and not self.full:
                    self._space.set_result(None)
            if self._closed:
                return
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
            self._wake = None


def _tag(number: int, wire_type: int) -> bytes:
    return wire.uvarint(number << 3 | wire_type)


def scalar(field: descriptor.FieldDescriptor) -> Callable[[int], bytes]:
    """Encodes a non-negative integer as `field` (fixed64 or a varint type; 0 as nothing, as
    protobuf writes proto3 scalars)."""
    if field.type in (descriptor.FieldDescriptor.TYPE_FIXED64, descriptor.FieldDescriptor.TYPE_SFIXED64):
        tag, pack = _tag(field.number, wire.I64), struct.Struct("<Q").pack
        return lambda value: tag + pack(value) if value else b""
    if field.type in (descriptor.FieldDescriptor.TYPE_UINT64, descriptor.FieldDescriptor.TYPE_INT64,
                      descriptor.FieldDescriptor.TYPE_UINT32, descriptor.FieldDescriptor.TYPE_INT32):
        tag = _tag(field.number, wire.VARINT)
        return lambda value: tag + wire.uvarint(value) if value else b""
    raise TypeError(f"{field.full_name}: not an integer field this encoder writes")


_LEN_TAGS = [_tag(n, wire.LEN) for n in range(32)]  # the tags of fields 0-31 (one byte each, made once)
_SMALL = [bytes((n,)) for n in range(128)]  # the lengths that are one byte


def message_field(number: int, body: bytes) -> bytes:
    """A length-delimited field `number` holding the serialized `body`."""
    size = len(body)
    if number < 32 and size < 128:  # an answer's fields: no varint to build
        return _LEN_TAGS[number] + _SMALL[size] + body
    return wire.len_field(number, size) + body


class Encoder:
    """Pre-serialized pieces of `IfrtResponse`s, from the protocol's descriptors (`proto`)."""

    def __init__(self, proto: Any) -> None:
        response = proto.IfrtResponse.DESCRIPTOR
        meta = response.fields_by_name["response_metadata"]
        self._meta_number = meta.number
        self._op_id = scalar(meta.message_type.fields_by_name["op_id"])
        self._numbers = {f.name: f.number for f in response.fields}
        execute = response.fields_by_name["loaded_executable_execute_response"].message_type
        self.execute_number = self._numbers["loaded_executable_execute_response"]
        self.outputs_number = execute.fields_by_name["outputs"].number
        self.status_handle = scalar(execute.fields_by_name["status_handle"])
        self.array_handle = scalar(execute.fields_by_name["outputs"].message_type.fields_by_name["array_handle"])
        self._empty: dict[str, bytes] = {}

    def metadata(self, op_id: int) -> bytes:
        """The `response_metadata` field of a successful answer to `op_id`."""
        return message_field(self._meta_number, self._op_id(op_id))

    def empty(self, kind: str) -> bytes:
        """The body of an answer of `kind` (e.g. `destruct_array_response`) with no fields set."""
        body = self._empty.get(kind)
        if body is None:
            body = self._empty[kind] = message_field(self._numbers[kind], b"")
        return body
