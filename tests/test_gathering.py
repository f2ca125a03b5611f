"""A worker gathering the parts of a multi-host slice's array from its members (parts.py,
Gathering) keeps no unfinished entry, nor its memory, once the array can no longer be whole:
the run reading it dropped (the controller's host-loss handling; or before its reader
arrived, which then fails on arrival), the buffer failed or released, or no part came for a
bounded time. Real worker servicer, executor (its launch and
completion threads around the state machine), buffer store and JAX on this process's CPU."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import jax
import numpy as np
import pytest
from test_worker_executor import X, register

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
from server.worker.buffers import BufferFailed, BufferStore
from server.worker.executor import Executor
from server.worker.handlers import add_to_server
from server.worker.servicer import WorkerServicer
from server.worker.transfer import TransferSender


@pytest.fixture
def servicer() -> Iterator[WorkerServicer]:
    store, sender = BufferStore(), TransferSender()
    ex = Executor(store, jax.devices("cpu")[:1], lambda *a: None, sender)
    register(ex, lambda x: x + 1, "inc", segment_id=1, label="p/0 inc")
    s = WorkerServicer(store, ex, "w1", "a")
    yield s
    s.close()
    ex.stop()
    sender.close()


def part(s: WorkerServicer, bid: int, start: int) -> int:
    """Member's part [start, start + 2) of X (shape (4,)), delivered as a peer's transfer."""
    head = wpb.TransferChunk(buffer_id=bid, part_start=[start], global_shape=[4], last=True)
    return s.deliver_peer(head, X[start:start + 2].copy())


def until(cond: object, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


@pytest.mark.timeout(60)
def test_a_dropped_runs_half_gathered_input_goes_and_its_late_parts_are_ignored(servicer: WorkerServicer) -> None:
    s, store = servicer, servicer.store
    s.executor.submit(wpb.Enqueue(tasks=[wpb.Task(run_id=1, segment=0, seq=1, segment_id=1, input_ids=[10],
                                                  output_ids=[20], output_visible=[True], owner="client:1")]))
    assert part(s, 10, 0) == 0  # one member's part: the other member's host dies before it sends
    assert s.gathering.open_ids() == [10] and s.gathering.open_bytes() == X.nbytes
    s.executor.drop([1], "host w2 was lost")  # as the controller's host-loss handling does
    assert until(lambda: s.gathering.open_ids() == []), "the dropped run's parts stayed"
    with pytest.raises(BufferFailed, match="host w2 was lost"):
        store.wait(20, timeout=10)
    assert part(s, 10, 2) == 0  # the other part, late: ignored, no new entry, no buffer
    assert s.gathering.open_ids() == [] and store.owner_of(10) is None  # (20: the failed output, kept)
    assert s.gathering.sweep() == 0


def late_reader(s: WorkerServicer, run: int, seq: int, bid: int, out: int) -> None:
    """The reader of `bid`, enqueued after its run was dropped (its Enqueue overtaken by the Drop)."""
    s.executor.submit(wpb.Enqueue(tasks=[wpb.Task(run_id=run, segment=0, seq=seq, segment_id=1, input_ids=[bid],
                                                  output_ids=[out], output_visible=[True], owner="client:1")]))


@pytest.mark.timeout(60)
def test_a_reader_arriving_after_its_run_was_dropped_takes_the_half_gathered_input_with_it(
        servicer: WorkerServicer) -> None:
    s, store = servicer, servicer.store
    assert part(s, 30, 0) == 0  # one member's part came; the run is dropped before its reader is here
    s.executor.drop([3], "cancelled by the client")
    assert s.gathering.open_ids() == [30]  # (the worker cannot tell yet whose input 30 is)
    late_reader(s, 3, 1, 30, 31)
    with pytest.raises(BufferFailed, match="cancelled by the client"):
        store.wait(31, timeout=10)  # the reader failed at once, naming the run's reason
    assert until(lambda: s.gathering.open_ids() == []), "the dropped run's parts stayed until the idle time"
    assert s.gathering.open_bytes() == 0 and store.owner_of(30) is None  # nor any entry of it in the store
    assert part(s, 30, 2) == 0  # the other member's part, late: ignored
    assert s.gathering.open_ids() == [] and store.owner_of(30) is None


@pytest.mark.timeout(60)
def test_parts_arriving_after_the_late_reader_of_a_dropped_run_failed_are_ignored(servicer: WorkerServicer) -> None:
    s, store = servicer, servicer.store
    s.executor.drop([4], "host w2 was lost")
    late_reader(s, 4, 1, 32, 33)
    with pytest.raises(BufferFailed, match="host w2 was lost"):
        store.wait(33, timeout=10)
    assert part(s, 32, 0) == 0  # a member's part, sent before it heard of the drop
    assert s.gathering.open_ids() == [] and store.owner_of(32) is None


@pytest.mark.timeout(60)
def test_a_reader_of_a_live_run_keeps_the_entry_a_dropped_runs_reader_leaves(servicer: WorkerServicer) -> None:
    """Parts are dropped only when no reader here still needs them."""
    s, store = servicer, servicer.store
    part(s, 34, 0)
    s.executor.submit(wpb.Enqueue(tasks=[wpb.Task(run_id=5, segment=0, seq=1, segment_id=1, input_ids=[34],
                                                  output_ids=[35], output_visible=[True], owner="client:1")]))
    s.executor.drop([6], "cancelled")
    late_reader(s, 6, 2, 34, 36)  # another run's reader of the same array, its run dropped
    with pytest.raises(BufferFailed, match="cancelled"):
        store.wait(36, timeout=10)
    assert s.gathering.open_ids() == [34]  # run 5's reader still waits for it
    part(s, 34, 2)
    np.testing.assert_array_equal(store.wait(35, timeout=10), X + 1)


@pytest.mark.timeout(60)
def test_a_drop_naming_a_gathered_buffer_whose_reader_never_came_takes_its_parts_at_once(
        servicer: WorkerServicer) -> None:
    """Sequential dispatch sends the reader once the gang node finished: when the run is dropped
    first, the reader never comes, and the parts a member sent would stay until the idle time
    (120 s). The controller's Drop names the run's gathered ids here (Drop.gathered_ids)."""
    s, store = servicer, servicer.store
    assert s.gathering.idle_s == 120.0  # the last resort is not what ends it
    assert part(s, 40, 0) == 0  # member g0's part; g1's host dies before it sends
    assert part(s, 41, 0) == 0 and part(s, 41, 2) == X.nbytes  # another gathered value: whole, held
    assert s.gathering.open_ids() == [40] and store.stats() == (1, X.nbytes)  # held for the reader
    s.drop_runs(cpb.Drop(run_ids=[9], reason="host g1 was lost", skipped_seqs=[1], gathered_ids=[40, 41]))
    assert s.gathering.open_ids() == [] and s.gathering.open_bytes() == 0
    assert store.stats() == (0, 0) and store.owner_of(40) is None and store.owner_of(41) is None
    assert part(s, 40, 2) == 0  # the other member's part, late: ignored
    assert s.gathering.open_ids() == [] and store.owner_of(40) is None and s.gathering.sweep() == 0
    # the worker goes on: the reader's seq (1) was skipped, the next task runs
    store.put(42, X, X.nbytes, owner="client:1", client_ref=True)
    s.executor.submit(wpb.Enqueue(tasks=[wpb.Task(run_id=10, segment=0, seq=2, segment_id=1, input_ids=[42],
                                                  output_ids=[43], output_visible=[True], owner="client:1")]))
    np.testing.assert_array_equal(store.wait(43, timeout=10), X + 1)


@pytest.mark.timeout(60)
def test_a_drop_fails_the_gathered_input_its_enqueued_reader_waits_for(servicer: WorkerServicer) -> None:
    s, store = servicer, servicer.store
    s.executor.submit(wpb.Enqueue(tasks=[wpb.Task(run_id=11, segment=0, seq=1, segment_id=1, input_ids=[44],
                                                  output_ids=[45], output_visible=[True], owner="client:1")]))
    part(s, 44, 0)
    s.drop_runs(cpb.Drop(run_ids=[11], reason="cancelled by the client", gathered_ids=[44]))
    with pytest.raises(BufferFailed, match="cancelled by the client"):
        store.wait(45, timeout=10)
    assert s.gathering.open_ids() == []
    assert until(lambda: store.owner_of(44) is None), "the dropped run's gathered input stayed"


@pytest.mark.timeout(60)
def test_a_drop_frees_the_copies_peers_sent_for_readers_that_never_came(servicer: WorkerServicer) -> None:
    """A peer's output sent here before its reader (sequential dispatch) is held for it; the run's
    Drop names it (Drop.routed_ids): the copy goes, unless a reader or the client holds it."""
    s, store = servicer, servicer.store
    whole = wpb.TransferChunk(buffer_id=50, last=True)
    for bid in (50, 51, 52):
        whole.buffer_id = bid
        assert s.deliver_peer(whole, X.copy()) == X.nbytes
    store.add_consumers([51])  # a live reader of 51 here
    store.keep(52, "client:1")  # 52 kept for the client (a staged upload moved here)
    assert store.stats() == (3, 3 * X.nbytes)
    s.drop_runs(cpb.Drop(run_ids=[12], reason="node 1 failed", skipped_seqs=[1], routed_ids=[50, 51, 52, 53]))
    assert store.owner_of(50) is None and store.owner_of(53) is None
    assert store.stats() == (2, 2 * X.nbytes)
    np.testing.assert_array_equal(store.wait(51, timeout=1), X)
    store.consumer_done(51)
    assert store.stats() == (1, X.nbytes)  # the client's 52 stays until released
    store.release([52])
    assert store.stats() == (0, 0)


@pytest.mark.timeout(60)
def test_gathered_parts_make_the_array_and_replicated_parts_count_once(servicer: WorkerServicer) -> None:
    s, store = servicer, servicer.store
    assert part(s, 11, 0) == 0 and part(s, 11, 0) == 0  # a replicated shard, sent by two members
    assert part(s, 11, 2) == X.nbytes
    np.testing.assert_array_equal(store.wait(11, timeout=1), X)
    assert s.gathering.open_ids() == []


@pytest.mark.timeout(60)
def test_a_gathered_buffer_released_or_failed_before_it_is_whole_goes(servicer: WorkerServicer) -> None:
    s, store = servicer, servicer.store
    store.expect([12, 13], owner="client:1", visible=[True, True])
    part(s, 12, 0)
    part(s, 13, 2)
    store.release([12])  # the client dropped it while its parts were coming
    assert s.gathering.sweep() == 1 and s.gathering.open_ids() == [13]
    s.deliver_peer(wpb.TransferChunk(buffer_id=13, last=True, error="p/0 f: it broke"), None)  # a member failed
    assert s.gathering.open_ids() == []
    part(s, 13, 0)  # the other member's part, after the failure notice
    assert s.gathering.open_ids() == []
    with pytest.raises(BufferFailed, match="it broke"):
        store.wait(13, timeout=1)


@pytest.mark.timeout(60)
def test_a_buffer_whose_parts_stop_coming_fails_after_the_idle_time_and_its_memory_goes(
        servicer: WorkerServicer) -> None:
    s, store = servicer, servicer.store
    s.gathering.idle_s = 0.2
    store.expect([14], owner="client:1", visible=[True])
    part(s, 14, 0)  # a member sends only some of its parts (nobody drops the run)
    assert s.gathering.sweep() == 0 and s.gathering.open_ids() == [14]  # not idle long enough yet
    time.sleep(0.3)
    assert s.gathering.sweep() == 1 and s.gathering.open_ids() == [] and s.gathering.open_bytes() == 0
    with pytest.raises(BufferFailed, match=r"no part of it came for 0.2 s, with 2 of its 4 elements"):
        store.wait(14, timeout=1)
    part(s, 14, 2)
    assert s.gathering.open_ids() == []


def stats_over_grpc(s: WorkerServicer) -> wpb.WorkerStats:
    """The servicer's Stats as an operator's tool reads them: a real gRPC call to it served on
    loopback (the Worker service's own method table, server/worker/handlers.py)."""

    async def ask() -> wpb.WorkerStats:
        server = grpc.aio.server()
        add_to_server(s, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await wgrpc.WorkerStub(ch).Stats(wpb.WorkerStatsRequest(), timeout=10)
        finally:
            await server.stop(None)

    return asyncio.run(ask())


@pytest.mark.timeout(60)
def test_the_workers_stats_count_the_unfinished_gathering_entries_and_their_bytes(servicer: WorkerServicer) -> None:
    s, store = servicer, servicer.store
    st = stats_over_grpc(s)
    assert (st.gathering, st.gathering_bytes, st.buffers) == (0, 0, 0)
    store.expect([15, 16], owner="client:1", visible=[True, True])
    part(s, 15, 0)
    part(s, 16, 2)
    big = np.arange(64, dtype=np.float64)  # an entry of another size: bytes are summed, not counted
    s.deliver_peer(wpb.TransferChunk(buffer_id=17, part_start=[0], global_shape=[128], last=True), big)
    st = stats_over_grpc(s)
    assert (st.gathering, st.gathering_bytes) == (3, 2 * X.nbytes + 128 * 8), st
    part(s, 15, 2)  # 15 is whole: stored, no longer gathered
    store.release([16])  # 16 can no longer be whole: its parts go at the next sweep
    assert s.gathering.sweep() == 1
    st = stats_over_grpc(s)
    assert (st.gathering, st.gathering_bytes) == (1, 128 * 8), st
    assert st.buffer_bytes >= X.nbytes  # 15, stored: counted as a buffer, not as gathering
