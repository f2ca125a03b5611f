"""An upload over one gRPC message, in pieces (`PutBufferRequest.offset` / `total_bytes`).

The worker takes messages of at most 64 MiB (transfer.py). A larger array used to go as several
arrays joined by a program on the worker; now its pieces are copied, as they arrive, into one
array of the announced size, stored when the last piece is in. The pieces of one buffer come in
order, back to back, in one `PutBuffers` stream; anything else is refused (ValueError).

A staged upload (the IFRT proxy streams a host buffer on before it knows the array's type) sends
its first piece without a dtype: the bytes are collected as they come, and the spec arrives on a
later piece (an empty one after the last bytes is fine); the array is stored only once both the
bytes and the spec are in, and only if the spec's size is the bytes announced.

Also here: decoding an upload of one message (`decode_upload`) and what one upload stream did
so far (`UploadStream`), for the worker's `PutBuffers` and `Uploads` handlers (servicer.py)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np

from schemas.arrays import aligned_empty, from_bytes, resolve_dtype
from schemas.pathways.v1 import common_pb2 as pb

from .. import wire

MAX_RANK = 64


def check_spec(dtype_name: str, shape: tuple[int, ...] | list[int]) -> tuple[np.dtype, int]:
    """(dtype, bytes) of an uploaded array's spec; ValueError saying what is wrong with it."""
    try:
        dtype = resolve_dtype(dtype_name)
    except (TypeError, ValueError) as e:
        raise ValueError(f"unknown dtype {dtype_name!r}") from e
    if dtype.hasobject:
        raise ValueError(f"dtype {dtype_name!r} cannot travel as bytes")
    if len(shape) > MAX_RANK or any(d < 0 for d in shape):
        raise ValueError(f"invalid shape {list(shape)}")
    count = 1
    for d in shape:
        count *= d
    return dtype, count * dtype.itemsize


@dataclass
class Assembly:
    """One array being assembled from its pieces."""

    buffer_id: int
    dtype: np.dtype | None  # None: a staged upload whose spec has not come yet
    shape: tuple[int, ...]
    out: np.ndarray  # uint8, total bytes
    filled: int = 0
    part_of: bytes = b""  # the first piece's `part_of` (worker.proto): a part of a global array

    @property
    def done(self) -> bool:
        return self.filled == len(self.out) and self.dtype is not None

    def array(self) -> np.ndarray:
        assert self.dtype is not None
        return self.out.view(self.dtype).reshape(self.shape)


def add_piece(current: Assembly | None, req: wire.PutBuffer) -> Assembly:
    """`current` (None: none under way) with the piece `req` copied in; ValueError for a piece
    out of order, of another buffer, past the announced size, or a spec that disagrees with it.
    MemoryError when the announced size cannot be allocated."""
    if req.array.shm_name:
        raise ValueError("uploads carry their bytes inline; a shared-memory name is not accepted")
    data = req.array.data
    if current is None:
        if req.offset != 0:
            raise ValueError(f"a piece at offset {req.offset} before the piece at 0")
        dtype: np.dtype | None = None
        if req.array.dtype:
            dtype, nbytes = check_spec(req.array.dtype, req.array.shape)
            if nbytes != req.total_bytes:
                raise ValueError(f"{req.total_bytes} bytes announced for {req.array.dtype}{list(req.array.shape)}, "
                                 f"expected {nbytes}")
        # 64-byte aligned: XLA on CPU adopts the array without another copy (schemas/arrays.py)
        current = Assembly(req.buffer_id, dtype, tuple(req.array.shape), aligned_empty((req.total_bytes,), np.uint8),
                           part_of=req.part_of)
    elif req.buffer_id != current.buffer_id or req.offset != current.filled or req.total_bytes != len(current.out):
        raise ValueError(f"a piece of buffer {req.buffer_id:#x} at offset {req.offset} where buffer "
                         f"{current.buffer_id:#x} continues at {current.filled}")
    elif req.array.dtype:  # the spec of a staged upload
        if current.dtype is not None:
            raise ValueError(f"buffer {req.buffer_id:#x}: a second dtype and shape")
        dtype, nbytes = check_spec(req.array.dtype, req.array.shape)
        if nbytes != len(current.out):
            raise ValueError(f"a {req.array.dtype}{list(req.array.shape)} array ({nbytes} bytes) from "
                             f"{len(current.out)} bytes")
        current.dtype, current.shape = dtype, tuple(req.array.shape)
    end = current.filled + len(data)
    if end > len(current.out):
        raise ValueError(f"pieces of {end} bytes or more for an array of {len(current.out)}")
    current.out[current.filled : end] = np.frombuffer(data, np.uint8)
    current.filled = end
    return current


def decode_upload(array: pb.ArrayProto | wire.Array) -> np.ndarray:
    """A client's uploaded array; ValueError saying what is wrong with it."""
    if array.shm_name:
        # a name would make the worker open (and unlink) a segment it never handed out
        raise ValueError("uploads carry their bytes inline; a shared-memory name is not accepted")
    _, nbytes = check_spec(array.dtype, list(array.shape))
    data = array.data  # a view of the received bytes (wire.put_buffer); a message's field: a copy
    if nbytes != len(data):
        raise ValueError(f"{len(data)} bytes for {array.dtype}{list(array.shape)}, expected {nbytes}")
    return from_bytes(array.dtype, list(array.shape), data)


@dataclass
class UploadStream:
    """What one upload stream did so far."""

    handled: int = 0  # messages handled (stored, refused, or a piece copied in)
    count: int = 0  # arrays stored
    refused: tuple[grpc.StatusCode, str] | None = None  # the first refusal's status
    pieces: Assembly | None = None  # an array over one message, in pieces, under way
