"""The IFRT proxy protocol layer: message classes from the installed jaxlib, version negotiation,
the plugin, and the service against the real jaxlib client (a subprocess with JAX_PLATFORMS=proxy).

The cluster side of the service (server/proxy/backend.py) is not wired to the controller yet; the
session tests give the service a `DescribedSlice` backend that reports four CPU devices and refuses
all device work, which is exactly what these tests exercise: the protocol, not execution.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from proxy_env import client_env

from pwctl import proxy_plugin
from server import rpcguard
from server.proxy import protocol as proto_mod
from server.proxy.backend import BackendError, CompiledInfo, DeviceInfo, SliceInfo
from server.proxy.handles import SERVER_HANDLE_BASE, Arriving, HandleError, HandleTable, HostBuffers, HostData
from server.proxy.layouts import default_layout
from server.proxy.service import TOKEN_KEY, ProxyService
from server.proxy.shardings import MAX_RANK

REPO = Path(__file__).resolve().parent.parent
P = proto_mod.protocol()


# -- protocol ---------------------------------------------------------------------------------


def test_classes_come_from_the_installed_client() -> None:
    service = P.pool.FindServiceByName(proto_mod.SERVICE_NAME)
    methods = {m.name: (m.input_type.full_name, m.client_streaming, m.server_streaming) for m in service.methods}
    assert methods["IfrtSession"] == ("xla.ifrt.proxy.IfrtRequest", True, True)
    assert methods["HostBufferStore"] == ("xla.ifrt.proxy.GrpcHostBufferStoreRequest", True, False)
    assert methods["GetVersion"] == ("xla.ifrt.proxy.GrpcGetVersionRequest", False, False)
    req = P.IfrtRequest()
    req.request_metadata.op_id = 7
    req.init_request.SetInParent()
    back = P.IfrtRequest.FromString(req.SerializeToString())
    assert back.WhichOneof("request") == "init_request" and back.request_metadata.op_id == 7
    # the messages that travel inside opaque fields are there too
    assert P.cls("xla.CompileOptionsProto")().DESCRIPTOR.full_name == "xla.CompileOptionsProto"
    assert P.cls("xla.OpSharding")().DESCRIPTOR.full_name == "xla.OpSharding"


def test_scan_rejects_a_library_without_the_protocol(tmp_path: Path) -> None:
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x00" * 64 + b"\x0a\x09any.proto" + b"\xff" * 64)
    with pytest.raises(proto_mod.ProtocolError, match="no IFRT proxy client"):
        proto_mod.build(proto_mod.scan_file_descriptors(lib))


def test_negotiate_picks_the_highest_common_version_or_names_both_ranges() -> None:
    v = proto_mod.negotiate(proto_mod.Version(16, 0), proto_mod.Version(25, 3))
    assert (v.protocol_version, v.serdes_version) == (25, 3)
    with pytest.raises(proto_mod.ProtocolError, match="26-30 offered by the client; this server speaks 25-25"):
        proto_mod.negotiate(proto_mod.Version(26, 0), proto_mod.Version(30, 3))
    with pytest.raises(proto_mod.ProtocolError, match="16-24"):
        proto_mod.negotiate(proto_mod.Version(16, 0), proto_mod.Version(24, 3))


def test_default_layout_is_xla_layout_text() -> None:
    assert default_layout(0) == b"{}"
    assert default_layout(2) == b"{1,0}"
    assert default_layout(3) == b"{2,1,0}"


# -- handles ------------------------------------------------------------------------------------


def test_failed_ops_mark_their_result_handles() -> None:
    table = HandleTable(limit=3)
    table.put(1, "buf-1")
    assert table.new_handle() == SERVER_HANDLE_BASE
    table.fail([2, 3, 0], "INVALID_ARGUMENT", "compile failed: bad shape")
    with pytest.raises(HandleError, match="compile failed: bad shape") as e:
        table.get(3)
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(HandleError, match="unknown handle 9"):
        table.get(9)
    with pytest.raises(HandleError, match="already in use"):
        table.put(1, "again")
    with pytest.raises(HandleError, match="at most 3 handles") as e:
        table.put(4, "x")
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert table.pop(1) == "buf-1" and table.pop(2) is None


def test_host_buffers_wait_for_late_stores_and_are_bounded() -> None:
    async def main() -> None:
        buffers = HostBuffers(limit_bytes=10, wait_s=5.0)
        taker = asyncio.create_task(buffers.take(4))
        await asyncio.sleep(0)
        assert not taker.done()
        buffers.store(4, b"abcd")
        assert (await taker).tobytes() == b"abcd"
        assert buffers.held_bytes == 0
        buffers.store(5, b"123456")
        with pytest.raises(HandleError, match="at most 10 bytes"):
            buffers.store(6, b"12345")
        with pytest.raises(HandleError, match="host buffer of -1 bytes: a size is 0 or more") as e:
            buffers.reserve(-1)  # a HostBufferStore announcing -1 bytes (the proxy fuzz): not "exhausted"
        assert e.value.code == "INVALID_ARGUMENT"
        quick = HostBuffers(wait_s=0.05)
        with pytest.raises(HandleError, match=r"did not arrive within 0\.05 s"):
            await quick.take(1)

    asyncio.run(main())


class Coming(Arriving):
    """Bytes still on their way (as downloads.Fetching's from a worker), here set by the test."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.bytes: asyncio.Future[HostData] = asyncio.get_running_loop().create_future()
        self.released = 0

    async def result(self) -> HostData:
        return await asyncio.shield(self.bytes)

    def release(self) -> None:
        self.released += 1
        self.bytes.cancel()


def test_arriving_host_buffers_count_against_the_limit_and_are_waited_for() -> None:
    """A small download CopyToHostBuffer answered before its bytes came (downloads.Fetching)
    counts as the bytes it will hold, its lookup waits for them and leaves it stored, a request
    taking it waits too, and deleting it (or the session's end) lets its fetch go."""
    async def main() -> None:
        buffers = HostBuffers(limit_bytes=10)
        first = Coming(6)
        buffers.store(1, first)
        assert buffers.held_bytes == 6
        with pytest.raises(HandleError, match="at most 10 bytes"):
            buffers.store(2, Coming(5))
        looking = asyncio.create_task(buffers.lookup_bytes(1))
        await asyncio.sleep(0)
        assert not looking.done()
        first.bytes.set_result(HostData([b"abcdef"]))
        got = await looking
        assert isinstance(got, HostData) and got.tobytes() == b"abcdef" and buffers.held_bytes == 6
        assert (await buffers.take(1)).tobytes() == b"abcdef"  # a MakeArray of it: taken, let go
        assert buffers.held_bytes == 0 and first.released == 1
        second, third = Coming(4), Coming(4)
        buffers.store(2, second)
        buffers.store(3, third)
        buffers.drop(2)
        assert second.released == 1 and buffers.held_bytes == 4
        buffers.clear()
        assert third.released == 1 and buffers.held_bytes == 0

    asyncio.run(main())


# -- plugin -------------------------------------------------------------------------------------


def test_plugin_reads_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path))
    monkeypatch.setenv("PWCTL_TOKEN", "tok")
    assert proxy_plugin.requested({"JAX_PLATFORMS": "cpu,proxy"})
    assert not proxy_plugin.requested({"JAX_PLATFORMS": "cpu"})
    assert not proxy_plugin.requested({})
    assert proxy_plugin.target({"JAX_BACKEND_TARGET": "10.0.0.5:7070"}) == "grpc://10.0.0.5:7070"
    assert proxy_plugin.target({"JAX_BACKEND_TARGET": "grpc://h:1"}) == "grpc://h:1"
    data = proxy_plugin.initialization_data({"PATHWAYS_SLICE": "train", "PATHWAYS_DEVICES": "4"})
    assert data == {TOKEN_KEY: b"tok", proxy_plugin.SLICE_KEY: b"train", proxy_plugin.DEVICES_KEY: 4}
    assert proxy_plugin.connect_timeout({}) == proxy_plugin.CONNECT_TIMEOUT_S
    assert proxy_plugin.connect_timeout({"PATHWAYS_CONNECT_TIMEOUT_S": "3"}) == 3
    with pytest.raises(ValueError, match="PATHWAYS_CONNECT_TIMEOUT_S='-1'"):
        proxy_plugin.connect_timeout({"PATHWAYS_CONNECT_TIMEOUT_S": "-1"})
    with pytest.raises(ValueError, match="PATHWAYS_DEVICES='four'"):
        proxy_plugin.initialization_data({"PATHWAYS_DEVICES": "four"})
    monkeypatch.delenv("PWCTL_TOKEN")
    (tmp_path / "token").write_text("from-file\n")
    assert proxy_plugin.initialization_data({}) == {TOKEN_KEY: b"from-file"}


def test_plugin_is_inert_unless_asked_for(tmp_path: Path) -> None:
    code = (
        "import jax; from jax._src import xla_bridge as xb; jax.devices();"
        "import sys; print('pwctl.proxy_plugin' in sys.modules, 'proxy' in xb._backend_factories)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=client_env(tmp_path, JAX_PLATFORMS="cpu"),
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert out.stdout.split() == ["True", "False"]  # discovered through the entry point, registered nothing


def test_timer_slack_is_read_from_the_environment_and_reaches_only_threads_started_inside() -> None:
    assert proxy_plugin.client_timer_slack_ns({}) == proxy_plugin.CLIENT_TIMER_SLACK_US * 1000
    assert proxy_plugin.client_timer_slack_ns({"PATHWAYS_CLIENT_TIMER_SLACK_US": "0"}) == 0
    assert proxy_plugin.client_timer_slack_ns({"PATHWAYS_CLIENT_TIMER_SLACK_US": "300"}) == 300_000
    for bad in ("-5", "1ms"):
        with pytest.raises(ValueError, match="PATHWAYS_CLIENT_TIMER_SLACK_US"):
            proxy_plugin.client_timer_slack_ns({"PATHWAYS_CLIENT_TIMER_SLACK_US": bad})
    if not sys.platform.startswith("linux"):
        pytest.skip("timer slack is a Linux setting")
    libc = ctypes.CDLL(None)

    def slack() -> int:
        return int(libc.prctl(proxy_plugin.PR_GET_TIMERSLACK, 0, 0, 0, 0))

    def in_new_thread() -> int:
        seen: list[int] = []
        t = threading.Thread(target=lambda: seen.append(slack()))
        t.start()
        t.join()
        return seen[0]

    mine = slack()
    with proxy_plugin.timer_slack(3_000_000):
        assert in_new_thread() == 3_000_000
    assert slack() == mine and in_new_thread() == mine
    with proxy_plugin.timer_slack(0):  # 0: left alone
        assert in_new_thread() == mine


IDLE_WAKEUPS = """
import os, time, jax
jax.devices()  # the session is open: the client's threads run

def switches():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            text = open(f"/proc/self/task/{tid}/status").read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        out[tid] = int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
    return out

before = switches()
start = time.monotonic()
time.sleep(1.0)
after = switches()
elapsed = time.monotonic() - start
print(max((after[t] - before.get(t, 0)) / elapsed for t in after))
"""


def test_an_idle_proxy_client_wakes_far_less_often_with_the_timer_slack(tmp_path: Path) -> None:
    """The jaxlib client's batched-deletion thread sleeps 50 µs in a loop (~20,000 wake-ups a
    second on an idle machine); the plugin starts the client with a timer slack
    (`proxy_plugin.timer_slack`), and its busiest thread then wakes a few hundred times a second
    on a quiet machine. Other processes' timer interrupts wake a sleeper early whatever its
    slack, so on a busy machine both figures move: the test compares the same idle program with
    and without the slack (measured here at load ~16: 2,100-2,500 against 7,800)."""
    async def main() -> None:
        service = ProxyService(Cluster(), token="secret")
        server, port = await serve(service)
        try:
            rates = []
            for slack in ("", "0"):
                env = client_env(tmp_path, PWCTL_TOKEN="secret", JAX_PLATFORMS="proxy", PATHWAYS_SLICE="train",
                                 JAX_BACKEND_TARGET=f"grpc://127.0.0.1:{port}", PATHWAYS_CLIENT_TIMER_SLACK_US=slack)
                rc, out, err = await run_client(IDLE_WAKEUPS, env)
                assert rc == 0, err
                rates.append(float(out.split()[-1]))
            with_slack, without = rates
            assert with_slack < 0.5 * without, (
                f"an idle client's busiest thread woke {with_slack:.0f} times a second with the slack, "
                f"{without:.0f} without")
        finally:
            await server.stop(None)

    asyncio.run(main())


# -- the service against the real jaxlib client ---------------------------------------------------


class DescribedSlice:
    """A session backend that describes four CPU devices and refuses all device work."""

    slice = SliceInfo(
        platform_name="cpu", platform_version="pathways-test", platform_id=0,
        devices=tuple(DeviceInfo(id=i, kind="cpu") for i in range(4)),
    )
    closed = 0

    async def compile(self, module: bytes, device_ids: Sequence[int]) -> CompiledInfo:
        raise BackendError("UNIMPLEMENTED", "no devices in this test")

    def execute(self, program_id: str, inputs: Sequence[int]) -> list[int]:
        raise BackendError("UNIMPLEMENTED", "no devices in this test")

    async def prepare(self, program_id: str, inputs: Sequence[int]) -> tuple[list[int], list[int]]:
        return list(inputs), []  # one worker: every input is read where it is

    def spread_over_workers(self, buffer_id: int) -> bool:
        return False

    async def put(self, devices: Sequence[int], dtype: str, shape: tuple[int, ...], data: bytes,
                  replicated: bool = False) -> int:
        raise BackendError("UNIMPLEMENTED", "no devices in this test")

    async def get(self, buffer_id: int) -> bytes:
        raise BackendError("UNIMPLEMENTED", "no devices in this test")

    async def ready(self, buffer_ids: Sequence[int], blocking: bool = True) -> None:
        raise BackendError("UNIMPLEMENTED", "no devices in this test")

    def free(self, buffer_ids: Sequence[int]) -> None:
        pass

    async def close(self) -> None:
        DescribedSlice.closed += 1


class Cluster:
    def __init__(self) -> None:
        self.opened: list[tuple[str | None, int | None]] = []

    async def open_session(self, slice_name: str | None, devices: int | None) -> DescribedSlice:
        self.opened.append((slice_name, devices))
        if slice_name == "missing":
            raise BackendError("NOT_FOUND", "no slice 'missing': create it with `pwctl slice create`")
        return DescribedSlice()


async def serve(service: ProxyService) -> tuple[aio.Server, int]:
    server = aio.server()
    server.add_generic_rpc_handlers([service.generic_handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def run_client(code: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    return proc.returncode or 0, out.decode(), err.decode()


PROGRAM = """
import jax, jax.numpy as jnp
print("devices", len(jax.devices()), jax.devices()[0].platform)
for attempt in range(2):
    try:
        jnp.ones(3).block_until_ready()
    except Exception as e:
        print("error", type(e).__name__, str(e).splitlines()[0])
"""


def test_session_with_the_real_client(tmp_path: Path) -> None:
    async def main() -> None:
        cluster = Cluster()
        closed_before = DescribedSlice.closed  # other tests' sessions count too
        service = ProxyService(cluster, token="secret")
        server, port = await serve(service)
        try:
            target = f"grpc://127.0.0.1:{port}"
            base = {
                "JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": target, "PATHWAYS_SLICE": "train",
                "PATHWAYS_CONNECT_TIMEOUT_S": "2",  # the client retries a refused session this long
            }
            # three clients at once (each a JAX process; the refused two retry for 2 s): one with
            # the token, one with a wrong token, one asking for a slice that does not exist
            missing = client_env(tmp_path, PWCTL_TOKEN="secret", **{**base, "PATHWAYS_SLICE": "missing"})
            (rc, out, err), wrong, absent = await asyncio.gather(
                run_client(PROGRAM, client_env(tmp_path, PWCTL_TOKEN="secret", **base)),
                run_client(PROGRAM, client_env(tmp_path, PWCTL_TOKEN="wrong", **base)),
                run_client(PROGRAM, missing))
            assert rc == 0, err
            lines = out.splitlines()
            assert lines[0] == "devices 4 cpu"
            # the unsupported request is a JaxRuntimeError naming it; the session stays usable
            message = "UNIMPLEMENTED: no devices in this test"  # the backend's refusal of the compile
            assert lines[1:] == [f"error JaxRuntimeError {message}"] * 2
            assert service.sessions == {}  # the programs ended: the one session closed
            assert DescribedSlice.closed == closed_before + 1

            rc, out, err = wrong
            assert rc != 0 and "UNAUTHENTICATED" in err and "missing or wrong cluster token" in err
            # the wrong token opened nothing: one session asked for "train" (the good client's),
            # the others for "missing"
            assert [o for o in cluster.opened if o != ("missing", None)] == [("train", None)], cluster.opened

            rc, out, err = absent
            assert rc != 0 and "no slice 'missing'" in err
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_host_buffer_rpcs_are_bound_to_a_live_session() -> None:
    async def main() -> None:
        service = ProxyService(Cluster())
        server, port = await serve(service)
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                base = f"/{proto_mod.SERVICE_NAME}/"
                ser = lambda m: m.SerializeToString()  # noqa: E731
                session_call = ch.stream_stream(base + "IfrtSession", ser, P.IfrtResponse.FromString)
                meta = P.GrpcIfrtSessionMetadata()
                meta.version.protocol_version = proto_mod.MAX_PROTOCOL_VERSION
                call = session_call(metadata=[(proto_mod.SESSION_METADATA_HEADER, meta.SerializeToString())])
                init = P.IfrtRequest()
                init.request_metadata.op_id = 1
                init.init_request.SetInParent()
                await call.write(init)
                resp = await call.read()
                sid = resp.init_response.session_id
                assert resp.response_metadata.op_id == 1 and len(resp.init_response.all_devices) == 4
                assert sid in service.sessions

                store = ch.stream_unary(base + "HostBufferStore", ser, P.GrpcHostBufferStoreResponse.FromString)

                def header(session_id: int, handle: int, size: int) -> list[tuple[str, bytes]]:
                    m = P.GrpcHostBufferStoreMetadata(session_id=session_id, handle=handle, buffer_size=size)
                    return [(proto_mod.HOST_BUFFER_METADATA_HEADER, m.SerializeToString())]

                chunks = [P.GrpcHostBufferStoreRequest(data=b"x" * 3), P.GrpcHostBufferStoreRequest(data=b"y")]
                await store(iter(chunks), metadata=header(sid, 5, 4))
                with pytest.raises(aio.AioRpcError) as e:
                    await store(iter(chunks), metadata=header(sid ^ 1, 6, 4))
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
                with pytest.raises(aio.AioRpcError) as e:
                    await store(iter(chunks), metadata=header(sid, 7, 9))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "9 bytes announced, 4 sent" in str(e.value)

                lookup = ch.unary_stream(base + "HostBufferLookup", ser, P.GrpcHostBufferLookupResponse.FromString)
                got = b"".join([r.data async for r in lookup(P.GrpcHostBufferLookupRequest(session_id=sid, handle=5))])
                assert got == b"xxxy"
                delete = ch.unary_unary(base + "HostBufferDelete", ser, P.GrpcHostBufferDeleteResponse.FromString)
                await delete(P.GrpcHostBufferDeleteRequest(session_id=sid, handle=5))
                with pytest.raises(aio.AioRpcError) as e:
                    await delete(P.GrpcHostBufferDeleteRequest(session_id=sid, handle=5))
                assert e.value.code() == grpc.StatusCode.NOT_FOUND

                # an unsupported request: an error answer for that op, the stream goes on
                bad = P.IfrtRequest()
                bad.request_metadata.op_id = 2
                bad.bitcast_arrays_request.SetInParent()
                await call.write(bad)
                resp = await call.read()
                assert resp.response_metadata.op_id == 2
                assert resp.response_metadata.status.code == grpc.StatusCode.UNIMPLEMENTED.value[0]
                assert "bitcast_arrays_request" in resp.response_metadata.status.message
                await call.done_writing()
                assert await call.read() == aio.EOF
            assert sid not in service.sessions
            # a delete that arrives after its session ended (a client exiting right after a
            # download) is answered OK: it frees nothing, and an error would crash the exiting
            # jaxlib client, which logs it (host_buffer_rpcs.HostBufferDelete)
            async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                delete = ch.unary_unary(base + "HostBufferDelete", ser, P.GrpcHostBufferDeleteResponse.FromString)
                assert await delete(P.GrpcHostBufferDeleteRequest(session_id=sid, handle=6)) == \
                    P.GrpcHostBufferDeleteResponse()
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_hostile_input_fails_only_its_own_request(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        service = ProxyService(Cluster())
        server, port = await serve(service)
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                base = f"/{proto_mod.SERVICE_NAME}/"
                raw = ch.stream_stream(base + "IfrtSession")  # bytes in, bytes out
                # undecodable session metadata: the first request is answered with the error
                call = raw(metadata=[(proto_mod.SESSION_METADATA_HEADER, b"\xff\xff\xff")])
                init = P.IfrtRequest()
                init.request_metadata.op_id = 1
                init.init_request.SetInParent()
                await call.write(init.SerializeToString())
                resp = P.IfrtResponse.FromString(await call.read())
                assert resp.response_metadata.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert resp.response_metadata.status.message == "undecodable IfrtSession metadata"
                call.cancel()
                # an undecodable request ends that stream with an error; another session is unaffected
                meta = P.GrpcIfrtSessionMetadata()
                meta.version.protocol_version = proto_mod.MAX_PROTOCOL_VERSION
                header = [(proto_mod.SESSION_METADATA_HEADER, meta.SerializeToString())]
                good = raw(metadata=header)
                await good.write(init.SerializeToString())
                sid = P.IfrtResponse.FromString(await good.read()).init_response.session_id
                bad = raw(metadata=header)
                await bad.write(b"\xff\xff\xff\xff")
                with pytest.raises(aio.AioRpcError) as e:
                    await bad.read()
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details() == "undecodable IfrtRequest: the session ends"
                layout = P.IfrtRequest()
                layout.request_metadata.op_id = 2
                layout.get_default_layout_request.dims.extend([3, 4])
                await good.write(layout.SerializeToString())
                resp = P.IfrtResponse.FromString(await good.read())
                assert resp.get_default_layout_response.serialized_pjrt_layout == b"{1,0}"
                assert sid in service.sessions
                # a session id that is not one the server issued gets nothing
                lookup = ch.unary_stream(base + "HostBufferLookup", lambda m: m.SerializeToString(),
                                         P.GrpcHostBufferLookupResponse.FromString)
                with pytest.raises(aio.AioRpcError) as e:
                    async for _ in lookup(P.GrpcHostBufferLookupRequest(session_id=sid + 1, handle=1)):
                        pass
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
                await good.done_writing()
        finally:
            await server.stop(None)

    asyncio.run(main())
    assert not [r for r in caplog.records if r.exc_info], "a rejected request logged a traceback"


def test_a_jaxlib_without_the_protocol_is_refused_with_why() -> None:
    """A controller whose installed jaxlib carries no IFRT proxy protocol answers a proxy client's
    first call FAILED_PRECONDITION saying so (it raised inside gRPC's handler lookup: UNKNOWN)."""
    from server.proxy.routing import LazyProxyHandler

    def make() -> ProxyService:
        raise proto_mod.ProtocolError(f"the installed jaxlib embeds no {proto_mod.SERVICE_FILE}: it has no IFRT "
                                      "proxy client")

    async def main() -> None:
        server = aio.server()
        server.add_generic_rpc_handlers([LazyProxyHandler(make)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                for _ in range(2):
                    call = ch.unary_unary(f"/{proto_mod.SERVICE_NAME}/GetVersion")
                    with pytest.raises(aio.AioRpcError) as e:
                        await call(P.GrpcGetVersionRequest().SerializeToString(), timeout=10)
                    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert e.value.details() == ("this controller cannot serve IFRT proxy clients: the installed "
                                                 f"jaxlib embeds no {proto_mod.SERVICE_FILE}: it has no IFRT proxy "
                                                 "client")
        finally:
            await server.stop(None)

    asyncio.run(main())


async def _session(ch: aio.Channel, **init: Any) -> tuple[Any, int]:
    """A raw IfrtSession stream (bytes in and out) and its Init's answer (None: refused)."""
    meta = P.GrpcIfrtSessionMetadata()
    meta.version.protocol_version = proto_mod.MAX_PROTOCOL_VERSION
    for key, value in init.items():
        attr = meta.initialization_data.attributes[key]
        if isinstance(value, bytes):
            attr.string_value = value
        else:
            attr.int64_value = value
    call = ch.stream_stream(f"/{proto_mod.SERVICE_NAME}/IfrtSession")(
        metadata=[(proto_mod.SESSION_METADATA_HEADER, meta.SerializeToString())])
    init_req = P.IfrtRequest()
    init_req.request_metadata.op_id = 1
    init_req.init_request.SetInParent()
    await call.write(init_req.SerializeToString())
    return call, P.IfrtResponse.FromString(await call.read())


@pytest.mark.timeout(60)
def test_a_lookup_never_read_then_dropped_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """Found by the chaos run's proxy fuzz (bench/chaos/proxyfuzz.py): a client that stops
    reading a HostBufferLookup, then hangs up, failed the service's pending write before gRPC
    marked the call cancelled, and gRPC logged that as an ERROR with a traceback. With the
    controller's filter of gRPC's log (rpcguard.FinalStatusFilter, installed at its start): the
    lookup's last message leaves with the call's status, which the filter makes one INFO line
    when the caller has gone."""
    async def main() -> None:
        service = ProxyService(Cluster())
        server, port = await serve(service)
        base = f"/{proto_mod.SERVICE_NAME}/"
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call, resp = await _session(ch)
                sid = resp.init_response.session_id
                data = b"z" * (6 << 20)
                meta = P.GrpcHostBufferStoreMetadata(session_id=sid, handle=9, buffer_size=len(data))
                chunks = [P.GrpcHostBufferStoreRequest(data=data[i : i + (1 << 20)]).SerializeToString()
                          for i in range(0, len(data), 1 << 20)]
                await ch.stream_unary(base + "HostBufferStore")(
                    iter(chunks), metadata=[(proto_mod.HOST_BUFFER_METADATA_HEADER, meta.SerializeToString())])
                request = P.GrpcHostBufferLookupRequest(session_id=sid, handle=9).SerializeToString()
                for _ in range(20):
                    lookup = ch.unary_stream(base + "HostBufferLookup")(request)
                    await lookup.read()  # the first chunk; the rest waits for the client's window
                    await asyncio.sleep(0.02)
                    lookup.cancel()
                await asyncio.sleep(0.2)
                # the session still serves: the whole buffer reads back
                got = b"".join([P.GrpcHostBufferLookupResponse.FromString(m).data
                                async for m in ch.unary_stream(base + "HostBufferLookup")(request)])
                assert got == data
                call.cancel()
        finally:
            await server.stop(None)

    grpc_log, final_status = logging.getLogger(rpcguard.GRPC_LOGGER), rpcguard.FinalStatusFilter()
    grpc_log.addFilter(final_status)  # as the controller's start does (quiet_final_status), for this test only
    try:
        with caplog.at_level(logging.DEBUG):
            asyncio.run(main())
    finally:
        grpc_log.removeFilter(final_status)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records
                                                                          if r.levelno >= logging.ERROR]


@pytest.mark.timeout(60)
def test_requests_the_proxy_fuzz_broke_get_their_own_answer(caplog: pytest.LogCaptureFixture) -> None:
    """Found by the chaos run's proxy fuzz (bench/chaos/proxyfuzz.py), each once a traceback in
    the controller's log: a device count out of int32's range (ValueError building the slice
    spec: the stream ended UNKNOWN), a slice name that is not UTF-8 (UnicodeDecodeError), every
    DeleteArray (its `array_handle` is repeated: "unhashable type", INTERNAL), and a CheckFuture
    of a handle that is no future (an array: "can't be used in 'await' expression")."""
    async def main() -> None:
        cluster = Cluster()
        service = ProxyService(cluster)
        server, port = await serve(service)
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                for init, message in (
                    *(({"pathways.devices": n}, f"pathways.devices={n}: expected a positive number of devices")
                      for n in (2**63 - 1, 0, -1)),
                    ({"pathways.slice": b"\xff\xfe"}, "pathways.slice must be a slice name in UTF-8"),
                ):
                    call, resp = await _session(ch, **init)
                    status = resp.response_metadata.status
                    assert (status.code, status.message) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], message)
                    call.cancel()
                assert cluster.opened == []  # refused before any slice was asked for

                call, resp = await _session(ch, **{"pathways.devices": 2})
                assert cluster.opened == [(None, 2)]

                async def ask(op_id: int, fill: Any) -> Any:
                    req = P.IfrtRequest()
                    req.request_metadata.op_id = op_id
                    fill(req)
                    await call.write(req.SerializeToString())
                    answer = P.IfrtResponse.FromString(await call.read())
                    assert answer.response_metadata.op_id == op_id
                    return answer

                deleted = await ask(2, lambda r: r.delete_array_request.array_handle.extend([5, 6]))
                assert deleted.response_metadata.status.code == 0, deleted.response_metadata.status.message
                future = deleted.delete_array_response.deletion_future_handle
                done = await ask(3, lambda r: setattr(r.check_future_request, "future_handle", future))
                assert done.response_metadata.status.code == 0
                (session,) = service.sessions.values()
                session.handles.put(77, object())  # what an array's handle holds, for this test
                wrong = await ask(4, lambda r: setattr(r.check_future_request, "future_handle", 77))
                status = wrong.response_metadata.status
                assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert status.message == "handle 77 is not a future"
                assert session.handles.peek(77) is not None  # a wrong CheckFuture takes nothing
                await call.done_writing()
        finally:
            await server.stop(None)

    asyncio.run(main())
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], "a request logged an error"


@pytest.mark.timeout(60)
def test_a_shape_of_too_many_dimensions_is_refused_before_any_work() -> None:
    """Found by the proxy fuzz's bounds: a GetDefaultLayout of 20 million dimensions (74 MiB)
    held every other session's answers 8 s while its 161 MiB answer was built; a shape past
    MAX_RANK dimensions is INVALID_ARGUMENT, in a layout or an array's shape alike."""
    async def main() -> None:
        service = ProxyService(Cluster())
        server, port = await serve(service)
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call, _ = await _session(ch)
                for op_id, fill, what in (
                    (2, lambda r: r.get_default_layout_request.dims.extend(range(MAX_RANK + 1)), "a layout"),
                    (3, lambda r: r.make_array_from_host_buffer_request.MergeFrom(P.MakeArrayFromHostBufferRequest(
                        dtype={"kind": "KIND_F32"}, shape={"dims": [1] * (MAX_RANK + 1)})), "a shape"),
                ):
                    req = P.IfrtRequest()
                    req.request_metadata.op_id = op_id
                    fill(req)
                    await call.write(req.SerializeToString())
                    status = P.IfrtResponse.FromString(await call.read()).response_metadata.status
                    assert (status.code, status.message) == (
                        grpc.StatusCode.INVALID_ARGUMENT.value[0],
                        f"{what} of {MAX_RANK + 1} dimensions: at most {MAX_RANK}")
                layout = P.IfrtRequest()
                layout.request_metadata.op_id = 4
                layout.get_default_layout_request.dims.extend(range(MAX_RANK))  # at the bound: answered
                await call.write(layout.SerializeToString())
                resp = P.IfrtResponse.FromString(await call.read())
                assert resp.get_default_layout_response.serialized_pjrt_layout.startswith(b"{4095,4094,")
                await call.done_writing()
        finally:
            await server.stop(None)

    asyncio.run(main())
