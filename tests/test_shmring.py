"""The shared-memory ring that carries peer transfers between workers of one host."""

from __future__ import annotations

import os

import numpy as np
import pytest

from server.worker.shmring import ALIGN, RingReader, RingWriter, aligned_copy


def test_arrays_cross_the_ring_and_their_space_comes_back_once_read() -> None:
    writer, reader = RingWriter(capacity=4096), RingReader()
    try:
        a = np.arange(200, dtype=np.float32).reshape(10, 20)  # 800 B -> 832 B slots
        slots = [writer.put(a + i) for i in range(4)]
        assert all(s is not None for s in slots)
        assert writer.put(a) is None  # 4 x 832 in use: no room for a fifth until one is read
        for i, slot in enumerate(slots[:2]):
            assert slot is not None
            out = reader.take(writer.name, slot[0], slot[1], a.dtype, a.shape)
            np.testing.assert_array_equal(out, a + i)
            assert out.ctypes.data % ALIGN == 0 and out.flags.writeable
        assert writer.released() == slots[1][1]  # type: ignore[index]
        # the next one does not fit before the end (4 x 832 = 3328, 768 left): it starts at 0
        wrapped = writer.put(a + 9)
        assert wrapped is not None and wrapped[0] == 0
        for i, slot in [(2, slots[2]), (3, slots[3]), (9, wrapped)]:
            assert slot is not None
            np.testing.assert_array_equal(reader.take(writer.name, slot[0], slot[1], a.dtype, a.shape), a + i)
        assert writer.put(np.zeros(2048, np.uint8)) is None  # over a quarter of the ring: never
        # everything was read: the next array starts over at 0 (light traffic stays in the first pages)
        again = writer.put(a)
        assert again is not None and again[0] == 0
    finally:
        writer.close()


def test_the_reader_unlinks_the_name_and_a_ring_nobody_read_is_unlinked_by_its_writer() -> None:
    shm_dir = "/dev/shm"
    if not os.path.isdir(shm_dir):
        pytest.skip("no /dev/shm")
    read, unread = RingWriter(capacity=4096), RingWriter(capacity=4096)
    reader = RingReader()
    try:
        slot = read.put(np.ones(3, np.int64))
        assert slot is not None
        assert os.path.exists(os.path.join(shm_dir, read.name.lstrip("/")))
        np.testing.assert_array_equal(reader.take(read.name, *slot, np.dtype(np.int64), (3,)), np.ones(3))
        assert not os.path.exists(os.path.join(shm_dir, read.name.lstrip("/")))  # still mapped on both sides
        unread.close()
        assert not os.path.exists(os.path.join(shm_dir, unread.name.lstrip("/")))
        with pytest.raises(ValueError, match="past its end"):
            reader.take(read.name, 4000, 0, np.dtype(np.float64), (100,))
    finally:
        read.close()
        unread.close()


def test_aligned_copy_keeps_values_shape_and_dtype() -> None:
    src = np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2]  # not contiguous
    out = aligned_copy(src)
    assert out.ctypes.data % ALIGN == 0 and out.dtype == src.dtype and out.shape == src.shape
    np.testing.assert_array_equal(out, src)
