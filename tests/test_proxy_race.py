"""Request ordering inside one proxy session: a DestructArray read after a request that reads the
same handle must not take the handle away from it, however the session's tasks interleave.

The flake this pins down (tests/test_proxy_compute.py under load): a MakeArray's upload finished
(`settle`) in the same event-loop turn in which a later DestructArray of that array was read;
the destruct's task ran before the wakeup of an Execute read in between, removed the handle, and
the Execute failed with "NOT_FOUND: unknown handle 25" (and so did the reads of its outputs).
Here the session stream is driven in process so that exact interleaving happens every time: the
backend's upload is held at a gate, and the gate opens in the same turn as the destruct is read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest
from grpc import aio
from test_proxy_protocol import DescribedSlice, P

from server.proxy import protocol as proto_mod
from server.proxy import shardings as sh
from server.proxy.arrays import ArrayRecord
from server.proxy.backend import ArraySpec, CompiledInfo
from server.proxy.executables import KINDS, LoadedExecutable
from server.proxy.handles import HandleError, HostData
from server.proxy.service import ProxyService


class HeldUploads(DescribedSlice):
    """Keeps uploaded bytes in memory; an upload returns only once `gate` opens."""

    def __init__(self) -> None:
        self.data: dict[int, bytes] = {}
        self.waiting = asyncio.Event()
        self.gate = asyncio.Event()
        self.freed: list[int] = []

    async def put(self, devices: Sequence[int], dtype: str, shape: tuple[int, ...], data: bytes | HostData,
                  replicated: bool = False) -> int:
        buffer_id = len(self.data) + 1
        self.data[buffer_id] = data.tobytes() if isinstance(data, HostData) else data
        self.waiting.set()
        await self.gate.wait()
        return buffer_id

    def execute(self, program_id: str, inputs: Any) -> list[int]:  # the program "identity"
        buffer_id = len(self.data) + 1
        self.data[buffer_id] = self.data[inputs[0]]
        return [buffer_id]

    async def get(self, buffer_id: int) -> bytes:
        return self.data[buffer_id]

    def free(self, buffer_ids: Any) -> None:
        self.freed.extend(buffer_ids)

    async def close(self) -> None:  # not DescribedSlice's: that counts its own test's sessions
        pass


class OneSession:
    def __init__(self, backend: HeldUploads) -> None:
        self.backend = backend

    async def open_session(self, slice_name: str | None, devices: int | None) -> HeldUploads:
        return self.backend


class Context:
    """What IfrtSession uses of its grpc context: the requests come from `requests`, and each
    answer written goes to `answer`."""

    def __init__(self, requests: AsyncIterator[bytes], answer: Callable[[bytes], Awaitable[None]]) -> None:
        self._requests = requests
        self._answer = answer

    async def read(self) -> Any:
        try:
            return await anext(self._requests)
        except StopAsyncIteration:
            return aio.EOF

    async def write(self, raw: bytes) -> None:
        await self._answer(raw)

    def invocation_metadata(self) -> list[tuple[str, bytes]]:
        meta = P.GrpcIfrtSessionMetadata()
        meta.version.protocol_version = proto_mod.MAX_PROTOCOL_VERSION
        return [(proto_mod.SESSION_METADATA_HEADER, meta.SerializeToString())]

    def peer(self) -> str:
        return "in-process"

    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"session aborted: {code} {details}")


def request(op_id: int) -> Any:
    req = P.IfrtRequest()
    req.request_metadata.op_id = op_id
    return req


@pytest.mark.timeout(60)
def test_a_destruct_waits_for_earlier_readers_of_its_handle() -> None:
    async def main() -> tuple[dict[int, Any], HeldUploads]:
        backend = HeldUploads()
        service = ProxyService(OneSession(backend))
        value = np.arange(6, dtype=np.float32).reshape(2, 3)
        answered: dict[int, Any] = {}
        done = asyncio.Event()

        async def requests() -> AsyncIterator[bytes]:
            init = request(1)
            init.init_request.SetInParent()
            yield init.SerializeToString()
            (session,) = service.sessions.values()
            session.buffers.store(7, value.tobytes())
            spec = ArraySpec("float32", value.shape)
            exe = session.handles.new_handle()  # as a Compile leaves it
            session.handles.put(exe, LoadedExecutable(CompiledInfo("p", "identity", (spec,), (spec,), ()), (0,),
                                                      session.submitted))
            make = request(2)  # array 25 from host buffer 7: its upload waits at the gate
            m = make.make_array_from_host_buffer_request
            m.dtype.kind = m.dtype.DESCRIPTOR.fields_by_name["kind"].enum_type.values_by_name[KINDS["float32"]].number
            m.shape.dims.extend(value.shape)
            sh.to_proto(sh.Sharding((0,)), m.sharding, P)
            m.host_buffer_handle, m.array_handle = 7, 25
            yield make.SerializeToString()
            run = request(6)  # reads 25 (still pending), makes 27 (as in the flake)
            run.loaded_executable_execute_request.loaded_executable_handle = exe
            run.loaded_executable_execute_request.args_handles.append(25)
            run.loaded_executable_execute_request.result_array_handle.append(27)
            yield run.SerializeToString()
            shard = request(3)  # reads 25 (still pending), makes 26
            shard.fully_replicated_shard_request.array_handle = 25
            shard.fully_replicated_shard_request.result_handle = 26
            yield shard.SerializeToString()
            read = request(4)  # reads 25 into host buffer 8
            read.copy_to_host_buffer_request.array_handle = 25
            read.copy_to_host_buffer_request.host_buffer_handle = 8
            yield read.SerializeToString()
            await backend.waiting.wait()
            # the upload finishes in the same turn as the destruct is read: the make settles 25
            # after the destruct's task was created and before the readers wake
            backend.gate.set()
            destruct = request(5)
            destruct.destruct_array_request.array_handle.append(25)
            yield destruct.SerializeToString()
            await done.wait()

        async def answer(raw: bytes) -> None:
            resp = P.IfrtResponse.FromString(raw)
            answered[resp.response_metadata.op_id] = resp
            if len(answered) == 6:
                (session,) = service.sessions.values()
                try:  # the read's bytes may still be arriving (downloads.Fetching): as a lookup, waited for
                    held = await session.buffers.lookup_bytes(8)
                    data: bytes | None = held.tobytes() if isinstance(held, HostData) else None
                except HandleError:
                    data = None
                answered[0] = (data, session.handles.peek(25), session.handles.peek(26),
                               session.handles.peek(27))
                done.set()

        gen = requests()
        await service.IfrtSession(gen, Context(gen, answer))
        return answered, backend

    answered, backend = asyncio.run(main())
    errors = {op: a.response_metadata.status.message for op, a in answered.items()
              if op and a.response_metadata.status.code}
    assert errors == {}
    assert answered[3].fully_replicated_shard_response.array_handle == 26
    data, gone, shard, result = answered[0]
    assert data is not None
    assert np.frombuffer(data, np.float32).tolist() == list(range(6))
    assert gone is None  # 25 destructed after its readers
    assert isinstance(shard, ArrayRecord) and isinstance(result, ArrayRecord)
    out = result.parts[0].buf.id  # the execute's output: the uploaded value, not freed
    assert backend.data[out] == np.arange(6, dtype=np.float32).tobytes() and out not in backend.freed
    assert answered[6].loaded_executable_execute_response.outputs[0].array_handle == 27
