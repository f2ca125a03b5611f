"""An unmodified JAX program with a thousand sharded `device_put`s in flight and no block between
them, through the proxy on a real cluster (issue 28). Each shard is one HostBufferStore call, all
made at once by the jaxlib client; gRPC core cancelled those beyond its queue of calls the server
had not yet accepted (~1,000), silently, and the client then ended its session ("IFRT proxy server
disconnected: CANCELLED"). The controller now bounds the calls a connection carries at once
(server/controller/app.py), so the client waits instead: the program prints what it prints on 4
local CPU devices. And the session ends when the client exits (its close was cut short by a
second cancellation of its reader, so that most sessions of exited clients stayed open), with a
log line saying how it ended, also for a client that cancels its stream with a request waiting."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LocalCluster, wait_for
from proxy_env import plain_lines, proxy_env, start_plain
from test_proxy_cluster import matches_local
from test_proxy_protocol import P
from test_proxy_stream import BASE, raw_session, ser

from server.proxy import protocol as proto_mod
from server.proxy import service
from server.proxy import shardings as sh

pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster(islands=1, devices=4)]

PUTS = 1000  # x 4 shards: 4,000 HostBufferStore calls in flight, 4 times gRPC core's default queue

PROGRAM = f"""
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
mesh = Mesh(np.array(jax.devices()), ("x",))
xs = [jax.device_put(np.full((256, 256), i, np.float32), NamedSharding(mesh, P("x"))) for i in range({PUTS})]
total = jax.jit(lambda chunk: jnp.stack([x.sum() for x in chunk]))  # one compile: 10 calls, not 1,000
sums = np.concatenate([np.asarray(total(xs[k:k + 100])) for k in range(0, {PUTS}, 100)])
print("puts", len(xs), xs[-1].sharding.spec, float(sums.sum()), sums[[0, 1, -1]].tolist())
"""


def test_a_thousand_sharded_puts_in_flight_all_arrive(cluster: LocalCluster, tmp_path: Path) -> None:
    lines = matches_local(cluster, tmp_path, PROGRAM, 4)
    assert lines == [f"puts {PUTS} P('x',) {256 * 256 * PUTS * (PUTS - 1) / 2} [0.0, 65536.0, "
                     f"{256 * 256 * (PUTS - 1):.1f}]"]
    # the session's end is in the controller's log with how it ended: the client, exiting, ends
    # its stream, with nothing unanswered
    ends = wait_for(lambda: re.findall(r"proxy: session \w+ closed: (.*)", cluster.controller_logs()), 30,
                    "the proxy session's end in the controller's log")
    assert ends in ([service.ENDED], [service.CANCELLED]), ends


def test_a_session_cancelled_with_a_request_waiting_says_so_in_the_log(cluster: LocalCluster) -> None:
    async def main() -> None:
        async with raw_session(cluster) as s:
            held = asyncio.Event()

            async def part() -> AsyncIterator[Any]:  # half of host buffer 7's bytes, the rest never
                yield P.GrpcHostBufferStoreRequest(data=bytes(8))
                await held.wait()

            store = s.channel.stream_unary(BASE + "HostBufferStore", ser, P.GrpcHostBufferStoreResponse.FromString)
            meta = P.GrpcHostBufferStoreMetadata(session_id=s.sid, handle=7, buffer_size=16)
            storing = store(part(), metadata=[(proto_mod.HOST_BUFFER_METADATA_HEADER, meta.SerializeToString())])
            req = P.IfrtRequest()
            req.request_metadata.op_id = 2
            m = req.make_array_from_host_buffer_request  # waits for host buffer 7's bytes
            m.dtype.kind = m.dtype.DESCRIPTOR.fields_by_name["kind"].enum_type.values_by_name["KIND_F32"].number
            m.shape.dims.append(4)
            sh.to_proto(sh.Sharding((0,)), m.sharding, P)
            m.host_buffer_handle, m.array_handle = 7, 8
            await s.call.write(req)
            await asyncio.sleep(1.0)
            s.call.cancel()
            storing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await s.call.read()

    with pytest.raises(asyncio.CancelledError):  # raw_session's own end: done_writing on the cancelled call
        asyncio.run(main())
    ends = wait_for(lambda: re.findall(r"proxy: session \w+ closed: (.*)", cluster.controller_logs()), 30,
                    "the proxy session's end in the controller's log")
    # grpc.aio shows the client's cancel as the stream's end, or as the cancellation of its reader
    assert ends in ([f"{service.ENDED}, 1 requests unanswered then"],
                    [f"{service.CANCELLED}, 1 requests unanswered"]), ends


SMALL = """
import numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
mesh = Mesh(np.array(jax.devices()), ("x",))
xs = [jax.device_put(np.full((64, 8), i, np.float32), NamedSharding(mesh, P("x"))) for i in range(20)]
print(sum(float(x.sum()) for x in xs))
"""


def test_every_session_of_an_exited_client_ends(cluster: LocalCluster, tmp_path: Path) -> None:
    """Six small programs one after another: each one's session ends, and says so, once it exits
    (its close is shielded from its reader's cancellation: service.py)."""
    for i in range(6):  # unshielded, one never ended in 4 of 5 runs (3 of 5 by hand)
        assert plain_lines(start_plain(SMALL, proxy_env(cluster, tmp_path, PATHWAYS_DEVICES="4"))) == ["97280.0"]
        wait_for(lambda i=i: len(re.findall(r"proxy: session \w+ closed: ", cluster.controller_logs())) == i + 1,
                 30, f"session {i + 1}'s end in the controller's log")
