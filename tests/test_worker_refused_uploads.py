"""An upload the worker refuses, or one cut off mid-array, fails its buffer for whatever reads it
(server/worker/servicer.py `PutBuffers`, buffers.py `BufferStore.refuse`): a reader gets the
reason at once instead of waiting for bytes that will not come until the hang timeout, and the
uploads queued behind a refused one on the same stream are still stored.

Real processes: a controller and a worker from the `cluster` fixture, a session opened on the
controller, raw gRPC calls to the worker."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
from server import wire
from tests.conftest import LocalCluster, wait_for
from tests.test_trust_worker import fetch, meta, open_session, worker_log

pytestmark = [pytest.mark.timeout(120), pytest.mark.cluster(islands=1, devices=1)]

_END = object()


@pytest.fixture
def session(cluster: LocalCluster) -> Iterator[tuple[Any, wgrpc.WorkerStub, grpc.Channel, Any]]:
    address = cluster.hosts()["w-a"].address
    with grpc.insecure_channel(address) as wch, grpc.insecure_channel(cluster.address) as cch:
        s = open_session(cluster, cch)
        yield s, wgrpc.WorkerStub(wch), wch, meta(cluster, s)
        s.close()


def whole(buffer_id: int, arr: np.ndarray, dtype: str = "") -> wpb.PutBufferRequest:
    return wpb.PutBufferRequest(buffer_id=buffer_id, array=pb.ArrayProto(
        dtype=dtype or arr.dtype.name, shape=list(arr.shape), data=arr.tobytes()))


def wait_error(stub: wgrpc.WorkerStub, md: Any, buffer_id: int, timeout_s: float = 30.0) -> tuple[str, float]:
    """The error a Wait on `buffer_id` answers, and how long it took."""
    start = time.monotonic()
    reply = stub.Wait(wpb.WaitRequest(buffer_ids=[buffer_id], timeout_s=timeout_s), metadata=md,
                      timeout=timeout_s + 10)
    assert not reply.ready, "a buffer whose upload failed is never ready"
    return reply.error, time.monotonic() - start


def buffers(stub: wgrpc.WorkerStub, cluster: LocalCluster) -> int:
    return stub.Stats(wpb.WorkerStatsRequest(), metadata=meta(cluster), timeout=10).buffers


def test_a_refused_upload_fails_its_readers_and_the_uploads_behind_it_are_stored(
        cluster: LocalCluster, session: Any) -> None:
    s, stub, _, md = session
    reqs: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def requests() -> Iterator[wpb.PutBufferRequest]:
        while (r := reqs.get()) is not _END:
            yield r

    call = stub.PutBuffers.future(requests(), metadata=md, timeout=60)
    waiting = stub.Wait.future(wpb.WaitRequest(buffer_ids=[s.id(1)], timeout_s=30), metadata=md, timeout=40)
    time.sleep(0.3)  # the Wait is in before the refusal (a reader enqueued first)
    reqs.put(whole(s.id(1), np.zeros(3, np.float32), dtype="no-such-dtype"))
    reqs.put(whole(s.id(2), np.arange(4.0)))
    reply = waiting.result(timeout=20)
    assert not reply.ready and f"the upload of buffer {s.id(1):#x} was refused" in reply.error, reply
    assert "no-such-dtype" in reply.error, reply.error
    # the stream goes on: the upload behind the refused one is stored, and so is a later one
    np.testing.assert_array_equal(fetch(stub, md, s.id(2)), np.arange(4.0))
    reqs.put(whole(s.id(3), np.ones(2)))
    np.testing.assert_array_equal(fetch(stub, md, s.id(3)), np.ones(2))
    # a reader that comes after the refusal sees it too (the failure is held for the client)
    error, took = wait_error(stub, md, s.id(1))
    assert "was refused" in error and took < 5, (error, took)
    reqs.put(_END)
    with pytest.raises(grpc.RpcError) as e:
        call.result(timeout=20)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no-such-dtype" in (e.value.details() or "")
    # the client's release frees the failed buffer like any other
    before = buffers(stub, cluster)
    s.release(cluster.hosts()["w-a"].address, s.id(1))
    wait_for(lambda: buffers(stub, cluster) == before - 1, 30, "the refused buffer to be released")
    assert "Traceback" not in worker_log(cluster)


def test_an_upload_in_pieces_cut_off_fails_what_waits_and_leaves_nothing_otherwise(
        cluster: LocalCluster, session: Any) -> None:
    s, stub, wch, md = session
    put = wch.stream_unary("/pathways.v1.Worker/PutBuffers", request_serializer=None,
                           response_deserializer=wpb.PutBuffersResponse.FromString)
    raw = np.arange(1024, dtype=np.float32).tobytes()

    def cut_off(buffer_id: int) -> None:
        """The first half of a staged upload (pieces without a dtype), then the stream cancelled."""
        reqs: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def requests() -> Iterator[bytes]:
            while (r := reqs.get()) is not _END:
                yield r

        call = put.future(requests(), metadata=md, timeout=60)
        reqs.put(wire.put_buffer_request(buffer_id, s.owner, "", (), [raw[:2048]], 0, len(raw)))
        time.sleep(0.5)  # the piece is in
        call.cancel()
        reqs.put(_END)

    before = buffers(stub, cluster)
    # nobody waits: nothing is kept (as when the proxy drops an unused host buffer)
    cut_off(s.id(10))
    time.sleep(0.5)
    assert buffers(stub, cluster) == before
    # a reader waits: it gets the reason at once
    waiting = stub.Wait.future(wpb.WaitRequest(buffer_ids=[s.id(11)], timeout_s=30), metadata=md, timeout=40)
    time.sleep(0.3)
    start = time.monotonic()
    cut_off(s.id(11))
    reply = waiting.result(timeout=20)
    assert not reply.ready and f"the upload of buffer {s.id(11):#x} ended after 2048 of its 4096 bytes" \
        in reply.error, reply
    assert time.monotonic() - start < 10
    assert "Traceback" not in worker_log(cluster)


def test_a_part_for_a_group_this_worker_is_not_in_is_refused_and_the_stream_goes_on(
        cluster: LocalCluster, session: Any) -> None:
    """An upload that says it is this worker's part of an array over an island group
    (`PutBufferRequest.part_of`) while the worker is in no group (or another generation: a remap
    under way) fails that buffer naming the generations; the uploads behind it are stored."""
    s, stub, _, md = session
    part = wpb.PutBufferRequest(buffer_id=s.id(21), array=pb.ArrayProto(
        dtype="float32", shape=[4], data=np.arange(4, dtype=np.float32).tobytes()), part_of=wpb.PartOf(
        global_shape=[8], op_sharding=b"\x08\x03\x1a\x01\x02\x22\x02\x00\x01", devices=[0, 65536], group_generation=3))
    with pytest.raises(grpc.RpcError) as e:
        stub.PutBuffers(iter([part, whole(s.id(22), np.arange(3.0))]), metadata=md, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert "island group generation 3, but this worker is in generation 0" in (e.value.details() or "")
    error, _ = wait_error(stub, md, s.id(21))
    assert "was refused" in error and "generation 3" in error, error
    np.testing.assert_array_equal(fetch(stub, md, s.id(22)), np.arange(3.0))
    assert "Traceback" not in worker_log(cluster)


def test_a_part_made_of_buffers_it_cannot_use_is_refused(cluster: LocalCluster, session: Any) -> None:
    """An uploaded part made of buffers (`PartOf.sources`) that are not the session's, or not of
    the part's dtype, is refused at once naming them; the stream goes on."""
    s, stub, _, md = session

    def part(buffer_id: int, sources: list[int]) -> wpb.PutBufferRequest:
        return wpb.PutBufferRequest(buffer_id=buffer_id, array=pb.ArrayProto(dtype="float32", shape=[0]),
                                    part_of=wpb.PartOf(global_shape=[8], op_sharding=b"\x08\x03", devices=[0, 65536],
                                                       group_generation=3, sources=sources))

    stub.PutBuffers(iter([whole(s.id(31), np.arange(4.0))]), metadata=md, timeout=30)  # float64
    for bid, sources, why in ((s.id(32), [s.id(31)], "a source of dtype float64 for a part of dtype float32"),
                              (s.id(33), [(1 << 62) + 5], "are not here")):
        with pytest.raises(grpc.RpcError) as e:
            stub.PutBuffers(iter([part(bid, sources), whole(bid + 100, np.ones(2))]), metadata=md, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in (e.value.details() or ""), e.value
        np.testing.assert_array_equal(fetch(stub, md, bid + 100), np.ones(2))
    assert "Traceback" not in worker_log(cluster)
