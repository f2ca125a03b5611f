"""The fuzz part: hostile requests (messages.py) to every method of the controller and the workers.

Requests go one at a time, each with a short deadline (`DEADLINE_S`), spread evenly over the methods. A few
methods get only bytes that cannot decode, because a well-formed request would legitimately do
what it asks: `Shutdown` (it stops the controller), `SubmitJob` (it runs the script). Others are
kept from legitimate effects on what the run compares before and after: `CreateSlice` is always
a dry run, a registration names an existing host (a takeover attempt) or an invalid name, and
shared-memory names are ones that exist nowhere (this machine is shared).

Worker calls carry a real session credential (a session opened for the fuzz: a hostile tenant
is an authenticated one), so they reach the worker's handlers instead of stopping at its
authentication. Per method it records the status codes and latencies; UNKNOWN from the controller is a bug (its
errors have codes), as is a traceback in its log.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc
from schemas.pathways.v1 import worker_pb2 as wpb

from .messages import Generator

DEADLINE_S = 0.5  # a request unanswered by then counts as DEADLINE_EXCEEDED (waits for ids nobody made)
ONLY_GARBAGE = {"Controller/Shutdown", "Controller/SubmitJob"}
STREAM_MESSAGES = 4  # hostile messages per request stream


@dataclass
class MethodStats:
    sent: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {"sent": self.sent, "codes": dict(self.codes),
                "p50_ms": round(1000 * statistics.median(lat), 2) if lat else None,
                "max_ms": round(1000 * lat[-1], 2) if lat else None}


class Fuzzer:
    def __init__(self, rng: random.Random, controller: str, workers: list[str], hosts: list[str],
                 token: str | None = None) -> None:
        self.gen = Generator(rng)
        # a hostile token holder: the token gets its requests past the check to the handlers
        self._auth: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.rng = rng
        self.hosts = hosts  # real host names: registrations under them are takeover attempts
        self.targets: list[tuple[str, str, MethodDescriptor, Any]] = []
        self._channels: list[grpc.Channel] = []
        for service, module, addresses in (("Controller", cpb, [controller]), ("Worker", wpb, workers)):
            for address in addresses:
                channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                self._channels.append(channel)
                for m in module.DESCRIPTOR.services_by_name[service].methods:
                    self.targets.append((f"{service}/{m.name}", address, m, channel))
        self.stats: dict[str, MethodStats] = {}
        self._stop = threading.Event()
        self.worker_metadata = self._open_session(controller)

    def _open_session(self, controller: str) -> tuple[tuple[str, str], ...]:
        """A session of our own, held open for the run: its credential for the worker calls."""
        channel = grpc.insecure_channel(controller)
        self._channels.append(channel)

        def hello() -> Iterator[cpb.ClientMessage]:
            yield cpb.ClientMessage(hello=cpb.Hello(client_name="chaos-fuzz"))
            self._stop.wait()

        self._session = cgrpc.ControllerStub(channel).Session(hello(), metadata=self._auth)
        welcome = next(iter(self._session)).welcome
        credential = getattr(welcome, "worker_credential", "")
        return self._auth + ((("x-pathways-session", credential),) if credential else ())

    def close(self) -> None:
        self._stop.set()
        self._session.cancel()
        for ch in self._channels:
            ch.close()

    # ---- one request ----
    def _cls(self, m: MethodDescriptor) -> type[Message]:
        module = cpb if m.input_type.file.name.endswith("controller.proto") else wpb
        cls = getattr(module, m.input_type.name, None) or getattr(pb, m.input_type.name)
        return cls

    def _message(self, name: str, m: MethodDescriptor) -> bytes:
        cls = self._cls(m)
        if name in ONLY_GARBAGE:
            return self.gen.garbage()
        kind = self.rng.random()
        if kind < 0.3:
            return self.gen.garbage()
        msg = self.gen.hostile(cls)
        self._tame(name, msg)
        if kind < 0.85 or name == "Controller/CreateSlice":
            return msg.SerializeToString()
        data = bytearray(msg.SerializeToString())
        for _ in range(self.rng.randint(1, 3)):
            if data:
                i = self.rng.randrange(len(data))
                data[i] ^= 1 << self.rng.randrange(8)
        return bytes(data)

    def _tame(self, name: str, msg: Any) -> None:
        """Keeps a hostile message from legitimate effects (module docstring)."""
        if name == "Controller/CreateSlice":
            msg.dry_run = True
        elif name == "Controller/WorkerConnect" and msg.WhichOneof("msg") == "register":
            msg.register.name = self.rng.choice([*self.hosts, "bad/name", "", "x" * 200])
        elif name in ("Controller/DeleteSlice", "Controller/DeleteHost", "Controller/DeleteIsland",
                      "Controller/CancelJob"):
            for f in ("name", "id"):
                if hasattr(msg, f):
                    setattr(msg, f, f"fuzz-{self.rng.randrange(10**6)}")
        for arr in _arrays(msg):
            if arr.shm_name:
                arr.shm_name = f"pw-chaos-none-{self.rng.randrange(10**9)}"

    def _stream(self, name: str, m: MethodDescriptor) -> Iterator[bytes]:
        for _ in range(STREAM_MESSAGES):
            yield self._message(name, m)

    def send(self, name: str, m: MethodDescriptor, channel: grpc.Channel) -> str:
        path = f"/pathways.v1.{name}"
        md = self.worker_metadata if name.startswith("Worker/") else self._auth
        try:
            if not m.client_streaming and not m.server_streaming:
                channel.unary_unary(path)(self._message(name, m), timeout=DEADLINE_S, metadata=md)
            elif m.client_streaming and not m.server_streaming:
                channel.stream_unary(path)(self._stream(name, m), timeout=DEADLINE_S, metadata=md)
            else:
                request = self._stream(name, m) if m.client_streaming else self._message(name, m)
                call = (channel.stream_stream(path) if m.client_streaming else channel.unary_stream(path))(
                    request, timeout=DEADLINE_S, metadata=md)
                try:
                    next(iter(call), None)  # the first answer, then hang up
                finally:
                    call.cancel()
            return "OK"
        except grpc.RpcError as e:
            code = e.code()
            return code.name if code is not None else "NONE"

    # ---- the run ----
    def run(self, requests: int) -> dict[str, Any]:
        start = time.monotonic()
        for i in range(requests):
            name, _address, m, channel = self.targets[i % len(self.targets)]
            t0 = time.monotonic()
            code = self.send(name, m, channel)
            st = self.stats.setdefault(name, MethodStats())
            st.sent += 1
            st.codes[code] += 1
            st.latencies.append(time.monotonic() - t0)
        unknown = sum(s.codes.get("UNKNOWN", 0) for n, s in self.stats.items() if n.startswith("Controller/"))
        return {"requests": requests, "seconds": round(time.monotonic() - start, 1),
                "controller_unknown": unknown,
                "worker_unknown": sum(s.codes.get("UNKNOWN", 0) for n, s in self.stats.items()
                                      if n.startswith("Worker/")),
                "deadline_exceeded": sum(s.codes.get("DEADLINE_EXCEEDED", 0) for s in self.stats.values()),
                "methods": {n: s.summary() for n, s in sorted(self.stats.items())}}


def _arrays(msg: Message) -> Iterator[Any]:
    """Every ArrayProto inside `msg` (to neutralise shared-memory names)."""
    if isinstance(msg, pb.ArrayProto):
        yield msg
        return
    for f, value in msg.ListFields():
        if f.message_type is None:
            continue
        for v in (value if f.is_repeated else [value]):
            if isinstance(v, Message):
                yield from _arrays(v)
