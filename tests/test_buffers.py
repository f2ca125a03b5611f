"""The worker's buffer store: reference counts, owners, tombstones, batched declarations."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from server.worker.buffer_entry import Entry
from server.worker.buffers import BufferFailed, BufferStore

pytestmark = pytest.mark.timeout(30)


def live(store: BufferStore) -> int:
    return store.stats()[0]


def test_a_task_output_lives_until_its_reader_ran_and_the_client_released_it() -> None:
    s = BufferStore()
    s.expect([1, 2], owner="client:1", visible=[True, False])  # 1 for the client, 2 an intermediate
    s.add_consumers([2, 2], owner="client:1")  # one node reads 2 twice, f(x, x)
    assert s.pending_of([1, 2, 3]) == [1, 2]
    nbytes = s.launched([1, 2], [np.zeros(4, np.float32), np.ones(2, np.float64)], input_ids=[])
    assert nbytes == 16 + 16 and live(s) == 2
    s.expect([3], owner="client:1", visible=[True])
    s.launched([3], [np.zeros(1)], input_ids=[2, 2])  # the reader launched: 2 is no longer needed
    assert live(s) == 2  # 1 and 3, held for the client
    s.release([1, 3])
    assert live(s) == 0
    with pytest.raises(BufferFailed, match="does not exist"):
        s.wait(1, timeout=1)


def test_a_release_before_the_upload_leaves_a_tombstone_that_drops_the_late_upload() -> None:
    s = BufferStore()
    s.release([7])
    assert live(s) == 0  # tombstones are not live buffers
    s.put(7, np.zeros(3), 24, owner="client:1", client_ref=True)
    assert live(s) == 0 and s.stats()[1] == 0


def test_tombstones_go_with_their_owner_and_beyond_a_bound_the_oldest_go() -> None:
    """A release of a buffer whose producer never comes (its run never reached this worker, the
    controller died) left a tombstone for the worker's life: now it is its owner's, and goes when
    the owner's buffers do; ownerless ones (or an owner that never ends) are bounded."""
    from server.worker import buffers

    s = BufferStore()
    s.release([7, 8], owner="client:1")
    s.release([9], owner="client:2")
    assert s.tombstones() == 3 and live(s) == 0
    s.release_owner("client:1")
    assert s.tombstones() == 1  # client:2's stays until client:2 ends
    s.put(9, np.zeros(3), 24, owner="client:2", client_ref=True)  # and still drops its late upload
    assert s.tombstones() == 0 and live(s) == 0
    s.release(range(100, 100 + buffers.MAX_TOMBSTONES + 50))  # no owner (an older controller)
    assert s.tombstones() == buffers.MAX_TOMBSTONES
    s.put(100 + buffers.MAX_TOMBSTONES + 49, np.zeros(1), 8, owner="client:3", client_ref=True)
    assert live(s) == 0  # the newest still drop a late upload
    s.put(100, np.zeros(1), 8, owner="client:3", client_ref=True)
    assert live(s) == 1  # the oldest was forgotten: kept, as an upload nobody released


def test_what_arrives_for_an_owner_that_ended_is_not_kept() -> None:
    """A client released a buffer before its upload arrived (a tombstone), then its session
    ended: the tombstone went with the owner, so the upload arriving after that, or a peer's
    copy for that owner, or a late enqueue of its, must not be kept for a client that is gone."""
    s = BufferStore()
    s.release([7], owner="client:1")
    s.release_owner("client:1")
    s.put(7, np.zeros(3), 24, owner="client:1", client_ref=True, same_owner=True)  # the late upload
    s.put(8, np.zeros(3), 24, owner="client:1", from_peer=True)  # a peer's copy, held for no reader
    s.keep(9, "client:1")
    s.put(9, np.zeros(3), 24, owner="client:1", from_peer=True)
    s.expect([10], "client:1", visible=[True])  # a late enqueue: its output goes once produced
    s.put(10, np.zeros(3), 24, owner="client:1")
    assert live(s) == 0 and s.tombstones() == 0
    s.put(11, np.zeros(3), 24, owner="client:2", client_ref=True, same_owner=True)
    assert live(s) == 1  # another owner's upload is kept as ever


def test_waiters_wake_when_a_declared_buffer_settles_and_failures_reach_them() -> None:
    s = BufferStore()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(s.wait(5, timeout=10, must_exist=False)))
    t.start()
    s.expect([5, 6], owner="", visible=[True, True])
    s.launched([5], [np.arange(2)], input_ids=[])
    t.join(timeout=10)
    assert got and np.array_equal(got[0], np.arange(2))  # type: ignore[arg-type]
    s.fail(6, "node 3 failed")
    with pytest.raises(BufferFailed, match="node 3 failed"):
        s.wait(6, timeout=1)


def test_release_owner_drops_every_reference_a_departed_client_held() -> None:
    s = BufferStore()
    s.expect([1, 2], owner="client:9", visible=[True, True])
    s.launched([1, 2], [np.zeros(1), np.zeros(1)], input_ids=[])
    s.expect([3], owner="client:8", visible=[True])
    s.launched([3], [np.zeros(1)], input_ids=[])
    assert s.release_owner("client:9") == 2
    assert live(s) == 1


def test_a_wait_for_many_buffers_returns_their_values_once_the_last_settles() -> None:
    s = BufferStore()
    got: list[list[object]] = []
    t = threading.Thread(target=lambda: got.append(s.wait_all([1, 2, 3], timeout=10, must_exist=False)))
    t.start()
    s.expect([1, 2], owner="", visible=[True, True])  # 3 is not even declared yet
    s.launched([2], [np.full(1, 2.0)], input_ids=[])
    s.launched([1], [np.full(1, 1.0)], input_ids=[])
    assert t.is_alive() and not got  # one still pending: no early return
    s.put(3, np.full(1, 3.0), 8, client_ref=True)
    t.join(timeout=10)
    assert [float(v[0]) for v in got[0]] == [1.0, 2.0, 3.0]  # type: ignore[index]


def test_a_timed_out_wait_leaves_no_waiter_behind_and_a_failure_reaches_a_wait_for_many() -> None:
    s = BufferStore()
    s.expect([1, 2], owner="", visible=[True, True])
    s.launched([1], [np.zeros(1)], input_ids=[])
    with pytest.raises(TimeoutError, match="buffer 2"):
        s.wait_all([1, 2], timeout=0.05)
    assert not s._waiters  # the timed-out wait unregistered itself
    errors: list[Exception] = []

    def wait() -> None:
        try:
            s.wait_all([1, 2], timeout=10)
        except BufferFailed as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    s.fail(2, "node 2 failed")
    t.join(timeout=10)
    assert [str(e) for e in errors] == ["node 2 failed"]


def test_a_refused_upload_fails_its_readers_and_is_kept_only_where_asked() -> None:
    s = BufferStore()
    # refused whole: kept for the client (a reader enqueued later sees why), freed by its release
    s.refuse(1, "client:1", "the upload of buffer 0x1 was refused: bad", held=True)
    with pytest.raises(BufferFailed, match="was refused: bad"):
        s.wait(1, timeout=1)
    s.release([1])
    with pytest.raises(BufferFailed, match="does not exist"):
        s.wait(1, timeout=1)
    # cut off with nobody waiting: nothing kept
    s.refuse(2, "client:1", "cut off", held=False)
    assert s.owner_of(2) is None
    # cut off with a reader enqueued: the reader fails, and the entry goes with the reader
    s.add_consumers([3], owner="client:1")
    s.refuse(3, "client:1", "cut off", held=False)
    with pytest.raises(BufferFailed, match="cut off"):
        s.wait(3, timeout=1)
    s.consumer_done(3)
    assert s.owner_of(3) is None
    # a tombstone (released before its upload came) whose upload is cut off is dropped
    s.release([4])
    s.refuse(4, "client:1", "cut off", held=False)
    assert s.owner_of(4) is None and live(s) == 0
    # a settled buffer, or another owner's, is left as it is
    s.put(5, np.ones(2), 16, owner="client:1", client_ref=True)
    s.refuse(5, "client:1", "late refusal", held=True)
    np.testing.assert_array_equal(s.wait(5, timeout=1), np.ones(2))
    s.expect([6], owner="client:2", visible=[True])
    s.refuse(6, "client:1", "not yours", held=True)
    assert s.pending_of([6]) == [6]


class _Finalized:
    """A stored value whose deallocation uses the store, as dropping a JAX array runs XLA's
    deallocation: done under the store's lock, it would deadlock (the lock is not reentrant)."""

    def __init__(self, store: BufferStore, seen: list[int]) -> None:
        self.store, self.seen = store, seen

    def __del__(self) -> None:
        self.seen.append(self.store.stats()[0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["release", "launched", "release_owner"])
def test_freed_values_are_deallocated_after_the_store_lock_is_released(how: str) -> None:
    s = BufferStore()
    seen: list[int] = []
    for b in (1, 2):  # two buffers freed by one call: the first is dropped while the call goes on
        s.expect([b], owner="client:1", visible=[True])
        s.add_consumers([b], owner="client:1")
        s.launched([b], [_Finalized(s, seen)], input_ids=[], sizes=[8])
        if how == "launched":
            s.release([b])  # the client let go; the reader's launch frees it
        else:
            s.consumer_done(b)  # the reader is done; the client's release frees it
    done = threading.Event()

    def free() -> None:
        if how == "release":
            s.release([1, 2])
        elif how == "launched":
            s.expect([3], owner="client:1")
            s.launched([3], [np.zeros(1)], input_ids=[1, 2])
        else:
            s.release_owner("client:1")
        done.set()

    threading.Thread(target=free, daemon=True).start()
    assert done.wait(20), f"{how}: a value's deallocation waited for the store's own lock"
    assert len(seen) == 2  # both deallocated, and each could read the store


def test_an_upload_sent_again_is_kept_only_when_the_store_neither_has_it_nor_freed_it() -> None:
    """A client sends an upload again when its stream ended before acknowledging it (worker.proto
    `again`): the worker may have stored it, and even freed it since (read, then released)."""
    s = BufferStore()
    arr = np.arange(3.0)
    # stored, read and released: the copy sent again is not a new buffer nobody would release
    s.add_consumers([1], owner="client:1")
    assert s.put(1, arr, arr.nbytes, owner="client:1", client_ref=True, same_owner=True)
    s.consumer_done(1)
    s.release([1])
    assert live(s) == 0
    assert s.put(1, arr, arr.nbytes, owner="client:1", client_ref=True, same_owner=True, again=True)
    assert live(s) == 0 and s.owner_of(1) is None
    # stored and still held: the first copy stays
    assert s.put(2, arr, arr.nbytes, owner="client:1", client_ref=True, same_owner=True)
    assert s.put(2, arr + 1, arr.nbytes, owner="client:1", client_ref=True, same_owner=True, again=True)
    np.testing.assert_array_equal(s.wait(2, timeout=1), arr)
    # donated (consumed) since: not brought back
    s.consumed([2], "donated")
    s.put(2, arr, arr.nbytes, owner="client:1", client_ref=True, same_owner=True, again=True)
    with pytest.raises(BufferFailed, match="donated"):
        s.wait(2, timeout=1)
    # never got here (lost with the stream): stored, and its reader gets it
    s.add_consumers([3], owner="client:1")
    assert s.put(3, arr, arr.nbytes, owner="client:1", client_ref=True, same_owner=True, again=True)
    np.testing.assert_array_equal(s.wait(3, timeout=1), arr)
    # a buffer that is not an upload (a node's output) freed under an id: not remembered
    s.expect([4], owner="client:1", visible=[False])
    s.launched([4], [arr], input_ids=[])
    assert s.owner_of(4) is None
    assert s.put(4, arr, arr.nbytes, owner="client:1", client_ref=True, same_owner=True, again=True)
    assert s.owner_of(4) == "client:1"


@pytest.mark.timeout(30)
def test_a_pending_buffer_whose_readers_all_ended_is_unread_until_a_new_reader_comes() -> None:
    s = BufferStore()
    told: list[int] = []
    s.on_unread = told.append
    s.add_consumers([5, 5, 6], owner="client:1")  # two readers of 5, one of 6
    s.expect([6], owner="client:1", visible=[True])  # 6 is also the client's
    s.consumer_done(5)
    assert not s.unread(5) and told == []  # the other reader still waits for it
    s.consumer_done(5)
    s.consumer_done(6)
    assert s.unread(5) and told == [5]  # (6: held for the client, not unread)
    assert not s.unread(6)
    s.add_consumers([5], owner="client:1")  # a new reader: it is read again
    assert not s.unread(5)
    s.put(5, np.zeros(2), 16)
    s.consumer_done(5)  # a reader that ran: nothing is left pending
    assert not s.unread(5) and told == [5] and live(s) == 1


def test_a_buffer_a_peer_sends_to_keep_is_the_clients_whether_it_arrives_before_or_after() -> None:
    """`keep` (worker.proto BufferKeep: a client's upload moved here from another worker): the
    buffer a peer sends is held for the client until released, whichever comes first; a reader
    does not free it; released before (a tombstone), the late copy is dropped."""
    s = BufferStore()
    s.keep(1, "client:1")  # before the copy arrives: a fetch waits for it
    s.put(1, np.zeros(4, np.float32), 16, from_peer=True)
    s.put(2, np.ones(2, np.float32), 8, from_peer=True)  # arrived first: held for a reader so far
    s.keep(2, "client:1")
    s.add_consumers([1, 2], owner="client:1")  # a run reads both, then ends
    s.consumer_done(1)
    s.consumer_done(2)
    assert live(s) == 2 and s.stats()[1] == 24 and s.wait(2, timeout=1).tolist() == [1.0, 1.0]
    s.release([1])
    assert live(s) == 1
    assert s.release_owner("client:1") == 1 and live(s) == 0  # the session's end frees it too
    s.release([3])  # dropped before its copy came
    s.keep(3, "client:1")
    s.put(3, np.zeros(2), 16, from_peer=True)
    assert live(s) == 0


class Computing:
    """A launched value whose computation the test ends (as a JAX array's `is_ready`)."""

    def __init__(self, ready: bool = False) -> None:
        self.ready = ready
        self.nbytes = 4

    def is_ready(self) -> bool:
        return self.ready


def test_a_wait_for_launched_buffers_is_called_back_when_the_executor_completes_them() -> None:
    s = BufferStore()
    s.expect([1, 2, 3], owner="client:1", visible=[True, True, True])
    a, b = Computing(), Computing(ready=True)
    s.launched([1, 2], [a, b], input_ids=[])
    s.put(3, np.zeros(1), 8)  # not a launch's output: the executor never completes it
    calls: list[int] = []
    assert s.computations.when_computed([3, 1], lambda: calls.append(0)) is False  # the caller waits on the values
    assert s.computations.when_computed([2], lambda: calls.append(1)) is True  # computed already
    latch = s.computations.when_computed([1, 2, 1], lambda: calls.append(2))
    assert not isinstance(latch, bool)
    s.computations.computed([2])  # not what it waits for
    assert calls == []
    a.ready = True
    s.computations.computed([1, 2])
    assert calls == [2]
    s.computations.computed([1])  # once
    assert calls == [2]
    s.computations.forget_computed([1, 2], latch)


def test_a_forgotten_wait_for_launched_buffers_is_never_called_back() -> None:
    s = BufferStore()
    s.expect([1], owner="client:1", visible=[True])
    s.launched([1], [Computing()], input_ids=[])
    calls: list[int] = []
    latch = s.computations.when_computed([1], lambda: calls.append(1))
    assert not isinstance(latch, bool)
    s.computations.forget_computed([1], latch)  # the caller timed out or was cancelled
    s.computations.computed([1])
    assert calls == []
    assert s.computations.when_computed([4], lambda: None) is False  # unknown: not waited for here


def test_a_buffer_never_made_fails_where_it_is_pending_and_goes_once_released() -> None:
    """The producer's run failed before it started, after a reader elsewhere had this worker send
    it on: the send (a consumer and a settle callback) would keep it pending for good."""
    s = BufferStore()
    sent: list[str] = []
    s.add_consumers([300])  # Enqueue.sends: the send reads it once
    s.on_settled(300, lambda: sent.append("settled"))
    s.never_made([300, 999], "run 0x9 that computes it failed before it started: input lost")
    assert sent == ["settled"]  # the send runs now, with the failure
    with pytest.raises(BufferFailed, match="failed before it started"):
        s.wait(300, timeout=1)
    s.consumer_done(300)  # the send is over
    s.release([300])
    assert live(s) == 0
    with pytest.raises(BufferFailed, match="does not exist"):  # an id never heard of stays unknown
        s.wait(999, timeout=0.1)


def test_a_late_peer_copy_of_a_dropped_runs_intermediate_is_not_kept() -> None:
    s = BufferStore()
    s.add_consumers([7], owner="client:1")  # the reader of a run's intermediate, on this worker
    s.fail(7, "run dropped: host h lost")  # the run was dropped: its reader failed, its input too
    s.consumer_done(7)
    s.unwanted([7])  # the Drop named it an intermediate (controller.proto Drop.unread_ids)
    assert live(s) == 0
    # the producer was frozen: it finishes the node and sends the output once it goes on
    assert s.put(7, np.ones(4, np.float32), 16, from_peer=True)
    assert live(s) == 0
    # any other peer copy is held for its reader, as before (a reader's enqueue may come after it)
    s.put(8, np.ones(4, np.float32), 16, from_peer=True)
    assert live(s) == 1
    s.add_consumers([8], owner="client:1")
    s.consumer_done(8)
    assert live(s) == 0


def test_the_activity_the_idle_trimmer_watches_changes_whenever_a_buffer_comes_settles_or_goes() -> None:
    """`activity()` (read every half second, in O(1): `stats()` reads every entry) changes for each
    kind of change the trimmer waits out, a peer's copy settling a declared buffer included (the
    entry count stays)."""
    s = BufferStore()
    seen = [s.activity()]

    def changed() -> bool:
        seen.append(s.activity())
        return seen[-1] != seen[-2]

    s.expect([1, 2], owner="client:1", visible=[True, False])
    assert changed()
    s.add_consumers([2], owner="client:1")
    s.launched([1], [np.zeros(2, np.float32)], input_ids=[])
    assert changed()
    s.put(2, np.ones(2, np.float32), 8, from_peer=True)  # settles a declared buffer: same count
    assert changed()
    s.consumer_done(2)  # its reader is over: it goes
    assert changed() and live(s) == 1
    s.release([1])
    assert changed() and live(s) == 0
    assert not changed()  # nothing happened since
    s.expect([3], owner="client:1", visible=[True])
    assert changed()
    s.fail(3, "its run failed")  # settles as failed, kept for the client: same count
    assert changed() and live(s) == 1


def test_launched_and_release_free_a_buffer_exactly_when_entry_held_says_nothing_holds_it() -> None:
    """`launched` and `_maybe_free` (which `release` calls) spell out `Entry.held` inline, so that
    the hot path pays no call per array for it: they must free a buffer exactly when it is false.
    The holders are read off `Entry.held` itself (each counter or flag of an entry that makes it
    true), so one added there and not to the inline copies fails here. White-box: the fields are
    set on the store's entries directly, for every combination of the holders."""
    holders = []
    for name in Entry.__slots__:
        e = Entry()
        value = getattr(e, name)
        if type(value) in (bool, int):
            setattr(e, name, type(value)(1))
            if e.held:
                holders.append(name)
    assert {"client_ref", "consumers", "hold"} <= set(holders), holders

    def hold(e: Entry, which: tuple[str, ...], consumers: int) -> None:
        for name in holders:
            setattr(e, name, type(getattr(e, name))(name in which))
        e.consumers += consumers  # (a launch's input: the reader that launches counts as one)

    for n in range(len(holders) + 1):
        for which in itertools.combinations(holders, n):
            s = BufferStore()
            s.expect([1], owner="c")  # a launch's output, pending
            hold(s._entries[1], which, 0)
            s.put(2, np.zeros(1), 8, owner="c", client_ref=True)  # a launch's input, ready
            hold(s._entries[2], which, 1)
            s.launched([1], [np.zeros(1)], input_ids=[2])
            for buffer_id in (1, 2):
                assert (buffer_id in s._entries) == bool(which), (buffer_id, which)
            s = BufferStore()
            s.put(3, np.zeros(1), 8, owner="c", client_ref=True)
            others = tuple(h for h in which if h != "client_ref")  # release drops the client's reference
            hold(s._entries[3], (*others, "client_ref"), 0)
            s.release([3])
            assert (3 in s._entries) == bool(others), which
