"""The shared-memory ring and the Unix-socket notices that carry peer transfers between workers
of one host."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from schemas.pathways.v1 import worker_pb2 as wpb
from server.worker import locallink
from server.worker.shmring import ALIGN, RingReader, RingWriter, aligned_copy, put_segment, take_segment


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


@pytest.mark.skipif(not locallink.available(), reason="abstract Unix sockets are Linux only")
def test_same_host_notices_arrive_in_order_with_their_arrays() -> None:
    address = f"127.0.0.1:test-{os.getpid()}"
    got: list[tuple[int, np.ndarray]] = []

    def deliver(ring: RingReader, notice: wpb.TransferChunk) -> None:
        a = notice.array
        got.append((notice.buffer_id, ring.take(notice.ring, notice.ring_offset, notice.ring_release,
                                                np.dtype(a.dtype), tuple(a.shape))))

    async def main() -> None:
        receiver = locallink.LocalReceiver(address, deliver)
        assert receiver.start()
        peers = locallink.LocalPeers()
        try:
            peer = peers.get(address)
            assert peer is not None and peers.get(address) is peer
            for i in range(50):  # 50 x 256 KiB through a 4 MiB ring: it must be released as read
                arr = np.full((256, 256), i, np.float32)
                while not await asyncio.to_thread(peer.send, i, arr):
                    await asyncio.sleep(0.01)  # full: the receiver reads on this loop
            for _ in range(500):
                if len(got) == 50:
                    break
                await asyncio.sleep(0.01)
        finally:
            peers.close()
            receiver.close()
        assert peers.get("127.0.0.1:nobody-listens") is None  # the caller falls back to gRPC

    asyncio.run(main())
    assert [b for b, _ in got] == list(range(50))
    assert all(float(arr[0, 0]) == i and float(arr[-1, -1]) == i for i, arr in got)


def test_an_array_too_big_for_a_ring_travels_in_a_segment_of_its_own() -> None:
    src = np.arange(300_000, dtype=np.float32).reshape(3, -1)
    name = put_segment(src)
    out = take_segment(name, src.dtype, src.shape)
    np.testing.assert_array_equal(out, src)
    with pytest.raises(FileNotFoundError):  # taken once: the receiver unlinked it
        take_segment(name, src.dtype, src.shape)
    small = put_segment(np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match="bytes for"):
        take_segment(small, np.dtype(np.float64), (100,))
