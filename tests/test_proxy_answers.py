"""A proxy session's answers made as bytes (server/proxy/answers.py), the writer that sends them,
and the runner that answers most requests without a task (server/proxy/running.py).

Pre-serialized answers must be the very messages protobuf would build: each is compared, parsed
and byte for byte, with the message built field by field; an executable's output descriptors,
made once per executable, must be its own (another dtype, shape or sharding gives another).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from test_proxy_protocol import DescribedSlice, P

from server.proxy import executables
from server.proxy import shardings as sh
from server.proxy.answers import AnswerWriter, Encoder, message_field
from server.proxy.arrays import ArrayRecord, Buf, whole
from server.proxy.backend import ArraySpec, CompiledInfo
from server.proxy.executables import LoadedExecutable
from server.proxy.running import Runner
from server.proxy.service import Session

ENC = Encoder(P)
OUTPUT = P.cls("xla.ifrt.proxy.LoadedExecutableExecuteResponse.Output")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("op_id", [1, 127, 128, 1 << 40, (1 << 64) - 1])
def test_a_destruct_answer_is_the_message_protobuf_builds(op_id: int) -> None:
    made = ENC.metadata(op_id) + ENC.empty("destruct_array_response")
    built = P.IfrtResponse()
    built.response_metadata.op_id = op_id
    built.destruct_array_response.SetInParent()
    assert made == built.SerializeToString()
    parsed = P.IfrtResponse.FromString(made)
    assert parsed.response_metadata.op_id == op_id and parsed.WhichOneof("response") == "destruct_array_response"


@pytest.mark.timeout(30)
def test_a_message_field_is_what_protobuf_writes_for_every_length() -> None:
    for size in (1, 100, 124, 125, 126, 127, 128, 300, 1 << 14, 1 << 21):  # the status around 127 bytes
        built = P.IfrtResponse()
        built.response_metadata.status.message = "m" * size
        status = built.response_metadata.status.SerializeToString()
        assert message_field(1, message_field(2, status)) == built.SerializeToString()


class Runs(DescribedSlice):
    """Runs nothing: an execute's outputs are new buffer ids, ready at once."""

    def __init__(self) -> None:
        self.next = 100

    def execute(self, program_id: str, inputs: Sequence[int]) -> list[int]:
        self.next += 1
        return [self.next]

    async def ready(self, buffer_ids: Sequence[int], blocking: bool = True) -> None:
        pass


def _session() -> Session:
    return Session(id=1, version=25, backend=Runs(), encoder=ENC)


def _executable(session: Session, out: ArraySpec, devices: tuple[int, ...], sharding: bytes | None) -> int:
    """An executable taking and giving `out` (as a Compile leaves it); its handle."""
    compiled = CompiledInfo("p", "f", (out,), (out,), (), (sharding,), (sharding,))
    handle = session.handles.new_handle()
    session.handles.put(handle, LoadedExecutable(compiled, devices, session.submitted))
    return handle


def _argument(session: Session, spec: ArraySpec, devices: tuple[int, ...], sharding: bytes | None,
              handle: int) -> None:
    session.handles.put(handle, whole(Buf(7, spec.dtype, spec.shape), sh.Sharding(devices, sharding)))


async def _execute(session: Session, exe: int, arg: int, result: int, fill_status: bool) -> bytes:
    req = P.IfrtRequest()
    r = req.loaded_executable_execute_request
    r.loaded_executable_handle = exe
    r.args_handles.append(arg)
    r.result_array_handle.append(result)
    r.execute_options.fill_status = fill_status
    body = await executables.execute(session, req, P.IfrtResponse(), P)
    return ENC.metadata(9) + body


def _expected(spec: ArraySpec, sharding: sh.Sharding, handle: int, status: int) -> Any:
    built = P.IfrtResponse()
    built.response_metadata.op_id = 9
    x = built.loaded_executable_execute_response
    x.status_handle = status
    executables._output(x.outputs.add(), spec, sharding, handle, P)
    return built


@pytest.mark.timeout(60)
def test_execute_answers_are_per_executable_and_as_protobuf_builds_them() -> None:
    split = sh.from_hlo_text("{devices=[2,1]0,1}")  # rows over two devices
    assert split is not None
    cases = [  # (output, devices, OpSharding)
        (ArraySpec("float32", (2, 3)), (0,), None),
        (ArraySpec("int32", (2, 3)), (0,), None),
        (ArraySpec("float32", (4,)), (1,), None),
        (ArraySpec("float32", (2, 3)), (0, 1), None),
        (ArraySpec("float32", (2, 3)), (0, 1), split),
    ]

    async def main() -> None:
        session = _session()
        descriptors = set()
        for n, (spec, devices, op) in enumerate(cases):
            exe = _executable(session, spec, devices, op)
            _argument(session, spec, devices, op, 1000 + n)
            loaded = session.handles.get(exe, LoadedExecutable)
            for call, fill in enumerate((False, True, True)):  # the second and third from the cache
                result = 2000 + 10 * n + call
                made = await _execute(session, exe, 1000 + n, result, fill)
                parsed = P.IfrtResponse.FromString(made)
                status = parsed.loaded_executable_execute_response.status_handle
                assert bool(status) == fill
                expected = _expected(spec, loaded.out_sharding(0), result, status)
                assert parsed == expected
                assert made == expected.SerializeToString()
                record = session.handles.get(result, ArrayRecord)
                assert record.domains == loaded.out_sharding(0).domains(spec.shape)
            descriptors.add(loaded.outputs(P)[0][2])
            assert loaded.outputs(P) is loaded.outputs(P)  # made once
        assert len(descriptors) == len(cases)  # each executable answers its own outputs

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_the_writer_keeps_order_and_holds_the_reader_back_when_full() -> None:
    async def main() -> None:
        written: list[bytes] = []
        gate = asyncio.Event()

        async def write(raw: bytes) -> None:
            await gate.wait()
            written.append(raw)

        out = AnswerWriter(write, max_queued=3)
        writer = asyncio.create_task(out.run())
        for i in range(4):
            out.put(bytes([i]))
        room = asyncio.create_task(out.room())
        await asyncio.sleep(0.01)
        assert out.full and not room.done()  # the reader waits while the client does not read
        gate.set()
        await asyncio.wait_for(room, 5)
        out.put(b"\x04")
        out.close()
        await asyncio.wait_for(writer, 5)
        assert written == [bytes([i]) for i in range(5)]

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_the_writer_is_full_at_its_bytes_too() -> None:
    """Found by the chaos run's proxy fuzz: a client that never read, sending GetDefaultLayouts of
    100,000 dimensions (0.6 MB answers), made the controller hold 4,096 answers (0.5 GB after 20 s,
    growing); a few large answers now fill the writer as many small ones do."""
    async def main() -> None:
        gate = asyncio.Event()
        written: list[int] = []

        async def write(raw: bytes) -> None:
            await gate.wait()
            written.append(len(raw))

        out = AnswerWriter(write, max_queued=4096, max_bytes=3 << 20)
        writer = asyncio.create_task(out.run())
        for _ in range(2):
            out.put(b"x" * (1 << 20))
        assert not out.full
        out.put(b"x" * (1 << 20))
        assert out.full  # 3 answers, at the bytes' bound
        room = asyncio.create_task(out.room())
        await asyncio.sleep(0.01)
        assert not room.done()
        gate.set()
        await asyncio.wait_for(room, 5)
        out.close()
        await asyncio.wait_for(writer, 5)
        assert written == [1 << 20] * 3 and not out.full
        big = AnswerWriter(write, max_bytes=10)
        big.put(b"y" * 100)  # an answer larger than the bound still goes: alone it fills the writer
        assert big.full

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_the_runner_answers_in_place_and_keeps_first_steps_in_order() -> None:
    async def main() -> None:
        out = AnswerWriter(lambda raw: asyncio.sleep(0))
        steps: list[str] = []
        unclaimed: list[list[int]] = []
        runner = Runner(out, unclaimed.append)
        answers: list[bytes] = []
        out.put = answers.append  # type: ignore[method-assign]
        wait = asyncio.get_running_loop().create_future()

        async def answer(name: str, waits: bool = False) -> bytes:
            steps.append(name)
            if waits:
                await wait
                steps.append(name + " again")
            return name.encode()

        runner.start(answer("a"), [1], inline=True)
        assert answers == [b"a"] and unclaimed == [[1]] and not runner.pending  # no task
        runner.start(answer("b", waits=True), [2], inline=True)
        assert steps == ["a", "b"] and len(runner.pending) == 1  # went on in a task
        runner.start(answer("c"), [3], inline=False)  # a task, not started yet
        runner.start(answer("d"), [4], inline=True)  # behind it: a task as well
        assert steps == ["a", "b"] and len(runner.pending) == 3
        await asyncio.sleep(0)
        assert steps == ["a", "b", "c", "d"]
        wait.set_result(None)
        await asyncio.gather(*runner.pending)
        assert steps[-1] == "b again"
        assert answers == [b"a", b"c", b"d", b"b"] and sorted(unclaimed) == [[1], [2], [3], [4]]
        runner.start(answer("e"), [5], inline=True)  # nothing unstarted: in place again
        assert answers[-1] == b"e" and not runner.pending

    asyncio.run(main())
