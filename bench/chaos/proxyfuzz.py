"""The proxy fuzz part: a hostile but authenticated tenant of the controller's IFRT proxy service
(server/proxy/, what `JAX_PLATFORMS=proxy` programs speak), while the chaos run's workloads run
beside it (kills.py runs it before the first fault; their calls in its window are checked).

- sessions refused at their start: no session header, one that does not decode, hostile
  metadata (versions, a wrong or missing token, slice names and device counts that make no
  sense); each sends an Init, which must be answered with the refusal (`IfrtSession/refused`);
- `SESSIONS` sessions opened as the plugin opens them (the cluster token and one device, or the
  run's named slice), run side by side; each first does real work (stores bytes, makes an array
  of them, compiles a real StableHLO program, runs it) so that later requests can name real
  handles, then sends batches of hostile requests of every kind (proxyreqs.py: handles its own,
  its other sessions', fresh and random; random op ids; Compiles of real, flipped and garbage
  programs; MakeArrays whose bytes disagree with their shape; extreme shapes, dtypes and
  integers; flipped bytes), bytes that are no request (the session ends: another is opened),
  and the host buffer RPCs (HostBufferStore/Lookup/Delete with random sessions, handles and
  sizes that disagree with the bytes, also above the size that streams to a worker) and
  GetVersion with hostile versions. Sessions end at random, hung up or closed.
- clients that never read: a session that writes requests and never reads an answer, and a
  HostBufferLookup of a buffer staged on a worker that is never read, both held through the run.

Per request kind it records the answer's status code (`NO_ANSWER`: none within `DEADLINE_S`, as
a MakeArray waiting for bytes that never come; `STREAM_<code>`: the stream ended instead). An
UNKNOWN code, or an answer saying "(a bug)" (the service's catch-all), is a bug. At the end a
fresh session must still compute: an array uploaded, doubled by a compiled program and read back
must be right (`fresh_session_ok`).
"""

from __future__ import annotations

import asyncio
import random
import struct
import time
from collections import Counter
from typing import Any

import grpc
from grpc import aio

from server import wire
from server.proxy import protocol as proto_mod
from server.proxy.service import DEVICES_KEY, SLICE_KEY, TOKEN_KEY

from .messages import Generator
from .proxyreqs import Crafter, Handles, fill_compile, fill_make_array, request_kinds

BASE = f"/{proto_mod.SERVICE_NAME}/"
DEADLINE_S = 0.4  # an answer not there by then counts as NO_ANSWER
SESSIONS = 3  # valid sessions fuzzed side by side
BATCH = 6  # at most this many requests written before their answers are awaited
MIB = 1 << 20
HOST_RPCS = ("store", "lookup", "delete", "version")  # the host-buffer RPCs and GetVersion
CODES = {c.value[0]: c.name for c in grpc.StatusCode}


# grpcio's client replaces the server's status with this one when it writes after the server
# ended the call (grpc/aio/_call.py `_write`: set_internal_error): the service's own status is lost
CLIENT_INTERNAL = "Internal error from Core"


def _code(n: int) -> str:
    return CODES.get(n, f"CODE_{n}")


def _rpc_code(e: aio.AioRpcError) -> str:
    """The call's code, or WROTE_AFTER_END for the client library's own INTERNAL (CLIENT_INTERNAL)."""
    if e.code() == grpc.StatusCode.INTERNAL and e.details() == CLIENT_INTERNAL:
        return "WROTE_AFTER_END"
    return str(e.code().name)


class Stream:
    """One IfrtSession stream: serialized requests out, answers matched to them by op id."""

    def __init__(self, channel: aio.Channel, header: bytes | None, p: Any, read: bool = True) -> None:
        md = [] if header is None else [(proto_mod.SESSION_METADATA_HEADER, header)]
        self.call = channel.stream_stream(BASE + "IfrtSession")(metadata=md)
        self.p = p
        self.waiting: dict[int, asyncio.Future[Any]] = {}
        self.ended: str | None = None  # the stream's status once it ended
        self.sid = 0
        self.detail = ""  # the stream's status message once it ended
        self.devices: list[int] = []
        self.reader = asyncio.ensure_future(self._read() if read else asyncio.sleep(0))

    async def _read(self) -> None:
        try:
            while (raw := await self.call.read()) is not aio.EOF:
                resp = self.p.IfrtResponse.FromString(raw)  # an undecodable answer is a bug: it raises
                fut = self.waiting.pop(resp.response_metadata.op_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(resp)
            self.ended = (await self.call.code()).name
            self.detail = await self.call.details() or ""
        except aio.AioRpcError as e:
            self.ended, self.detail = _rpc_code(e), e.details() or ""
        finally:
            self.ended = self.ended or "CANCELLED"
            for fut in self.waiting.values():
                if not fut.done():
                    fut.set_result(None)

    async def send(self, raw: bytes, op_id: int) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.ended is None:
            self.waiting[op_id] = fut
            try:
                await asyncio.wait_for(self.call.write(raw), DEADLINE_S)
            except (aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
                pass  # the stream ended (or holds): the answer will not come
        if self.ended is not None and not fut.done():
            fut.set_result(None)
        return fut

    def outcome(self, resp: Any) -> tuple[str, str]:
        if resp is None:
            return (f"STREAM_{self.ended}", self.detail) if self.ended else ("NO_ANSWER", "")
        status = resp.response_metadata.status
        return _code(status.code), status.message

    def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()


class ProxyFuzzer:
    def __init__(self, rng: random.Random, address: str, token: str | None, slice_name: str | None = None) -> None:
        self.rng = rng
        self.address = address
        self.token = token
        self.slice_name = slice_name  # a named slice some sessions open on (it must survive them)
        self.p = proto_mod.protocol()
        self.crafter = Crafter(rng, self.p)
        self.gen = Generator(rng)
        self.kinds = request_kinds(self.p)
        self.codes: dict[str, Counter[str]] = {}
        self.bugs: list[str] = []
        self.capped = 0  # answers refusing a list past a cap ("N entries, at most M")
        self.messages: dict[str, str] = {}  # the first message of each kind's each error code
        self.op = 1 << 20
        self.tenants: list[Handles] = []
        self.sessions_opened = 0
        self.unread_written = 0  # requests the never-reading session wrote
        self.unread_ended = False  # whether its stream ended before the run did
        self._host_rpcs = 0  # host_rpc calls made

    # ---- records ----
    def record(self, name: str, code: str, message: str = "") -> None:
        self.codes.setdefault(name, Counter())[code] += 1
        if code not in ("OK", "NO_ANSWER"):
            self.messages.setdefault(f"{name} {code}", message[:160])
        if "entries, at most" in message:
            self.capped += 1
        if code == "UNKNOWN" or "(a bug)" in message:
            self.bugs.append(f"{name}: {code} {message[:300]}")

    def op_id(self) -> int:
        self.op += self.rng.choice([1, 1, 1, 7, 1 << 33])
        return self.op

    # ---- sessions ----
    def header(self, devices: int | None = 1, slice_name: str | None = None, token: str | None = None) -> bytes:
        meta = self.p.GrpcIfrtSessionMetadata()
        meta.version.protocol_version = proto_mod.MAX_PROTOCOL_VERSION
        attrs = meta.initialization_data.attributes
        if token or self.token:
            attrs[TOKEN_KEY].string_value = (token or self.token or "").encode()
        if devices is not None:
            attrs[DEVICES_KEY].int64_value = devices
        if slice_name:
            attrs[SLICE_KEY].string_value = slice_name.encode()
        return bytes(meta.SerializeToString())

    def _hostile_init(self) -> bytes:
        """The token right, the slice and device count any value of any type."""
        meta = self.p.GrpcIfrtSessionMetadata.FromString(self.header(None))
        attrs = meta.initialization_data.attributes
        for key in (SLICE_KEY, DEVICES_KEY):
            value = attrs[key]
            value.CopyFrom(self.gen.hostile(type(value)))
            if value.WhichOneof("value") is None:
                value.string_value = self.rng.choice([b"\xff\xfe", b"", b"x" * 300, b"chaos-named"])
        return bytes(meta.SerializeToString())

    def init_request(self, op_id: int = 1) -> bytes:
        req = self.p.IfrtRequest()
        req.request_metadata.op_id = op_id
        req.init_request.SetInParent()
        return bytes(req.SerializeToString())

    async def open(self, channel: aio.Channel) -> Stream | None:
        named = self.slice_name if self.rng.random() < 0.3 else None
        s = Stream(channel, self.header(None if named else 1, named), self.p)
        resp = await asyncio.wait_for(await s.send(self.init_request(), 1), 30)
        code, message = s.outcome(resp)
        self.record("IfrtSession/open", code, message)
        if code != "OK":
            s.close()
            return None
        s.sid = resp.init_response.session_id
        s.devices = [d.id for d in resp.init_response.all_devices]
        self.sessions_opened += 1
        return s

    async def ask(self, s: Stream, name: str, raw: bytes, op_id: int, wait: float = DEADLINE_S) -> Any:
        fut = await s.send(raw, op_id)
        try:
            resp = await asyncio.wait_for(asyncio.shield(fut), wait)
        except TimeoutError:
            s.waiting.pop(op_id, None)
            resp = None
        code, message = s.outcome(resp)
        self.record(name, code, message)
        return resp

    async def refused(self, channel: aio.Channel) -> None:
        """Sessions the service must refuse, each answering its Init with why."""
        variants: list[tuple[str, bytes | None]] = [
            ("no_header", None), ("undecodable_header", self.gen.garbage()),
            ("hostile_header", self.gen.hostile(self.p.GrpcIfrtSessionMetadata).SerializeToString()),
            ("wrong_token", self.header(token="not-the-token")),
            ("unknown_slice", self.header(None, self.rng.choice(["no-such-slice", "../../etc/passwd", "x" * 4096]))),
            ("devices", self.header(self.rng.choice([0, -1, 10**6, 2**63 - 1]))),
            ("hostile_init_data", self._hostile_init()),
        ]
        for name, header in variants:
            s = Stream(channel, header, self.p)
            resp = await asyncio.wait_for(await s.send(self.init_request(), 1), 30)
            code, message = s.outcome(resp)
            self.record(f"IfrtSession/refused:{name}", code, message)
            s.close()

    async def real(self, s: Stream, name: str, kind: str, fill: Any) -> Any:
        """One well-formed request of `kind` (`fill` fills its body); its answer if it is OK."""
        req = self.p.IfrtRequest()
        req.request_metadata.op_id = self.op_id()
        fill(getattr(req, kind))
        resp = await self.ask(s, f"{name}/{kind}", req.SerializeToString(), req.request_metadata.op_id, 60)
        return resp if resp is not None and not resp.response_metadata.status.code else None

    async def compute(self, s: Stream, own: Handles, name: str, x: bytes, read: bool = True) -> bytes | None:
        """Real work, as the jaxlib client does it: `x` (float32[4]) stored, made an array,
        doubled by a compiled program, and with `read` copied to a host buffer and read back
        (None if a step failed, or not `read`). The handles it made stay, for later requests."""
        host, array, result, back = (own.fresh() for _ in range(4))
        if await self.store(s.sid, host, x, len(x), record=f"{name}/HostBufferStore") != "OK":
            return None
        made = await self.real(s, name, "make_array_from_host_buffer_request",
                               lambda r: fill_make_array(r, self.p, host, array, s.devices[0]))
        compiled = await self.real(s, name, "compile_request", fill_compile)
        self.learn(own, compiled)
        if made is None or compiled is None:
            return None
        own.learn(array)

        def execute(r: Any) -> None:
            r.loaded_executable_handle = compiled.compile_response.loaded_executable_handle
            r.args_handles.append(array)
            r.result_array_handle.append(result)

        self.learn(own, await self.real(s, name, "loaded_executable_execute_request", execute))
        own.learn(result)
        if not read:
            return None
        copied = await self.real(s, name, "copy_to_host_buffer_request",
                                 lambda r: r.MergeFrom(type(r)(array_handle=result, host_buffer_handle=back)))
        if copied is None:
            return None
        lookup = self._channel.unary_stream(BASE + "HostBufferLookup")(
            self.p.GrpcHostBufferLookupRequest(session_id=s.sid, handle=back).SerializeToString(), timeout=30)
        try:
            return b"".join([bytes(self.p.GrpcHostBufferLookupResponse.FromString(m).data) async for m in lookup])
        except aio.AioRpcError as e:
            self.record(f"{name}/HostBufferLookup", _rpc_code(e), e.details() or "")
            return None

    def learn(self, own: Handles, resp: Any) -> None:
        """The handles the server made in an answer (executables, futures, arrays)."""
        if resp is None or resp.response_metadata.status.code:
            return
        stack = [resp]
        while stack:
            m = stack.pop()
            for f, value in m.ListFields():
                if f.message_type is not None:
                    stack.extend(value if f.is_repeated else [value])
                elif "handle" in f.name and isinstance(value, int):
                    own.learn(value)

    # ---- host buffer RPCs ----
    async def store(self, sid: int, handle: int, data: bytes, announced: int, garbage: bool = False,
                    header: bytes | None = None, record: str = "HostBufferStore") -> str:
        meta = self.p.GrpcHostBufferStoreMetadata(session_id=sid, handle=handle, buffer_size=announced)
        raw = header if header is not None else meta.SerializeToString()
        chunks = [self.gen.garbage()] if garbage else [
            self.p.GrpcHostBufferStoreRequest(data=data[i : i + MIB]).SerializeToString()
            for i in range(0, len(data), MIB)]
        try:
            await self._channel.stream_unary(BASE + "HostBufferStore")(
                iter(chunks), metadata=[(proto_mod.HOST_BUFFER_METADATA_HEADER, raw)], timeout=10)
            code = "OK"
        except aio.AioRpcError as e:
            code = _rpc_code(e)
            self.record(record, code, e.details() or "")
            return code
        self.record(record, code)
        return code

    async def host_rpc(self, own: Handles, sid: int) -> None:
        """One HostBufferStore, Lookup, Delete or GetVersion, hostile."""
        rng = self.rng
        sid = rng.choice([sid, sid, sid, rng.getrandbits(64), 0, *(t for t in self._sids[-4:] if t != sid)])
        handle = self.crafter.handle(own, [t for t in self.tenants if t is not own])
        # each kind once first, so that a short run (the quick one: ~15 of these) covers all four
        what = HOST_RPCS[self._host_rpcs] if self._host_rpcs < len(HOST_RPCS) else rng.choice(
            ["store", "store", "lookup", "delete", "version"])
        self._host_rpcs += 1
        if what == "store":
            size = rng.choice([0, 1, 16, 4096, 5 * MIB])
            announced = rng.choice([size, size, size + 1, max(size - 1, 0), -1, 2**63 - 1, 9 << 30, 0])
            header = rng.choice([None] * 8 + [b"", self.gen.garbage()])
            if await self.store(sid, handle, rng.randbytes(size), announced, rng.random() < 0.1,
                                header) == "OK":
                own.host.append(handle)
            return
        try:
            if what == "lookup":
                call = self._channel.unary_stream(BASE + "HostBufferLookup")(
                    self.p.GrpcHostBufferLookupRequest(session_id=sid, handle=handle).SerializeToString()
                    if rng.random() < 0.9 else self.gen.garbage(), timeout=5)
                async for _ in call:
                    pass
            elif what == "delete":
                await self._channel.unary_unary(BASE + "HostBufferDelete")(
                    self.p.GrpcHostBufferDeleteRequest(session_id=sid, handle=handle).SerializeToString()
                    if rng.random() < 0.9 else self.gen.garbage(), timeout=5)
            else:
                await self._channel.unary_unary(BASE + "GetVersion")(
                    self.gen.hostile(self.p.GrpcGetVersionRequest).SerializeToString()
                    if rng.random() < 0.8 else self.gen.garbage(), timeout=5)
            self.record(f"HostBuffer{what.capitalize()}" if what != "version" else "GetVersion", "OK")
        except aio.AioRpcError as e:
            name = f"HostBuffer{what.capitalize()}" if what != "version" else "GetVersion"
            self.record(name, _rpc_code(e), e.details() or "")

    # ---- clients that never read ----
    async def never_reads(self) -> tuple[Stream, Any, asyncio.Future[None]]:
        """A session whose answers are never read (it writes until the service stops reading),
        and a lookup of a staged buffer that is never read."""
        # its own connection, whose window does not grow (no BDP probes): its answers fill it at once
        self._silent_channel = aio.insecure_channel(self.address, options=[("grpc.http2.bdp_probe", 0)])
        s = Stream(self._silent_channel, self.header(1), self.p, read=False)  # nobody reads its answers
        await s.call.write(self.init_request())
        req = self.p.IfrtRequest()
        req.request_metadata.op_id = 2
        req.get_default_layout_request.dims.extend(range(1000))  # answered at once, ~5 KB
        # and 8 KB of an unknown field, which the service parses past: the window its requests
        # wait in fills after fewer of them (what counts is the answers the service holds)
        raw = req.SerializeToString() + b"\xc2\x3e" + wire.uvarint(8 << 10) + bytes(8 << 10)

        async def write() -> None:
            try:
                while True:
                    await s.call.write(raw)
                    self.unread_written += 1
            except (aio.AioRpcError, asyncio.InvalidStateError):
                self.unread_ended = True  # the service ended it: it must not

        writer = asyncio.ensure_future(write())
        lookup = None
        opened = await self.open(self._channel)
        if opened is not None:
            self._held.append(opened)
            if await self.store(opened.sid, 7, self.rng.randbytes(5 * MIB), 5 * MIB, record="never_read/store") == "OK":
                lookup = self._channel.unary_stream(BASE + "HostBufferLookup")(
                    self.p.GrpcHostBufferLookupRequest(session_id=opened.sid, handle=7).SerializeToString())
        return s, lookup, writer

    async def held_back(self) -> bool:
        """Whether the never-reading session's writes stand still (the service stopped reading
        it: its answers wait for a reader that never comes), waiting up to 10 s for that."""
        last, deadline = -1, time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.unread_written == last:
                return True
            last = self.unread_written
            await asyncio.sleep(0.5)
        return False

    # ---- the run ----
    async def session_loop(self, share: int) -> None:
        own = Handles(self.rng.randrange(1, 1 << 30))
        self.tenants.append(own)
        s: Stream | None = None
        sent = 0
        poisoned = False  # sent bytes that may not decode: the service ends the session
        while sent < share:
            if s is None or s.ended is not None or poisoned or self.rng.random() < 0.02:
                poisoned = False
                if s is not None:
                    await self.end(s)
                s = await self.open(self._channel)
                if s is None:
                    await asyncio.sleep(0.1)
                    sent += 1
                    continue
                self._sids.append(s.sid)
                await self.compute(s, own, "setup", bytes(16), read=self.rng.random() < 0.3)
            n = min(self.rng.randint(1, BATCH), share - sent)
            sent += n
            pending = []
            for _ in range(n):
                pick = self.rng.random()
                if pick < 0.15:
                    await self.host_rpc(own, s.sid)
                    continue
                op = self.op_id()
                if pick < 0.16:
                    pending.append(("IfrtSession/undecodable", op, await s.send(self.gen.garbage(), op)))
                    poisoned = True
                    break  # nothing after it is read: the session ends once what it runs is answered
                kind = self.rng.choice(self.kinds)
                others = [t for t in self.tenants if t is not own]
                raw = self.crafter.request(kind, op, own, others, s.devices)
                pending.append((f"IfrtSession/{kind}", op, await s.send(raw, op)))
                if self.crafter.flipped:
                    poisoned = True
                    break
            deadline = time.monotonic() + DEADLINE_S
            for name, op, fut in pending:
                try:
                    resp = await asyncio.wait_for(asyncio.shield(fut), max(deadline - time.monotonic(), 0.001))
                except TimeoutError:
                    s.waiting.pop(op, None)
                    resp = None
                code, message = s.outcome(resp)
                self.record(name, code, message)
                self.learn(own, resp)
        if s is not None:
            await self.end(s)

    async def end(self, s: Stream) -> None:
        """Hung up, or closed (the service answers what is left, then ends the stream)."""
        if self.rng.random() < 0.5:
            try:
                await asyncio.wait_for(s.call.done_writing(), 1)
                await asyncio.wait_for(asyncio.shield(s.reader), 0.5)
            except (TimeoutError, aio.AioRpcError, asyncio.InvalidStateError):
                pass
        s.close()

    async def fresh_session_ok(self) -> bool:
        """A session opened after the fuzz computes right: [1,2,3,4] doubled, read back."""
        s = await self.open(self._channel)
        if s is None:
            return False
        try:
            x = struct.pack("<4f", 1, 2, 3, 4)
            return await self.compute(s, Handles(1000), "fresh", x) == struct.pack("<4f", 2, 4, 6, 8)
        finally:
            await self.end(s)

    async def _run(self, requests: int) -> dict[str, Any]:
        start = time.monotonic()
        self._sids: list[int] = []
        self._held: list[Stream] = []
        options = [("grpc.max_receive_message_length", 64 * MIB), ("grpc.use_local_subchannel_pool", 1)]
        async with aio.insecure_channel(self.address, options=options) as channel:
            self._channel = channel
            await self.refused(channel)
            silent, lookup, writer = await self.never_reads()
            await asyncio.gather(*(self.session_loop(requests // SESSIONS + (i < requests % SESSIONS))
                                   for i in range(SESSIONS)))
            held = await self.held_back()
            unread = {"requests_written": self.unread_written, "writes_held_back": held and not writer.done(),
                      "ended_early": self.unread_ended}
            writer.cancel()
            silent.close()
            await self._silent_channel.close()
            if lookup is not None:
                lookup.cancel()
            for s in self._held:
                s.close()
            fresh = await self.fresh_session_ok()
        sent = sum(sum(c.values()) for c in self.codes.values())
        return {"requests": requests, "answers_recorded": sent, "seconds": round(time.monotonic() - start, 1),
                "sessions_opened": self.sessions_opened,
                "unknown": sum(c.get("UNKNOWN", 0) for c in self.codes.values()),
                "bug_answers": len(self.bugs), "bugs": self.bugs[:10],
                "no_answer": sum(c.get("NO_ANSWER", 0) for c in self.codes.values()),
                "oversized": {"sent": self.crafter.oversized, "refused_at_caps": self.capped},
                "never_reads": unread, "fresh_session_ok": fresh,
                "kinds": {n: dict(c) for n, c in sorted(self.codes.items())},
                "messages": dict(sorted(self.messages.items()))}

    def run(self, requests: int) -> dict[str, Any]:
        return asyncio.run(self._run(requests))
