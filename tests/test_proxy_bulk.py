"""The proxy's bulk bytes on the worker's TCP transfer port (server/bulklink.py, server/proxy/bulk.py,
server/worker/bulk_service.py), against a real worker: a connection serves the session its
credential names and nobody else, its bytes are the gRPC path's, a refused or cut-off upload
leaves nothing, and where no connection can be made the controller's side says so (gRPC then
carries the transfer). The proxy's own tests (test_proxy_download, test_proxy_stream, ...) run
their uploads and downloads of 4 MiB or more on it."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from schemas.pathways.v1 import worker_pb2 as wpb
from server import bulklink, wire
from server.proxy import bulk
from server.proxy.backend import BackendError
from server.proxy.handles import HostData
from server.worker.tcplink import HELLO
from tests.conftest import LocalCluster, wait_for
from tests.test_trust_worker import fetch, meta, open_session, upload, worker_channels, worker_log

pytestmark = [pytest.mark.timeout(120), pytest.mark.cluster(islands=1, devices=1)]


@pytest.fixture
def the_worker(module_cluster: LocalCluster) -> Iterator[Any]:
    """The module's worker: its address, channel, stub, and a channel to the controller."""
    with worker_channels(module_cluster) as w:
        yield w


def links(cluster: LocalCluster, credential: str, data_address: str) -> bulk.BulkLinks:
    async def port(address: str) -> str:
        return data_address

    return bulk.BulkLinks(bulklink.hello_secret(cluster.token or "", credential), port)


async def download(ls: bulk.BulkLinks, address: str, buffer_id: int, **span: Any) -> list[bytes]:
    request = wpb.FetchRequest(buffer_id=buffer_id, timeout_s=5, data_messages=True, **span)

    async def no_grpc() -> Any:
        raise AssertionError("the bulk connection was not made")
        yield b""

    return [m async for m in bulk.data_messages(ls, request, address, None, no_grpc)]


async def put(ls: bulk.BulkLinks, address: str, owner: str, buffer_id: int, arr: np.ndarray) -> None:
    link = await ls.take(address)
    assert link is not None, "the bulk connection was not made"
    await bulk.put_arrays(ls, link, address, None, owner, [buffer_id], [(arr.dtype.name, arr.shape,
                                                                          HostData([arr.tobytes()]))], b"")


def two_sessions(cluster: LocalCluster, cch: Any, stub: Any) -> tuple[Any, Any, str]:
    """Two proxy-like sessions of the cluster, and the worker's transfer port (`data_address`)."""
    a, b = open_session(cluster, cch), open_session(cluster, cch)
    return a, b, stub.Stats(wpb.WorkerStatsRequest(), metadata=meta(cluster, a), timeout=10).data_address


def test_a_bulk_connection_serves_its_session_only(module_cluster: LocalCluster, the_worker: Any) -> None:
    cluster = module_cluster
    address, wch, stub, cch = the_worker
    a, b, data_address = two_sessions(cluster, cch, stub)
    theirs = np.arange(5, dtype=np.float32)
    upload(stub, meta(cluster, b), b.id(1), theirs)
    big = np.random.default_rng(0).standard_normal((3 << 20) // 8 * 3, dtype=np.float64)  # 9 MiB

    async def run() -> None:
        forged = a.credential[: a.credential.rindex("|") + 1] + "0" * 64
        refused = links(cluster, forged, data_address)
        assert await refused.take(address) is None  # the worker hung up: the controller uses gRPC
        assert await refused.take(address) is None  # and does not try again at once
        ls = links(cluster, a.credential, data_address)
        await put(ls, address, a.owner, a.id(1), big)
        messages = await download(ls, address, a.id(1))
        assert [wire.data_length(m) for m in messages][:2] == [bulklink.DATA_MESSAGE] * 2
        assert all(wpb.FetchData.FromString(m).SerializeToString() == m for m in messages[:3])
        assert b"".join(bytes(wire.data_field(m)) for m in messages) == big.tobytes()
        part = await download(ls, address, a.id(1), offset=1000, length=(3 << 20) + 5)
        raw_fetch = wch.unary_stream("/pathways.v1.Worker/Fetch", request_serializer=wpb.FetchRequest.SerializeToString,
                                     response_deserializer=None)
        by_grpc = raw_fetch(wpb.FetchRequest(buffer_id=a.id(1), timeout_s=5, data_messages=True, offset=1000,
                                             length=(3 << 20) + 5), metadata=meta(cluster, a), timeout=20)
        assert part == list(by_grpc)  # the gRPC path's messages, byte for byte
        with pytest.raises(BackendError, match=f"no buffer {b.id(1):#x}"):  # another session's buffer
            await download(ls, address, b.id(1))
        with pytest.raises(BackendError, match="not one of this session's ids"):
            await put(ls, address, a.owner, b.id(1), big)
        with pytest.raises(BackendError, match="not ready after"):
            await download(ls, address, a.id(9), length=4)  # never uploaded: not ready within its wait
        again = await download(ls, address, a.id(1), length=8)  # the connection served on after refusals
        assert bytes(wire.data_field(again[0])) == big.tobytes()[:8]
        ls.close()

    asyncio.run(run())
    np.testing.assert_array_equal(fetch(stub, meta(cluster, b), b.id(1)), theirs)  # untouched
    assert "bulk connection from" in worker_log(cluster)  # the forged one, refused in one line
    assert "Traceback" not in worker_log(cluster)
    a.close()
    b.close()


def test_fetch_here_says_whether_a_whole_answer_has_arrived() -> None:
    """`bulklink.fetch_here` (a socket pair, the worker's side written by hand): True only once a
    success's reply and all its data messages are readable, and its data is at most `most`
    bytes; a refusal's once its whole reply is; the connection's end at once. What it passes is
    read without waiting."""
    mine, worker = socket.socketpair()
    try:
        data = bytes(range(256)) * 4
        answer = bulklink.reply(0, len(data)) + wire.data_message(data)
        assert not bulklink.fetch_here(mine, 1 << 20)  # nothing yet
        worker.sendall(answer[: bulklink.REPLY.size + 10])
        assert not bulklink.fetch_here(mine, 1 << 20)  # the reply, part of the message
        worker.sendall(answer[bulklink.REPLY.size + 10 :])
        assert not bulklink.fetch_here(mine, len(data) - 1)  # all here, but more data than `most`
        assert bulklink.fetch_here(mine, len(data))
        mine.setblocking(False)  # a read that would wait raises
        got, messages = bulk.Link(mine).fetched(1)
        assert got == (0, len(data), "") and [bytes(wire.data_field(m)) for m in messages] == [data]
        refusal = bulklink.reply(5, message=f"no buffer {7:#x} on this worker")
        worker.sendall(refusal[:-3])
        assert not bulklink.fetch_here(mine, 1 << 20)
        worker.sendall(refusal[-3:])
        assert bulklink.fetch_here(mine, 1 << 20)
        assert bulklink.read_reply(mine) == (5, 0, "no buffer 0x7 on this worker")
        worker.sendall(bulklink.reply(0, 0))  # an empty array's answer: its reply, no message bytes
        assert bulklink.fetch_here(mine, 0)
        assert bulk.Link(mine).fetched(1) == ((0, 0, ""), [b""])
        worker.close()
        assert bulklink.fetch_here(mine, 1 << 20)  # the end: the read returns at once
        assert bulklink.read_reply(mine) is None
    finally:
        mine.close()
        worker.close()


def test_a_small_download_is_read_on_the_event_loop(module_cluster: LocalCluster, the_worker: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A download of at most `bulk.INLINE_BYTES` (a small array's: the proxy's `get`) is read on
    the event loop once its worker's answer is readable, taking none of `bulk.POOL`'s threads:
    with that pool shut down (any use raises) a 1 KiB download, another
    session's buffer refused (its error as before) and a download that waits for its buffer all
    go through; one a byte over the limit still reads on a thread (and raises here)."""
    cluster = module_cluster
    address, _, stub, cch = the_worker
    a, b, data_address = two_sessions(cluster, cch, stub)
    small = np.arange(256, dtype=np.float32)
    upload(stub, meta(cluster, a), a.id(1), small)
    upload(stub, meta(cluster, b), b.id(1), small)
    over = np.zeros(bulk.INLINE_BYTES + 1, np.uint8)

    async def run() -> None:
        ls = links(cluster, a.credential, data_address)
        await put(ls, address, a.owner, a.id(2), over)  # and the connection made, on a pool thread
        _without_pool(monkeypatch)
        messages = await download(ls, address, a.id(1))
        assert [bytes(wire.data_field(m)) for m in messages] == [small.tobytes()]
        with pytest.raises(BackendError, match=f"no buffer {b.id(1):#x}"):
            await download(ls, address, b.id(1))
        waiting = asyncio.ensure_future(download(ls, address, a.id(3)))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await asyncio.to_thread(upload, stub, meta(cluster, a), a.id(3), small[:5])
        assert [bytes(wire.data_field(m)) for m in await waiting] == [small[:5].tobytes()]
        with pytest.raises(RuntimeError, match="shutdown"):
            await download(ls, address, a.id(2))
        ls.close()

    asyncio.run(run())
    assert "Traceback" not in worker_log(cluster)
    a.close()
    b.close()


def _without_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bulk.POOL` shut down: any use of its threads raises from now on."""
    closed = ThreadPoolExecutor(1)
    closed.shutdown()
    monkeypatch.setattr(bulk, "POOL", closed)


def test_a_small_upload_is_sent_and_answered_on_the_event_loop(module_cluster: LocalCluster, the_worker: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An upload of at most `bulk.SMALL_PUT_BYTES` (a training step's batch) is sent from the
    event loop and its reply read there, taking none of `bulk.POOL`'s threads: with that pool
    shut down (any use raises) a 1 KiB upload is stored (read back exact), another session's id
    is refused as before, and a part of a global array is answered; one a byte over the limit
    still goes on a thread (and raises here)."""
    cluster = module_cluster
    address, _, stub, cch = the_worker
    a, b, data_address = two_sessions(cluster, cch, stub)
    small = np.arange(256, dtype=np.float32)
    over = np.zeros(bulk.SMALL_PUT_BYTES + 1, np.uint8)

    async def run() -> None:
        ls = links(cluster, a.credential, data_address)
        await put(ls, address, a.owner, a.id(1), over)  # and the connection made, on a pool thread
        _without_pool(monkeypatch)
        await put(ls, address, a.owner, a.id(2), small)
        assert [bytes(wire.data_field(m)) for m in await download(ls, address, a.id(2))] == [small.tobytes()]
        with pytest.raises(BackendError, match="not one of this session's ids"):
            await put(ls, address, a.owner, b.id(2), small)
        part_of = wpb.PartOf(global_shape=[8], op_sharding=b"\x08\x03", devices=[0, 65536], group_generation=3,
                             sources=[a.id(2)]).SerializeToString()
        link = await ls.take(address)
        assert link is not None
        with pytest.raises(BackendError, match="generation 3"):  # its source is there: checked, refused
            await bulk.put_arrays(ls, link, address, None, a.owner, [a.id(3)],
                                  [("float32", (1,), HostData([bytes(4)]))], part_of)
        with pytest.raises(RuntimeError, match="shutdown"):
            await put(ls, address, a.owner, a.id(4), over)
        ls.close()

    asyncio.run(run())
    assert "Traceback" not in worker_log(cluster)
    a.close()
    b.close()


def test_an_upload_cut_off_on_its_connection_leaves_nothing(module_cluster: LocalCluster, the_worker: Any) -> None:
    """A connection closed mid-upload (the controller's staging discarded, or the controller gone)
    is a cancelled `PutBuffers`: a reader already waiting fails with why, at once, and a bulk
    download after (the buffer settled, read on the connection's thread) with the same cause;
    nothing is kept; the id stays free."""
    cluster = module_cluster
    address, _, stub, cch = the_worker
    a = open_session(cluster, cch)
    md = meta(cluster, a)
    data_address = stub.Stats(wpb.WorkerStatsRequest(), metadata=md, timeout=10).data_address
    before = stub.Stats(wpb.WorkerStatsRequest(), metadata=md, timeout=10).buffers
    host, _, port = data_address.rpartition(":")
    secret = bulklink.hello_secret(cluster.token or "", a.credential)
    for n, (dtype, shape, why) in enumerate((("float32", (2 << 20,), "cut off before its last byte"),
                                             ("", (), "cut off before its last byte"))):
        buffer_id = a.id(7 + n)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(lambda b=buffer_id: list(stub.Fetch(wpb.FetchRequest(buffer_id=b, timeout_s=30),
                                                                      metadata=md, timeout=40)))
            time.sleep(0.5)  # the reader waits for the buffer
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(HELLO.pack(bulklink.SESSION_MAGIC, len(secret)) + secret)
                assert bulklink.read_reply(sock) == (0, 0, "")
                header = wire.put_buffer_request(buffer_id, a.owner, dtype, shape, [], 0, 8 << 20)
                sock.sendall(bulklink.request(bulklink.PUT, header) + bytes(1 << 20))  # 1 of its 8 MiB
            started = time.monotonic()
            chunks = waiting.result(timeout=20)
        assert time.monotonic() - started < 10 and why in chunks[0].error, chunks[0].error

    async def failed() -> None:
        ls = links(cluster, a.credential, data_address)
        for buffer_id in (a.id(7), a.id(8)):
            with pytest.raises(BackendError, match="cut off before its last byte") as e:
                await download(ls, address, buffer_id)
            assert e.value.code == "FAILED_PRECONDITION"
        ls.close()

    asyncio.run(failed())
    staged = wire.put_buffer_request(a.id(9), a.owner, "", (), [], 0, 1 << 20)
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # all its bytes, no spec: dropped
        sock.sendall(HELLO.pack(bulklink.SESSION_MAGIC, len(secret)) + secret)
        assert bulklink.read_reply(sock) == (0, 0, "")
        sock.sendall(bulklink.request(bulklink.PUT, staged) + bytes(1 << 20))
    time.sleep(0.5)
    assert stub.Stats(wpb.WorkerStatsRequest(), metadata=md, timeout=10).buffers == before + 2  # the two failed
    a.release(cluster.hosts()["w-a"].address, a.id(7), a.id(8))
    wait_for(lambda: stub.Stats(wpb.WorkerStatsRequest(), metadata=md, timeout=10).buffers == before, 10,
             "the failed uploads released")
    mine = np.arange(3.0)
    upload(stub, md, a.id(9), mine)  # the dropped staged upload's id is free
    np.testing.assert_array_equal(fetch(stub, md, a.id(9)), mine)
    assert "Traceback" not in worker_log(cluster)
    a.close()


def waiting_beside(cluster: LocalCluster, the_worker: Any,
                   waiter: Callable[[bulk.BulkLinks, Any, int], Awaitable[Any]],
                   meanwhile: Callable[[bulk.BulkLinks, Any, int], Awaitable[None]],
                   comes: Callable[[Any, Any, Any, int], None], first: Callable[[bulk.BulkLinks, Any],
                                                                      Awaitable[None]] | None = None) -> list[Any]:
    """`waiter(links, session, k)` for k < MAX_LINKS on each of more sessions than the controller
    has bulk threads' worth (`bulk.POOL`), each on its own connection, all waiting on the worker;
    while they wait, another session b's `meanwhile(links, b, waiters)` (`first(links, b)` before
    they start); then `comes(stub, session, k, n)` (on a thread) gives the n-th what it waits
    for: their answers, in order."""
    _, _, stub, cch = the_worker
    waiting = [open_session(cluster, cch) for _ in range(bulk.POOL_THREADS // bulk.MAX_LINKS + 1)]
    b = open_session(cluster, cch)
    data_address = stub.Stats(wpb.WorkerStatsRequest(), metadata=meta(cluster, b), timeout=10).data_address
    slots = [(i, s, k) for i, s in enumerate(waiting) for k in range(bulk.MAX_LINKS)]

    async def run() -> list[Any]:
        theirs = links(cluster, b.credential, data_address)
        if first is not None:
            await first(theirs, b)
        sets = [links(cluster, s.credential, data_address) for s in waiting]
        pending = [asyncio.ensure_future(waiter(sets[i], s, k)) for i, s, k in slots]
        await asyncio.sleep(1.5)  # each asked its worker, which waits
        assert not any(p.done() for p in pending), [p.exception() for p in pending if p.done()][:1]
        await meanwhile(theirs, b, len(pending))
        assert not any(p.done() for p in pending)  # still waiting
        for n, (_, s, k) in enumerate(slots):
            await asyncio.to_thread(comes, stub, s, k, n)
        answers = await asyncio.wait_for(asyncio.gather(*pending), 30)
        for ls in [*sets, theirs]:
            ls.close()
        return answers

    answers = asyncio.run(run())
    assert "Traceback" not in worker_log(cluster)
    for s in [*waiting, b]:
        s.close()
    return answers


def test_downloads_waiting_for_their_buffers_hold_no_thread(module_cluster: LocalCluster, the_worker: Any) -> None:
    """The controller's bulk threads (`bulk.POOL`) are shared by every session: more downloads
    than it has threads, each on its own connection (several sessions' worth), wait for buffers
    nobody has uploaded yet; another session's upload and download on the same worker still go
    through at once (a waiting download held a thread until its buffer was ready: this one
    waited for theirs to time out), and the waiting ones then get their bytes once their buffers
    come."""
    cluster = module_cluster
    address = the_worker[0]
    big = np.random.default_rng(1).standard_normal((9 << 20) // 8)  # 9 MiB

    def value(n: int) -> np.ndarray:
        return np.full(1024, n, dtype=np.int32)

    async def later(ls: bulk.BulkLinks, s: Any, k: int) -> bytes:
        request = wpb.FetchRequest(buffer_id=s.id(100 + k), timeout_s=45, data_messages=True)

        async def no_grpc() -> Any:
            raise AssertionError("the bulk connection was not made")
            yield b""

        messages = [m async for m in bulk.data_messages(ls, request, address, None, no_grpc)]
        return b"".join(bytes(wire.data_field(m)) for m in messages)

    async def meanwhile(theirs: bulk.BulkLinks, b: Any, pending: int) -> None:
        started = time.monotonic()
        try:
            await asyncio.wait_for(put(theirs, address, b.owner, b.id(1), big), 15)
            messages = await asyncio.wait_for(download(theirs, address, b.id(1)), 15)
        except TimeoutError:
            raise AssertionError(f"another session's transfer waited {time.monotonic() - started:.0f} s behind "
                                 f"{pending} downloads of buffers not ready") from None
        took = time.monotonic() - started
        print(f"another session's 9 MiB upload and download beside {pending} waiting downloads: {took:.2f} s")
        assert b"".join(bytes(wire.data_field(m)) for m in messages) == big.tobytes()
        assert took < 10

    def comes(stub: Any, s: Any, k: int, n: int) -> None:  # their buffers: each waiting download gets its own
        upload(stub, meta(cluster, s), s.id(100 + k), value(n))

    got = waiting_beside(cluster, the_worker, later, meanwhile, comes)
    assert got == [value(n).tobytes() for n in range(len(got))]


def test_uploaded_parts_waiting_for_their_sources_hold_no_thread(module_cluster: LocalCluster,
                                                                  the_worker: Any) -> None:
    """A part of a global array uploaded on a bulk connection (`part_of` naming its sources)
    waits on the worker until its sources are there: more such uploads than the controller has
    bulk threads hold none of them, another session's download goes through meanwhile, and each
    part is answered once its source came (here refused, naming why: this worker is in no island
    group, which it checks once it has the sources)."""
    cluster = module_cluster
    address = the_worker[0]
    big = np.random.default_rng(2).standard_normal((5 << 20) // 8)

    async def first(theirs: bulk.BulkLinks, b: Any) -> None:
        await put(theirs, address, b.owner, b.id(1), big)

    async def part(ls: bulk.BulkLinks, s: Any, k: int) -> str:
        part_of = wpb.PartOf(global_shape=[8], op_sharding=b"\x08\x03", devices=[0, 65536], group_generation=3,
                             sources=[s.id(300 + k)]).SerializeToString()
        link = await ls.take(address)
        assert link is not None, "the bulk connection was not made"
        with pytest.raises(BackendError) as refused:
            await bulk.put_arrays(ls, link, address, None, s.owner, [s.id(200 + k)],
                                  [("float32", (1,), HostData([bytes(4)]))], part_of)
        return str(refused.value)

    async def meanwhile(theirs: bulk.BulkLinks, b: Any, pending: int) -> None:
        try:
            messages = await asyncio.wait_for(download(theirs, address, b.id(1)), 15)
        except TimeoutError:
            raise AssertionError(f"another session's download waited behind {pending} uploaded parts "
                                 "waiting for their sources") from None
        assert b"".join(bytes(wire.data_field(m)) for m in messages) == big.tobytes()

    def comes(stub: Any, s: Any, k: int, n: int) -> None:  # the sources: each part is answered
        upload(stub, meta(cluster, s), s.id(300 + k), np.arange(4, dtype=np.float32))

    answers = waiting_beside(cluster, the_worker, part, meanwhile, comes, first)
    assert all("generation 3" in a for a in answers), answers[0]
