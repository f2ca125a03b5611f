"""Hostile IFRT proxy requests (proxyfuzz.py), built from the protocol's own descriptors (the
installed jaxlib's, server/proxy/protocol.py) with messages.py's Generator, then aimed: handle
fields name handles the tenant's session holds, handles of its other sessions, fresh ones and
random 64-bit numbers; a Compile carries a real StableHLO program, one with flipped bytes, or
garbage; a MakeArray names bytes the session stored whose size disagrees with its dtype and shape
(or agrees), and extreme shapes and dtypes the Generator draws. Now and then one repeated field
(a handle, device, shard or stride list, a list of specs or mappings) is made far longer than the
server's caps (handles.MAX_HANDLES, the session's devices, shardings.MAX_RANK): each must be
refused before its entries are looked at.
"""

from __future__ import annotations

import random
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from server.proxy import protocol as proto_mod
from server.proxy import shardings as sh
from server.proxy.handles import MAX_HANDLES, HandleTable

from .messages import _UINT64, Generator

Message = Any  # the protocol's classes are built at run time: no static type
XLA_PROGRAM = "xla::ifrt::XlaProgram"
_HANDLE_TYPES = (FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT64)
_SESSION_HANDLES = HandleTable().limit
_DTYPES = ("KIND_F32", "KIND_S32", "KIND_U8", "KIND_BF16", "KIND_PRED", "KIND_C128", "KIND_F64")


def request_kinds(p: proto_mod.Protocol) -> tuple[str, ...]:
    """Every kind of IfrtRequest (the fields of its `request` oneof)."""
    return tuple(f.name for f in p.IfrtRequest.DESCRIPTOR.oneofs_by_name["request"].fields)


_module: bytes | None = None


def stablehlo_module() -> bytes:
    """A real program as the jaxlib client compiles it: `x * 2` on a float32[4], a StableHLO
    portable artifact (what an `xla::ifrt::XlaProgram` carries)."""
    global _module
    if _module is None:
        import jax
        import numpy as np
        from jax._src.lib import _jax

        text = jax.jit(lambda x: x * 2).lower(np.ones(4, np.float32)).as_text()
        _module = bytes(_jax.mlir.serialize_portable_artifact(text, "1.0.0"))
    return _module


def fill_make_array(r: Message, p: proto_mod.Protocol, host: int, array: int, device: int) -> None:
    """A MakeArrayFromHostBufferRequest as the client sends it: float32[4] on one device."""
    r.dtype.kind = p.cls("xla.ifrt.DTypeProto").Kind.Value("KIND_F32")
    r.shape.dims.append(4)
    sh.to_proto(sh.Sharding((device,)), r.sharding, p)
    r.host_buffer_handle, r.array_handle = host, array


def fill_compile(r: Message) -> None:
    """A CompileRequest as the client sends it (`stablehlo_module`, default options)."""
    r.program.type_name = XLA_PROGRAM
    r.program.data = stablehlo_module()


class Handles:
    """What one fuzz session knows: handles it holds (arrays, executables, futures; the server's
    and its own), host buffers it stored, and the next fresh handle it would pick."""

    def __init__(self, start: int) -> None:
        self.known: list[int] = []
        self.host: list[int] = []
        self.next = start

    def fresh(self) -> int:
        self.next += 1
        return self.next

    def learn(self, handle: int) -> None:
        if handle and handle not in self.known:
            self.known.append(handle)
            del self.known[:-200]  # bounded: the newest


class Crafter:
    """Builds serialized hostile IfrtRequests of a given kind for a session (`request`)."""

    def __init__(self, rng: random.Random, p: proto_mod.Protocol) -> None:
        self.rng = rng
        self.gen = Generator(rng)
        self.p = p
        kind_enum = p.cls("xla.ifrt.DTypeProto").DESCRIPTOR.fields_by_name["kind"].enum_type
        self._dtype_numbers = [kind_enum.values_by_name[k].number for k in _DTYPES]
        self.flipped = False  # whether the last request's bytes were flipped
        self.oversized = 0  # requests with a list made past the caps (`oversize`)

    # ---- handles ----
    def handle(self, own: Handles, others: list[Handles]) -> int:
        r = self.rng.random()
        if r < 0.45 and own.known:
            return self.rng.choice(own.known)
        if r < 0.6 and own.host:
            return self.rng.choice(own.host)
        if r < 0.72:
            pool = [h for o in others for h in o.known]
            if pool:
                return self.rng.choice(pool)
        if r < 0.87:
            return own.fresh()
        return self.rng.choice([*_UINT64, self.rng.getrandbits(64), 1 << 62, (1 << 62) + 1])

    def aim(self, msg: Message, own: Handles, others: list[Handles], devices: list[int] | None = None,
            depth: int = 0) -> None:
        """Every handle field in `msg` (nested ones too) names a handle drawn by `handle`. With
        `devices` (a plausible request, to reach past the first checks), shardings are one of
        them, dtypes real, shapes small and device ids theirs."""
        for f in msg.DESCRIPTOR.fields:
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                if depth >= 3 or f.message_type.GetOptions().map_entry:
                    continue
                for sub in (getattr(msg, f.name) if f.is_repeated else
                            [getattr(msg, f.name)] if msg.HasField(f.name) else []):
                    if devices and self._plausible(sub, devices):
                        continue
                    self.aim(sub, own, others, devices, depth + 1)
            elif "handle" in f.name and f.type in _HANDLE_TYPES:
                if f.is_repeated:
                    field = getattr(msg, f.name)
                    del field[:]
                    field.extend(self.handle(own, others) for _ in range(self.rng.choice([0, 1, 1, 2, 3])))
                elif self.rng.random() < 0.9:
                    setattr(msg, f.name, self.handle(own, others))
            elif devices and f.name in ("device_ids", "devices") and f.is_repeated:
                field = getattr(msg, f.name)
                del field[:]
                field.extend(self.rng.choice(devices) for _ in range(self.rng.choice([1, 1, 2])))

    def _plausible(self, m: Message, devices: list[int]) -> bool:
        """Makes a sharding, dtype or shape message a plausible one (True), else leaves it (False)."""
        name = m.DESCRIPTOR.full_name
        if name == "xla.ifrt.ShardingProto":
            m.Clear()
            sh.to_proto(sh.Sharding((self.rng.choice(devices),)), m, self.p)
        elif name == "xla.ifrt.DTypeProto":
            m.kind = self.rng.choice(self._dtype_numbers)
        elif name == "xla.ifrt.ShapeProto":
            m.Clear()
            m.dims.extend(self.rng.choice([(4,), (1,), (2, 2), ()]))
        else:
            return False
        return True

    # ---- requests ----
    def request(self, kind: str, op_id: int, own: Handles, others: list[Handles], devices: list[int]) -> bytes:
        req = self.p.IfrtRequest()
        sub = getattr(req, kind)
        sub.CopyFrom(self.gen.hostile(type(sub), depth=1))
        sub.SetInParent()
        self.aim(sub, own, others, devices if self.rng.random() < 0.6 else None)
        if kind == "compile_request" and self.rng.random() < 0.7:
            self._compile(sub)
        elif kind == "make_array_from_host_buffer_request" and self.rng.random() < 0.5:
            self._make_array(sub, own, devices)
        elif kind == "get_default_layout_request" and self.rng.random() < 0.2:
            sub.dims.extend(range(self.rng.choice([5000, 100_000])))  # past MAX_RANK: work one request asks
        if self.rng.random() < 0.08 and self.oversize(sub, own) is not None:
            self.oversized += 1
        if self.rng.random() < 0.5:  # the rest of the metadata stays hostile
            req.request_metadata.Clear()
        req.request_metadata.op_id = op_id
        data = req.SerializeToString()
        self.flipped = self.rng.random() < 0.03
        if self.flipped:  # flipped bytes: it may or may not decode (the session may end)
            b = bytearray(data)
            for _ in range(self.rng.randint(1, 3)):
                i = self.rng.randrange(len(b))
                b[i] ^= 1 << self.rng.randrange(8)
            data = bytes(b)
        return data

    def oversize(self, sub: Message, own: Handles) -> str | None:
        """Makes one repeated field of `sub` (or of a message in it) longer than any cap: a handle
        list past MAX_HANDLES (or the session's handle limit), any other list by thousands (devices,
        shard indices, strides, intervals, specs, mappings). Returns the field's name (None: the
        request has none)."""
        fields: list[tuple[Message, Any]] = []

        def walk(m: Message, depth: int) -> None:
            for f in m.DESCRIPTOR.fields:
                if f.is_repeated and not (f.message_type and f.message_type.GetOptions().map_entry):
                    fields.append((m, f))
                elif f.type == FieldDescriptor.TYPE_MESSAGE and depth < 3 and not f.is_repeated:
                    walk(getattr(m, f.name), depth + 1)

        walk(sub, 0)
        if not fields:
            return None
        m, f = self.rng.choice(fields)
        field = getattr(m, f.name)
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            for _ in range(self.rng.choice([5000, MAX_HANDLES + 1])):
                field.add()
        elif "handle" in f.name and f.type in _HANDLE_TYPES:
            start = own.fresh()
            # past MAX_HANDLES, and now and then past a session's handle limit (DestructArray's cap)
            field.extend(range(start, start + self.rng.choice([MAX_HANDLES + 1, 100_000, _SESSION_HANDLES + 1])))
        elif f.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            field.extend([b"" if f.type == FieldDescriptor.TYPE_BYTES else ""] * 5000)
        elif f.type in (FieldDescriptor.TYPE_BOOL, FieldDescriptor.TYPE_ENUM):
            return None
        else:
            field.extend([self.rng.choice([0, 1])] * self.rng.choice([5000, 100_000]))
        return f.name

    def _compile(self, r: Message) -> None:
        module = stablehlo_module()
        r.ClearField("host_callbacks")
        r.program.type_name = XLA_PROGRAM if self.rng.random() < 0.85 else self.rng.choice(["", "xla::ifrt::Hlo"])
        pick = self.rng.random()
        if pick < 0.4:
            r.program.data = module  # real: compiled on a worker, a real executable handle
        elif pick < 0.7:
            b = bytearray(module)
            for _ in range(self.rng.randint(1, 8)):
                i = self.rng.randrange(len(b))
                b[i] ^= 1 << self.rng.randrange(8)
            r.program.data = bytes(b)
        elif pick < 0.85:
            r.program.data = module[: self.rng.randrange(len(module))]
        else:
            r.program.data = self.gen.garbage()
        if self.rng.random() < 0.6:
            r.compile_options.data = b""

    def _make_array(self, m: Message, own: Handles, devices: list[int]) -> None:
        """A MakeArray that reads like the client's: a real dtype, a small shape, a one-device
        sharding, naming a host buffer the session stored (whose size may disagree)."""
        m.ClearField("byte_strides")
        m.ClearField("layout")
        m.dtype.Clear()
        m.dtype.kind = self.rng.choice(self._dtype_numbers)
        m.shape.Clear()
        m.shape.dims.extend(self.rng.choice([(4,), (), (2, 2), (1,), (0,), (3, 5), (1 << 20,)]))
        m.sharding.Clear()
        device = self.rng.choice(devices) if devices and self.rng.random() < 0.9 else self.rng.choice([7, 2**31 - 1])
        sh.to_proto(sh.Sharding((device,)), m.sharding, self.p)
        if own.host and self.rng.random() < 0.8:  # taken by the MakeArray, whatever its answer
            m.host_buffer_handle = own.host.pop(self.rng.randrange(len(own.host)))
