"""An upload over one worker message, in pieces (server/worker/uploads.py): the pieces of one
buffer, in order, make the array; anything else is refused with a reason."""

from __future__ import annotations

import numpy as np
import pytest

from server import wire
from server.worker.uploads import Assembly, add_piece

pytestmark = pytest.mark.timeout(30)


def pieces(buffer_id: int, arr: np.ndarray, size: int) -> list[wire.PutBuffer]:
    raw = arr.tobytes()
    return [wire.put_buffer(wire.put_buffer_request(buffer_id, "o", arr.dtype.name if i == 0 else "",
                                                    arr.shape if i == 0 else (), [raw[i:i + size]], i, len(raw)))
            for i in range(0, len(raw), size)]


def assemble(reqs: list[wire.PutBuffer]) -> Assembly:
    current = None
    for r in reqs:
        current = add_piece(current, r)
    assert current is not None
    return current


def test_pieces_in_order_make_the_array() -> None:
    arr = np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000)
    for size in (7, 4096, 12000):  # uneven, and one piece for all
        got = assemble(pieces(5, arr, size))
        assert got.done and got.buffer_id == 5
        np.testing.assert_array_equal(got.array(), arr)
    partial = assemble(pieces(5, arr, 4096)[:2])
    assert not partial.done and partial.filled == 8192


def test_a_part_in_pieces_keeps_the_part_of_its_first_piece() -> None:
    """An uploaded part over one message (worker.proto `part_of`, on the first piece only): the
    assembled array carries it, for the worker to store it as its part (servicer.py)."""
    arr = np.arange(1000, dtype=np.float32)
    raw = arr.tobytes()
    reqs = [wire.put_buffer(wire.put_buffer_request(5, "o", "float32" if i == 0 else "", (1000,) if i == 0 else (),
                                                    [raw[i:i + 1024]], i, len(raw), b"part" if i == 0 else b""))
            for i in range(0, len(raw), 1024)]
    got = assemble(reqs)
    assert got.done and got.part_of == b"part"
    np.testing.assert_array_equal(got.array(), arr)
    assert assemble(pieces(5, arr, 1024)).part_of == b""


def test_pieces_out_of_order_or_of_another_buffer_are_refused() -> None:
    arr = np.arange(2000, dtype=np.int32)
    first, second, third = pieces(5, arr, 3000)[:3]
    with pytest.raises(ValueError, match="before the piece at 0"):
        add_piece(None, second)
    started = add_piece(None, first)
    with pytest.raises(ValueError, match="continues at 3000"):
        add_piece(started, third)
    other = pieces(6, arr, 3000)[1]
    with pytest.raises(ValueError, match="continues at 3000"):
        add_piece(started, other)


def test_sizes_that_disagree_are_refused() -> None:
    arr = np.arange(100, dtype=np.float32)
    raw = arr.tobytes()
    wrong_total = wire.put_buffer(wire.put_buffer_request(1, "o", "float32", (100,), [raw[:40]], 0, 399))
    with pytest.raises(ValueError, match="399 bytes announced"):
        add_piece(None, wrong_total)
    started = add_piece(None, wire.put_buffer(wire.put_buffer_request(1, "o", "float32", (100,), [raw[:300]], 0,
                                                                      400)))
    too_much = wire.put_buffer(wire.put_buffer_request(1, "o", "", (), [raw[:200]], 300, 400))
    with pytest.raises(ValueError, match="for an array of 400"):
        add_piece(started, too_much)
    with pytest.raises(ValueError, match="unknown dtype"):
        add_piece(None, wire.put_buffer(wire.put_buffer_request(1, "o", "nope", (4,), [raw[:4]], 0, 16)))
    segment = wire.put_buffer(wpb_segment())
    with pytest.raises(ValueError, match="shared-memory name"):
        add_piece(None, segment)


def wpb_segment() -> bytes:
    from schemas.pathways.v1 import common_pb2 as pb
    from schemas.pathways.v1 import worker_pb2 as wpb
    return wpb.PutBufferRequest(buffer_id=1, total_bytes=4, array=pb.ArrayProto(dtype="float32", shape=[1],
                                                                                 shm_name="pw-x")).SerializeToString()


def test_assembled_arrays_are_aligned_for_xla() -> None:
    arr = np.arange(10_000, dtype=np.float32)
    got = assemble(pieces(5, arr, 4096)).array()
    assert got.ctypes.data % 64 == 0
    np.testing.assert_array_equal(got, arr)


def staged(buffer_id: int, raw: bytes, size: int, total: int = 0) -> list[wire.PutBuffer]:
    """A staged upload's byte pieces (of `total` bytes, default all of `raw`): no dtype or shape."""
    return [wire.put_buffer(wire.put_buffer_request(buffer_id, "o", "", (), [raw[i:i + size]], i,
                                                    total or len(raw)))
            for i in range(0, len(raw), size)]


def spec_piece(buffer_id: int, dtype: str, shape: tuple[int, ...], offset: int, total: int,
               data: bytes = b"") -> wire.PutBuffer:
    return wire.put_buffer(wire.put_buffer_request(buffer_id, "o", dtype, shape, [data], offset, total))


def test_a_staged_upload_is_an_array_once_its_spec_arrives() -> None:
    arr = np.arange(3000, dtype=np.float32).reshape(30, 100)
    raw = arr.tobytes()
    current = assemble(staged(9, raw, 1000))
    assert current.filled == len(raw) and not current.done  # the bytes, but not yet the spec
    current = add_piece(current, spec_piece(9, "float32", (30, 100), len(raw), len(raw)))
    assert current.done
    np.testing.assert_array_equal(current.array(), arr)
    # the spec may also come with the last bytes
    last = assemble(staged(9, raw[:2000], 1000, len(raw)))
    last = add_piece(last, spec_piece(9, "float32", (30, 100), 2000, len(raw), raw[2000:]))
    assert last.done
    np.testing.assert_array_equal(last.array(), arr)


def test_a_staged_spec_that_disagrees_with_the_bytes_is_refused() -> None:
    raw = np.arange(100, dtype=np.float32).tobytes()
    current = assemble(staged(9, raw, 100))
    with pytest.raises(ValueError, match=r"array \(800 bytes\) from 400 bytes"):
        add_piece(current, spec_piece(9, "float64", (100,), len(raw), len(raw)))
    with pytest.raises(ValueError, match="unknown dtype"):
        add_piece(current, spec_piece(9, "nope", (100,), len(raw), len(raw)))
    given = add_piece(assemble(staged(9, raw[:200], 100, len(raw))), spec_piece(9, "float32", (100,), 200, len(raw)))
    with pytest.raises(ValueError, match="a second dtype and shape"):
        add_piece(given, spec_piece(9, "float32", (100,), 200, len(raw), raw[200:]))
