"""A proxy session's bulk connection to a worker (server/bulklink.py, server/worker/bulk_service.py)
whose client stops in the middle of a request, against a real worker whose DEAD_PEER_S is 2 s:
the worker drops the connection, and the thread serving it, within DEAD_PEER_S of the stall (a
request's head: of its first byte), an upload stalled mid-bytes fails its buffer's readers with
why, and the worker serves other connections meanwhile and after. A connection idle between
requests, for longer than DEAD_PEER_S, is kept and still serves (a session may idle for hours)."""

from __future__ import annotations

import asyncio
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from schemas.pathways.v1 import worker_pb2 as wpb
from server import bulklink, wire
from server.worker.tcplink import HELLO
from tests.conftest import LocalCluster, wait_for
from tests.test_proxy_bulk import download, links, put
from tests.test_trust_worker import meta, open_session, worker_channels, worker_log

DEAD_S = 2.0
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.cluster(islands=1, devices=1, worker_env={"PATHWAYS_TCP_DEAD_PEER_S": f"{DEAD_S:g}"})]


def serving_threads(pid: int) -> int:
    """The worker's threads serving transfer connections ("pw-tcp-recv", tcplink.py)."""
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return names.count("pw-tcp-recv")


def closed_by_peer(sock: socket.socket, within: float) -> float | None:
    """Seconds until the worker closed `sock` (an end or a reset), None when it did not within `within`."""
    started = time.monotonic()
    sock.settimeout(within)
    try:
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


# what a stalled client sent after its hello: a request's prefix in part, a prefix and part of its
# header, an upload's head and part of its bytes, a staged upload's bytes and part of its spec
STALLS = ["half a prefix", "half a header", "half an upload", "half a spec"]


@pytest.mark.parametrize("stall", STALLS)
def test_a_request_stalled_midway_ends_its_connection_not_the_worker(module_cluster: LocalCluster, stall: str) -> None:
    cluster = module_cluster
    with worker_channels(cluster) as (address, _, stub, cch):
        s = open_session(cluster, cch)
        md = meta(cluster, s)
        data_address = stub.Stats(wpb.WorkerStatsRequest(), metadata=md, timeout=10).data_address
        host, _, port = data_address.rpartition(":")
        secret = bulklink.hello_secret(cluster.token or "", s.credential)
        pid = cluster.workers["w-a"].pid
        before = serving_threads(pid)
        buffer_id = s.id(7)
        header = wire.put_buffer_request(buffer_id, s.owner, "float32", (2 << 20,), [], 0, 8 << 20)
        request = bulklink.request(bulklink.PUT, header)
        staged = bulklink.request(bulklink.PUT, wire.put_buffer_request(buffer_id, s.owner, "", (), [], 0, 8))
        spec = bulklink.request(bulklink.SPEC, wire.put_buffer_request(buffer_id, s.owner, "float32", (2,), [], 8, 8))
        sent = {"half a prefix": request[:4], "half a header": request[:bulklink.REQUEST.size + 3],
                "half an upload": request + bytes(1 << 20), "half a spec": staged + bytes(8) + spec[:10]}[stall]
        why = {"half an upload": f"cut off before its last byte: no bytes for {DEAD_S:g} s",
               "half a spec": "ended without its dtype and shape: timed out: a request's head not whole"}.get(stall)
        with ThreadPoolExecutor(1) as pool, socket.create_connection((host, int(port)), timeout=10) as sock:
            waiting = pool.submit(lambda: list(stub.Fetch(wpb.FetchRequest(buffer_id=buffer_id, timeout_s=30),
                                                          metadata=md, timeout=40))) \
                if why is not None else None
            sock.sendall(HELLO.pack(bulklink.SESSION_MAGIC, len(secret)) + secret)
            assert bulklink.read_reply(sock) == (0, 0, "")
            sock.sendall(sent)
            stalled = time.monotonic()
            wait_for(lambda: serving_threads(pid) == before + 1, 10, "the connection's serving thread")

            async def others() -> None:  # the worker serves another connection of the session meanwhile
                ls = links(cluster, s.credential, data_address)
                mine = np.arange(4.0)
                await put(ls, address, s.owner, s.id(8), mine)
                got = await download(ls, address, s.id(8))
                assert b"".join(bytes(wire.data_field(m)) for m in got) == mine.tobytes()
                ls.close()

            asyncio.run(others())
            took = closed_by_peer(sock, within=4 * DEAD_S)
            assert took is not None, f"the worker still holds the connection {4 * DEAD_S:g} s after the stall"
            assert time.monotonic() - stalled < 3 * DEAD_S
            wait_for(lambda: serving_threads(pid) == before, 10, "the stalled connection's thread to end")
            if waiting is not None:  # the upload's reader fails with why, as an upload cut off
                chunks = waiting.result(timeout=20)
                assert why in chunks[0].error, chunks[0].error
                s.release(address, buffer_id)
        log = worker_log(cluster)
        assert "Traceback" not in log, log[-3000:]
        s.release(address, s.id(8))
        s.close()


def test_a_connection_idle_between_requests_is_kept(module_cluster: LocalCluster) -> None:
    cluster = module_cluster
    with worker_channels(cluster) as (address, _, stub, cch):
        s = open_session(cluster, cch)
        md = meta(cluster, s)
        data_address = stub.Stats(wpb.WorkerStatsRequest(), metadata=md, timeout=10).data_address
        mine = np.arange(5.0)
        logged = len(worker_log(cluster))

        async def idle_then_used() -> None:
            ls = links(cluster, s.credential, data_address)
            await put(ls, address, s.owner, s.id(9), mine)
            await asyncio.sleep(2.5 * DEAD_S)  # idle, past the worker's DEAD_PEER_S
            link = await ls.take(address)  # the same connection, still open
            assert link is not None and link.idle_and_open()
            ls.give(address, link)
            got = b"".join(bytes(wire.data_field(m)) for m in await download(ls, address, s.id(9)))
            assert got == mine.tobytes()
            ls.close()

        asyncio.run(idle_then_used())
        s.release(address, s.id(9))
        log = worker_log(cluster)[logged:]
        assert "Traceback" not in log and "ended" not in log, log
        s.close()
