"""schemas/arrays.py's receiving helpers: arrays that XLA on CPU adopts without a copy."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

from schemas.arrays import ALIGN, aligned_empty, byte_view, from_parts
from schemas.pathways.v1 import common_pb2 as pb
from server.worker.transfer import peer_array

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("shape,dtype", [((), np.float32), ((0, 3), np.int64), ((5, 7), ml_dtypes.bfloat16),
                                         ((1 << 20,), np.uint8)])
def test_aligned_empty_starts_on_a_boundary(shape: tuple[int, ...], dtype: type) -> None:
    for _ in range(4):
        a = aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % ALIGN == 0 or a.size == 0  # an empty array's pointer means nothing


def test_a_stream_s_chunks_join_into_an_array_jax_adopts() -> None:
    want = np.arange(3 * 1024 * 1024 + 5, dtype=np.float32).reshape(-1, 1)
    raw = bytes(byte_view(want))
    parts = [raw[i:i + 1 << 20] for i in range(0, len(raw), 1 << 20)]
    got = peer_array(pb.ArrayProto(dtype="float32", shape=list(want.shape)), parts)
    np.testing.assert_array_equal(got, want)
    assert got.ctypes.data % ALIGN == 0
    assert jax.device_put(got, jax.devices("cpu")[0]).unsafe_buffer_pointer() == got.ctypes.data
    with pytest.raises(ValueError, match="expected"):
        from_parts("float32", [4], [b"\0" * 8, b"\0" * 4])
    np.testing.assert_array_equal(from_parts("int8", [3], [b"\1\2", b"\3\4"]), [1, 2, 3])  # extra bytes ignored
