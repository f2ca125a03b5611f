"""Uploads to a worker on this host through POSIX shared memory (the worker's `PutBuffers`
takes an `ArrayProto.shm_name`, as for transfers between workers: server/worker/shmring.py).

Through gRPC a 64 MiB upload costs the controller a copy out of the bytes it received, one into
the protobuf message, one to serialize it, and the worker's parse, and arrays over a worker
message (64 MiB) go in parts joined by a program on the worker. Through a segment it is one copy
in, one out (the worker unlinks the segment as it maps it), whatever the size."""

from __future__ import annotations

import _posixshmem
import contextlib
import ipaddress
from collections.abc import Iterable
from typing import Any

import numpy as np

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb

from ..worker.shmring import put_parts_segment, put_segment
from .handles import HostData

MIN_BYTES = 1 << 20  # smaller arrays go inline: a segment (shm_open, mmap, page faults) costs more


def on_this_host(address: str) -> bool:
    """Whether a worker at `address` ("host:port") is reached over loopback (this host)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def segment_request(buffer_id: int, owner: str, dtype: str, shape: tuple[int, ...], data: Any) -> tuple[
        wpb.PutBufferRequest, str]:
    """A `PutBufferRequest` whose bytes are in a new segment, and the segment's name. A
    `HostData` is written part by part, as the client sent it."""
    if isinstance(data, HostData):
        name = put_parts_segment(data.parts, data.nbytes)
    else:
        name = put_segment(np.frombuffer(data, np.uint8))
    array = pb.ArrayProto(dtype=dtype, shape=list(shape), shm_name=name)
    return wpb.PutBufferRequest(buffer_id=buffer_id, owner=owner, array=array), name


def discard(names: Iterable[str]) -> None:
    """Unlinks segments a failed upload may have left (those the worker took are gone already)."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink(name)
