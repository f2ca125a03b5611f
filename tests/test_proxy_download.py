"""Arrays read back through the IFRT proxy stream from their workers to the client
(server/proxy/downloads.py), on a real local cluster: the controller never holds a downloaded
array (its RSS, read from /proc, stays flat during a 256 MiB download), a client that stops
reading holds the worker back rather than filling the controller, a client that goes away
mid-download frees everything and the cluster goes on, and arrays made of shards from several
buffers arrive exactly, in order."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import LocalCluster, wait_for
from grpc import aio
from test_proxy_cluster import matches_local, run_program, worker_buffers
from test_proxy_protocol import P
from test_proxy_sharded import proxy_env
from test_proxy_stream import BASE, MIB, Raw, Sampler, controller_growth, raw_session, rss, ser, until

from server.proxy.arrays import Buf, Part, new_record
from server.proxy.downloads import byte_range, plan
from server.proxy.shardings import Index, Sharding
from server.worker.transfer import DATA_CHUNK

# the cluster of the tests without their own (`module_cluster`: one island of 4 devices, for the
# sharded downloads; the raw sessions take a fresh slice of one); those that measure the
# controller's RSS have their own, whose heap no earlier download has grown
pytestmark = pytest.mark.cluster(islands=1, devices=4, heartbeat_timeout=15.0)

DOWNLOAD = """
import numpy as np, jax, jax.numpy as jnp
n = NBYTES // 4
x = jax.jit(lambda: jnp.arange(n, dtype=jnp.int32) * 3 + 1)()
x.block_until_ready()
back = np.asarray(x)
print("downloaded", back.nbytes, bool((back == np.arange(n, dtype=np.int32) * 3 + 1).all()))
"""


@pytest.mark.timeout(240)
@pytest.mark.cluster(islands=1, devices=1)
def test_the_controller_does_not_hold_a_downloaded_array(cluster: LocalCluster, tmp_path: Path) -> None:
    env = proxy_env(cluster, tmp_path, PATHWAYS_DEVICES="1")

    def download(nbytes: int) -> None:
        assert run_program(DOWNLOAD.replace("NBYTES", str(nbytes)), env) == [f"downloaded {nbytes} True"]

    grown = controller_growth(cluster, download)  # holding the array (before downloads.py): 256 MiB or more
    print(f"controller RSS growth during a 256 MiB download: {grown / MIB:.0f} MiB")
    assert grown < 128 * MIB, f"the controller's RSS grew by {grown / MIB:.0f} MiB during a 256 MiB download"
    wait_for(lambda: worker_buffers(cluster) == 0, 30, "the program's buffers to be freed")


async def _lookup_call(s: Raw, handle: int) -> aio.UnaryStreamCall:
    lookup = s.channel.unary_stream(BASE + "HostBufferLookup", ser, P.GrpcHostBufferLookupResponse.FromString)
    return lookup(P.GrpcHostBufferLookupRequest(session_id=s.sid, handle=handle))


class Gone(Exception):
    """A client that leaves without a goodbye."""


async def _copy_to_host(s: Raw, array_handle: int, host_handle: int) -> None:
    def fill(req: Any) -> None:
        r = req.copy_to_host_buffer_request
        r.array_handle, r.host_buffer_handle = array_handle, host_handle

    resp = await s.ask(fill)
    assert resp.response_metadata.status.code == 0, resp.response_metadata.status.message


@pytest.mark.timeout(240)
@pytest.mark.cluster(islands=1, devices=1)
def test_a_slow_or_vanishing_reader_holds_nothing_in_the_controller(cluster: LocalCluster) -> None:
    assert cluster.controller is not None
    pid = cluster.controller.pid
    size = 256 * MIB
    data = np.random.default_rng(0).bytes(size)

    async def stalled(s: Raw, host_handle: int) -> aio.UnaryStreamCall:
        """A lookup that read two messages and then stops reading; the controller's RSS meanwhile."""
        with Sampler(pid) as sampler:
            await _copy_to_host(s, 20, host_handle)
            call = await _lookup_call(s, host_handle)
            first = [(await call.read()).data for _ in range(2)]
            assert b"".join(first) == data[: 2 * DATA_CHUNK]
            await asyncio.sleep(2.0)  # the worker would have sent all 256 MiB by now, unchecked
        grown = sampler.grown
        print(f"controller RSS growth behind a stalled reader: {grown / MIB:.0f} MiB")
        assert grown < 128 * MIB, f"the controller's RSS grew by {grown / MIB:.0f} MiB behind a stalled reader"
        return call

    async def main() -> None:
        async with raw_session(cluster) as s:
            await s.store(10, data)
            resp = await s.make(10, 20, (size // 4,))
            assert resp.response_metadata.status.code == 0, resp.response_metadata.status.message
            # a reader that stops, then cancels its lookup: the session goes on, exactly
            call = await stalled(s, 30)
            call.cancel()
            await s.delete(30)
            assert await s.read_back(20, 31) == data  # the whole array, again, from the worker
            await s.delete(31)
            assert worker_buffers(cluster) == 1
        await until(lambda: worker_buffers(cluster) == 0, "the session's buffers to be freed")

        # a client that goes away mid-download (its channel closes): its session ends, and
        # everything it held on the worker is freed
        base = rss(pid)
        with pytest.raises(Gone):
            async with raw_session(cluster) as s:
                await s.store(10, data)
                assert (await s.make(10, 20, (size // 4,))).response_metadata.status.code == 0
                await stalled(s, 30)
                await s.channel.close()
                raise Gone  # out of raw_session without its orderly goodbye
        await until(lambda: worker_buffers(cluster) == 0, "the vanished client's buffers to be freed")
        await until(lambda: rss(pid) < base + 64 * MIB, "the controller to hold nothing of the download")

        # the cluster goes on: a new session uploads and downloads
        async with raw_session(cluster) as s:
            small = data[: 16 * MIB]
            await s.store(10, small)
            assert (await s.make(10, 20, (len(small) // 4,))).response_metadata.status.code == 0
            assert await s.read_back(20, 30) == small
            await s.delete(30)
        await until(lambda: worker_buffers(cluster) == 0, "the last session's buffers to be freed")

    asyncio.run(main())


SHARDS = """
import hashlib
import numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
devs = jax.devices()
line = Mesh(np.array(devs), ("d",))
grid = Mesh(np.array(devs).reshape(2, 2), ("x", "y"))
a = (np.arange(2048 * 2048, dtype=np.float32) % 65521).reshape(2048, 2048)  # 16 MiB, shards of 4 MiB
def show(name, x):
    back = np.asarray(x)
    print(name, back.shape, hashlib.sha256(back.tobytes()).hexdigest()[:16])
for name, spec, mesh in (("rows", P("d"), line), ("cols", P(None, "d"), line), ("grid", P("x", "y"), grid)):
    s = NamedSharding(mesh, spec)
    idx = s.addressable_devices_indices_map(a.shape)
    # made of four buffers, one per device
    show(name + " assembled", jax.make_array_from_single_device_arrays(
        a.shape, s, [jax.device_put(a[idx[d]], d) for d in s.addressable_devices]))
    # one buffer, and each of its shards read alone (a range of it, or not)
    y = jax.jit(lambda v: v * 2 + 1, out_shardings=s)(a)
    show(name + " computed", y)
    for shard in y.addressable_shards:
        show(name + " shard", shard.data)
"""


@pytest.mark.timeout(300)
def test_sharded_downloads_arrive_exactly(module_cluster: LocalCluster, tmp_path: Path) -> None:
    cluster = module_cluster
    local = matches_local(cluster, tmp_path, SHARDS, 4)
    assert len(local) == 3 * 6
    wait_for(lambda: worker_buffers(cluster) == 0, 30, "the program's buffers to be freed")


@pytest.mark.timeout(120)
def test_a_lookup_of_an_unknown_or_deleted_download_is_refused(module_cluster: LocalCluster) -> None:
    cluster = module_cluster  # left as found: its sessions end, their buffers freed
    size = 8 * MIB
    data = np.random.default_rng(1).bytes(size)

    async def main() -> None:
        async with raw_session(cluster) as s:
            await s.store(10, data)
            assert (await s.make(10, 20, (size // 4,))).response_metadata.status.code == 0
            await _copy_to_host(s, 20, 30)
            await s.delete(30)
            with pytest.raises(aio.AioRpcError) as e:
                [r async for r in await _lookup_call(s, 30)]
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert e.value.details() == "host buffer 30 not found"
            assert await s.read_back(20, 31) == data  # the session goes on
            await s.delete(31)
        await until(lambda: worker_buffers(cluster) == 0, "the session's buffers to be freed")

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_download_is_forwarded_as_lookup_messages_and_only_to_its_session(module_cluster: LocalCluster) -> None:
    cluster = module_cluster  # left as found: its sessions end, their buffers freed
    """The worker's messages go to the client as they came (FetchRequest.data_messages): each
    one is a GrpcHostBufferLookupResponse and nothing more, of at most DATA_CHUNK, and together they
    are the array's bytes in order; another session, or a made-up session id, reads nothing."""
    size = 6 * MIB + 12  # streamed (>= 4 MiB); not a multiple of the message size
    data = np.random.default_rng(2).bytes(size)

    async def main() -> None:
        async with raw_session(cluster) as s, raw_session(cluster) as other:
            await s.store(10, data)
            assert (await s.make(10, 20, (size // 4,))).response_metadata.status.code == 0
            await _copy_to_host(s, 20, 30)
            raw = s.channel.unary_stream(BASE + "HostBufferLookup", ser, None)
            for sid in (other.sid, other.sid ^ s.sid ^ 1):  # its own session's handle 30, or no session
                with pytest.raises(aio.AioRpcError) as e:
                    [m async for m in raw(P.GrpcHostBufferLookupRequest(session_id=sid, handle=30))]
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
            messages = [m async for m in raw(P.GrpcHostBufferLookupRequest(session_id=s.sid, handle=30))]
            parsed = [P.GrpcHostBufferLookupResponse.FromString(m) for m in messages]
            assert all(p.SerializeToString() == m for p, m in zip(parsed, messages, strict=True))
            assert [len(p.data) for p in parsed] == [DATA_CHUNK] * (size // DATA_CHUNK) + [12]
            assert b"".join(p.data for p in parsed) == data
            await s.delete(30)
            assert await s.read_back(20, 31) == data  # once more, whole, through the session
            await s.delete(31)
        await until(lambda: worker_buffers(cluster) == 0, "the session's buffers to be freed")

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_small_copy_is_answered_before_its_bytes_come_and_the_lookup_waits(module_cluster: LocalCluster) -> None:
    """CopyToHostBuffer of an array under 4 MiB is answered once its fetch has begun, not once its
    bytes came (downloads.Fetching): here its worker is frozen meanwhile, and the answer comes at
    once all the same; the lookup waits for the bytes, which come once the worker goes on. The
    array's buffer stays held until they came, although the array is destroyed at once."""
    cluster = module_cluster  # left as found: its session ends, its buffers freed
    (name,) = cluster.workers
    data = np.arange(256, dtype=np.float32).tobytes()  # 1 KiB

    async def main() -> None:
        async with raw_session(cluster) as s:
            await s.store(10, data)
            assert (await s.make(10, 20, (256,))).response_metadata.status.code == 0
            assert await s.read_back(20, 21) == data  # on its worker, the session's connection open
            await s.delete(21)
            cluster.stop_worker(name)
            try:
                started = time.monotonic()
                copied = asyncio.ensure_future(_copy_to_host(s, 20, 30))
                await asyncio.wait_for(asyncio.shield(copied), 5)  # before: only once the worker went on
                answered = time.monotonic() - started

                def destroy(req: Any) -> None:
                    req.destruct_array_request.array_handle.append(20)

                assert (await s.ask(destroy)).response_metadata.status.code == 0
                lookup = asyncio.ensure_future(_collect(await _lookup_call(s, 30)))
                await asyncio.sleep(1.0)
                assert not lookup.done()  # the bytes are not here yet
            finally:
                cluster.cont_worker(name)
            assert await asyncio.wait_for(lookup, 30) == data
            assert answered < 1.0, answered
            await s.delete(30)
        await until(lambda: worker_buffers(cluster) == 0, "the session's buffers to be freed")

    asyncio.run(main())


async def _collect(call: aio.UnaryStreamCall) -> bytes:
    return b"".join([r.data async for r in call])


def _rec(shape: tuple[int, ...], domains: Sequence[Index], parts: Sequence[tuple[Buf, Index]]) -> Any:
    sharding = Sharding(tuple(range(len(domains))), explicit=tuple(domains))
    return new_record("float32", shape, sharding, [Part(b, i) for b, i in parts])


@pytest.mark.timeout(30)
def test_a_download_plan_is_byte_ranges_in_order_or_nothing() -> None:
    assert byte_range((slice(2, 4), slice(0, 8)), (4, 8), 4) == (64, 128)  # whole rows
    assert byte_range((slice(1, 2), slice(2, 6)), (4, 8), 4) == (40, 56)  # part of one row
    assert byte_range((slice(0, 4), slice(0, 4)), (4, 8), 4) is None  # a column block
    assert byte_range((slice(0, 1), slice(0, 1), slice(3, 5)), (2, 3, 5), 2) == (6, 10)
    assert byte_range((), (), 4) == (0, 4)  # a scalar
    rows = [(slice(2 * k, 2 * k + 2), slice(0, 8)) for k in range(4)]
    bufs = [Buf(100 + k, "float32", (2, 8)) for k in range(4)]
    whole = (slice(0, 2), slice(0, 8))
    # shards of four buffers, listed in reverse: streamed in the array's order, each buffer whole
    rec = _rec((8, 8), rows[::-1], [(b, whole) for b in bufs[::-1]])
    assert [(b.id, lo, hi) for b, lo, hi in plan(rec) or []] == [(100 + k, 0, 64) for k in range(4)]
    # one buffer's rows as shards: its own ranges merge back into one read
    big = Buf(7, "float32", (8, 8))
    assert [(b.id, lo, hi) for b, lo, hi in plan(_rec((8, 8), rows, [(big, r) for r in rows])) or []] == [(7, 0, 256)]
    # a shard that is the middle of a larger buffer
    assert [(b.id, lo, hi) for b, lo, hi in plan(_rec((2, 8), [whole], [(big, rows[1])])) or []] == [(7, 64, 128)]
    # replicas: read once
    everything = (slice(0, 8), slice(0, 8))
    replicated = _rec((8, 8), [everything] * 2, [(big, everything)] * 2)
    assert [(b.id, lo, hi) for b, lo, hi in plan(replicated) or []] == [(7, 0, 256)]
    # columns: not ranges of the array
    cols = [(slice(0, 8), slice(4 * k, 4 * k + 4)) for k in range(2)]
    assert plan(_rec((8, 8), cols, [(big, c) for c in cols])) is None
    # a missing shard is not a tiling
    assert plan(_rec((8, 8), rows[:3], [(big, r) for r in rows[:3]])) is None
