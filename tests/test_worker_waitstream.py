"""The worker's `Waits` stream (worker.proto) and the client's use of it (pwctl/waitstream.py):
the answers of the unary `Wait`, one request at a time or several in flight; what `Wait`
refuses with a status is that request's reply and the stream goes on; another session's
buffers are answered as unknown ones; the credential is checked at the stream's start; a worker
that dies or stops under a wait gives the caller what the unary call gives.

Real processes throughout: a controller and a worker (`cluster` fixtures), sessions opened on
the controller (tests/test_trust_worker.py), raw gRPC streams and the real `WorkerClient`."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from pwctl.errors import InvalidArgument, NotFound
from pwctl.worker_client import WorkerClient
from schemas.pathways.v1 import worker_pb2 as wpb
from server.worker.servicer import MAX_WAIT_IDS
from tests.conftest import LocalCluster
from tests.test_trust_worker import Session, code_of, meta, open_session, upload, worker_channels

pytestmark = [pytest.mark.timeout(120), pytest.mark.cluster(islands=1, devices=1)]

_END = object()


class RawStream:
    """A `Waits` stream as a hostile or careful caller drives it: requests in, replies by seq."""

    def __init__(self, stub: Any, md: Any) -> None:
        self.out: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.call = stub.Waits(self._requests(), metadata=md, timeout=60)
        self.replies: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _requests(self) -> Iterator[wpb.WaitRequest]:
        while (m := self.out.get()) is not _END:
            assert isinstance(m, wpb.WaitRequest)
            yield m

    def _read(self) -> None:
        try:
            for r in self.call:
                self.replies.put(r)
        except grpc.RpcError as e:
            self.replies.put(e)
        self.replies.put(None)

    def send(self, seq: int, ids: list[int], timeout_s: float = 5.0, must_exist: bool = False) -> None:
        self.out.put(wpb.WaitRequest(seq=seq, buffer_ids=ids, timeout_s=timeout_s, must_exist=must_exist))

    def reply(self, timeout: float = 20.0) -> Any:
        return self.replies.get(timeout=timeout)

    def end(self) -> None:
        self.out.put(_END)


def unary_refusal(stub: Any, md: Any, **request: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        stub.Wait(wpb.WaitRequest(**request), metadata=md, timeout=20)
    return e.value.code(), e.value.details()


def test_the_stream_answers_as_wait_refuses_per_request_and_goes_on(module_cluster: LocalCluster) -> None:
    with worker_channels(module_cluster) as (_, _, stub, cch):
        a, b = open_session(module_cluster, cch), open_session(module_cluster, cch)
        ma, mb = meta(module_cluster, a), meta(module_cluster, b)
        upload(stub, ma, a.id(1), np.arange(3.0))
        upload(stub, mb, b.id(1), np.zeros(1))
        s = RawStream(stub, ma)
        s.send(1, [a.id(1)])
        r = s.reply()
        assert (r.seq, r.ready, r.error, r.code) == (1, True, "", 0)

        # refusals: the unary Wait's status and message, as this request's reply; the stream goes on
        cases: list[dict[str, Any]] = [
            {"buffer_ids": [a.id(1), b.id(1)], "timeout_s": 1.0},  # another session's buffer
            {"buffer_ids": [b.id(1)], "timeout_s": 1.0},
            {"buffer_ids": [a.id(1)], "timeout_s": float("nan")},
            {"buffer_ids": [a.id(1)], "timeout_s": -1.0},
            {"buffer_ids": list(range(MAX_WAIT_IDS + 1)), "timeout_s": 1.0},
        ]
        for seq, case in enumerate(cases, start=10):
            s.send(seq, case["buffer_ids"], case["timeout_s"])
            r = s.reply()
            code, details = unary_refusal(stub, ma, **case)
            assert code != grpc.StatusCode.OK and (r.seq, r.ready, r.code, r.error) == (
                seq, False, code.value[0], details), case
        assert "no buffer" in unary_refusal(stub, ma, **cases[1])[1]
        # another session's buffer is answered exactly as an id of its that does not exist
        s.send(20, [b.id(999_999)], 1.0)
        s.send(21, [b.id(1)], 1.0)
        (r1, r2) = sorted((s.reply(), s.reply()), key=lambda r: r.seq)
        assert r1.error.replace(f"{b.id(999_999):#x}", "ID") == r2.error.replace(f"{b.id(1):#x}", "ID") \
            == "no buffer ID on this worker"
        assert r1.code == r2.code == grpc.StatusCode.NOT_FOUND.value[0]

        # an id not there yet: not ready after its timeout; several in flight, answered as each ends
        t0 = time.monotonic()
        s.send(30, [a.id(2)], 0.3)
        r = s.reply()
        assert (r.seq, r.ready, r.error, r.code) == (30, False, "", 0) and time.monotonic() - t0 >= 0.25
        s.send(31, [a.id(3)], 30.0)  # waits for an upload to come
        s.send(32, [a.id(1)])
        r = s.reply()
        assert (r.seq, r.ready) == (32, True), "a long wait holds up no request after it"
        upload(stub, ma, a.id(3), np.ones(2))
        r = s.reply()
        assert (r.seq, r.ready, r.code) == (31, True, 0)
        s.end()
        assert s.reply() is None, "the stream ends well when the caller ends it"
        a.close()
        b.close()


def test_the_stream_needs_the_credential_and_refuses_malformed_messages(module_cluster: LocalCluster) -> None:
    with worker_channels(module_cluster) as (_, wch, stub, cch):
        a = open_session(module_cluster, cch)
        upload(stub, meta(module_cluster, a), a.id(1), np.arange(3.0))
        for md in (meta(module_cluster), (*meta(module_cluster), ("x-pathways-session", "forged"))):
            s = RawStream(stub, md)
            s.send(1, [a.id(1)])
            e = s.reply()
            assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNAUTHENTICATED, e
        raw = wch.stream_stream("/pathways.v1.Worker/Waits")
        good = wpb.WaitRequest(seq=1, buffer_ids=[a.id(1)], timeout_s=1).SerializeToString()
        garbage = b"\xff\xff\xff\xff\x0f" + bytes(64)
        # after a request answered at once: the refusal must not meet its reply's write under way
        assert code_of(lambda: raw(iter([good, garbage]), metadata=meta(module_cluster, a), timeout=20)) \
            == grpc.StatusCode.INVALID_ARGUMENT
        a.close()


def test_an_owners_bound_on_waits_refuses_per_request_and_frees_as_they_end(module_cluster: LocalCluster) -> None:
    """One owner's waits in progress are bounded (the unary Wait's RESOURCE_EXHAUSTED): on the
    stream that is one request's reply, and the stream goes on once the waits holding it end."""
    with worker_channels(module_cluster) as (_, _, stub, cch):
        a = open_session(module_cluster, cch)
        ma = meta(module_cluster, a)
        upload(stub, ma, a.id(1), np.ones(2))
        s = RawStream(stub, ma)
        s.send(1, [a.id(100_000 + i) for i in range(MAX_WAIT_IDS)], 5.0)  # none exists: it waits, holding them all
        s.send(2, [a.id(1)], 1.0)  # read after it: one id over the owner's bound
        r = s.reply()
        code, details = unary_refusal(stub, ma, buffer_ids=[a.id(1)], timeout_s=1.0)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "too many fetches and waits" in details
        assert (r.seq, r.ready, r.code, r.error) == (2, False, code.value[0], details)
        r = s.reply(30)
        assert (r.seq, r.ready, r.error, r.code) == (1, False, "", 0), "the big wait ran out of time"
        s.send(3, [a.id(1)], 1.0)
        r = s.reply()
        assert (r.seq, r.ready, r.code) == (3, True, 0), "the stream goes on once the waits holding the bound end"
        s.end()
        a.close()


def client(cluster: LocalCluster, s: Session) -> WorkerClient:
    return WorkerClient(cluster.hosts()["w-a"].address, cluster.token, s.credential)


def test_the_client_waits_on_one_stream_with_the_unary_calls_answers(module_cluster: LocalCluster) -> None:
    with worker_channels(module_cluster) as (_, _, stub, cch):
        a, b = open_session(module_cluster, cch), open_session(module_cluster, cch)
        upload(stub, meta(module_cluster, a), a.id(1), np.arange(3.0))
        ca, cb = client(module_cluster, a), client(module_cluster, b)
        unary = client(module_cluster, a)
        unary.waits.close()  # a client whose waits are all unary calls: the reference
        try:
            for _ in range(20):
                assert ca.wait([a.id(1)], 1.0) == (True, "")
            assert ca.waits.opened == 1, "one stream served every wait"
            assert ca.wait([a.id(2)], 0.2) == unary.wait([a.id(2)], 0.2) == (False, "")
            got = ca.wait([a.id(3)], 1.0, must_exist=True)
            assert not got[0] and got == unary.wait([a.id(3)], 1.0, must_exist=True) and "does not exist" in got[1]
            with pytest.raises(NotFound) as e:
                cb.wait([a.id(1)], 1.0)  # another session's buffer
            assert str(e.value) == f"no buffer {a.id(1):#x} on this worker"
            for c in (ca, unary):  # (NaN never reaches the wire: gRPC's own deadline of NaN ends the call)
                with pytest.raises(InvalidArgument, match="invalid timeout_s -1"):
                    c.wait([a.id(1)], -1.0)
            assert ca.wait([a.id(1)], 1.0) == (True, "") and ca.waits.opened == 1

            # concurrent waits: one on the stream, the others as unary calls, all answered
            results: list[tuple[bool, str]] = []
            threads = [threading.Thread(target=lambda: results.append(ca.wait([a.id(4)], 20.0))) for _ in range(4)]
            for t in threads:
                t.start()
            time.sleep(0.3)
            upload(stub, meta(module_cluster, a), a.id(4), np.ones(1))
            for t in threads:
                t.join(30)
            assert results == [(True, "")] * 4
        finally:
            for c in (ca, cb, unary):
                c.close()
                assert c.join(10)
            a.close()
            b.close()


@pytest.mark.cluster(islands=1, devices=1)
def test_a_worker_that_stops_or_dies_under_a_wait_answers_as_the_unary_call(cluster: LocalCluster) -> None:
    with worker_channels(cluster) as (_, _, stub, cch):
        a = open_session(cluster, cch)
        upload(stub, meta(cluster, a), a.id(1), np.arange(3.0))
        c, unary = client(cluster, a), client(cluster, a)
        unary.waits.close()
        try:
            assert c.wait([a.id(1)], 1.0) == (True, "") and c.waits.opened == 1
            # stopped: no answer; the wait ends at its deadline (timeout + 5 s) as the unary call's does
            cluster.stop_worker("w-a")
            t0 = time.monotonic()
            assert c.wait([a.id(1)], 0.5) == (False, "")
            took = time.monotonic() - t0
            assert 5.4 <= took <= 8.0, took
            cluster.cont_worker("w-a")
            assert c.wait([a.id(1)], 1.0) == (True, "")  # a unary call until the stream reopens
            time.sleep(1.2)
            assert c.wait([a.id(1)], 1.0) == (True, "") and c.waits.opened == 2

            # killed under a wait: the caller gets what the unary call gets (the worker is unreachable)
            got: list[tuple[bool, str]] = []
            waiter = threading.Thread(target=lambda: got.append(c.wait([a.id(2)], 30.0)))
            waiter.start()
            time.sleep(0.5)
            cluster.kill_worker("w-a")
            waiter.join(20)
            assert not waiter.is_alive()
            expected = unary.wait([a.id(2)], 1.0)
            assert not expected[0] and "cannot reach the worker" in expected[1]
            assert got == [expected]
            assert c.wait([a.id(1)], 1.0) == expected
        finally:
            for w in (c, unary):
                w.close()
                assert w.join(10)
            a.close()
