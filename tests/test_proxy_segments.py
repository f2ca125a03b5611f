"""Uploads through shared memory to a worker on this host (server/proxy/segments.py): the
segment holds exactly the bytes the worker's `take_segment` reads back, and a failed upload's
segments are unlinked. The uploads themselves run in tests/test_proxy_*.py (arrays >= 1 MiB)."""

from __future__ import annotations

import numpy as np
import pytest

from server.proxy import segments
from server.proxy.handles import HostData
from server.worker.shmring import take_segment

pytestmark = pytest.mark.timeout(30)


def test_on_this_host() -> None:
    assert segments.on_this_host("127.0.0.1:7070")
    assert segments.on_this_host("127.3.2.1:1") and segments.on_this_host("[::1]:7070")
    assert segments.on_this_host("localhost:7070")
    assert not segments.on_this_host("10.0.0.2:7070")
    assert not segments.on_this_host("worker-3.example:7070")


def test_segment_request_is_read_back_by_the_worker() -> None:
    arr = np.arange(3 * 1024 * 100, dtype=np.float32).reshape(3, -1)
    req, name = segments.segment_request(7, "client:x", "float32", arr.shape, arr.tobytes())
    assert req.buffer_id == 7 and req.owner == "client:x" and req.array.shm_name == name
    assert not req.array.data
    out = take_segment(req.array.shm_name, np.dtype(req.array.dtype), tuple(req.array.shape))
    np.testing.assert_array_equal(out, arr)
    segments.discard([name])  # taken and unlinked already: nothing to do, no error
    with pytest.raises(FileNotFoundError):
        take_segment(name, np.dtype("float32"), arr.shape)


def test_discard_unlinks_what_nobody_took() -> None:
    _, name = segments.segment_request(1, "client:x", "uint8", (4,), b"abcd")
    segments.discard([name])
    with pytest.raises(FileNotFoundError):
        take_segment(name, np.dtype("uint8"), (4,))


def test_segment_request_writes_host_data_part_by_part() -> None:
    arr = np.arange(5 * 1000, dtype=np.float32)
    raw = arr.tobytes()
    parts = HostData([raw[:7], memoryview(raw)[7:9000], b"", raw[9000:]])  # uneven, one empty
    req, name = segments.segment_request(8, "client:x", "float32", arr.shape, parts)
    assert req.array.shm_name == name and not req.array.data
    np.testing.assert_array_equal(take_segment(name, np.dtype("float32"), arr.shape), arr)
