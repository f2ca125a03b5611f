"""Hostile requests, generated from the protobuf schemas (no dependency beyond protobuf).

Three kinds, as a careless or hostile caller sends them:
- `garbage`: bytes that can never decode (they start with an invalid wire type), then random;
- `hostile`: a well-formed message of the method's type whose fields hold extreme values (huge
  and negative numbers, NaN and infinities, empty, very long, path-like or other tenants' strings,
  unknown enum values, nested messages and repeated fields), chosen field by field from the
  message's descriptor;
- `mutated`: a hostile message serialized, then a few of its bytes flipped (it may or may not
  decode: both must be answered cleanly).

Everything is drawn from one `random.Random`, so a seed repeats a run exactly.
"""

from __future__ import annotations

import math
import random
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

MAX_DEPTH = 3
MAX_REPEATED = 6
MAX_STRING = 4096

_INT32 = [0, 1, -1, 2**31 - 1, -(2**31), 7, 1024, 1025, 50_000]
_INT64 = [*_INT32, 2**63 - 1, -(2**63), 2**40, (1 << 40) | 1]
_UINT32 = [0, 1, 2**32 - 1, 1024, 50_000]
_UINT64 = [0, 1, 2**64 - 1, 2**40, (1 << 40) | 1, (5 << 40) | 3]
_FLOATS = [0.0, -1.0, 1.0, 1e-300, 1e308, -1e308, math.nan, math.inf, -math.inf, 1e9]
_STRINGS = ["", "a", "x" * 129, "y" * MAX_STRING, "../../etc/passwd", "/dev/shm/psm_ring", "bad/name",
            "job:job-victim", "client:c1", "w-a", "a", "\u00e9\u0000\u202e", "' OR 1=1 --", "%s%n", "  ",
            "chaos-named", "job-", "-1", "nan"]


class Generator:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    # ---- the three kinds ----
    def garbage(self) -> bytes:
        n = self.rng.choice([0, 1, 7, 64, 1000])
        return b"\x07\xff\xff\xff\xff\x0f" + self.rng.randbytes(n)

    def hostile(self, cls: type[Message], depth: int = 0) -> Message:
        msg = cls()
        self._fill(msg, msg.DESCRIPTOR, depth)
        return msg

    def mutated(self, cls: type[Message]) -> bytes:
        data = bytearray(self.hostile(cls).SerializeToString())
        if not data:
            return bytes(self.rng.randbytes(4))
        for _ in range(self.rng.randint(1, 4)):
            i = self.rng.randrange(len(data))
            data[i] ^= 1 << self.rng.randrange(8)
        return bytes(data)

    def request(self, cls: type[Message]) -> bytes:
        """One request's bytes, of a kind drawn at random."""
        kind = self.rng.random()
        if kind < 0.3:
            return self.garbage()
        if kind < 0.8:
            return self.hostile(cls).SerializeToString()
        return self.mutated(cls)

    # ---- fields ----
    def _fill(self, msg: Message, desc: Any, depth: int) -> None:
        chosen_oneofs = {o.name: self.rng.choice(o.fields) for o in desc.oneofs if o.fields}
        for f in desc.fields:
            if f.containing_oneof is not None and chosen_oneofs.get(f.containing_oneof.name) is not f:
                continue
            if self.rng.random() < 0.35:
                continue
            if f.is_repeated:
                self._repeated(msg, f, depth)
            elif f.type == FieldDescriptor.TYPE_MESSAGE:
                if depth < MAX_DEPTH:
                    self._fill(getattr(msg, f.name), f.message_type, depth + 1)
                    getattr(msg, f.name).SetInParent()
            else:
                setattr(msg, f.name, self._scalar(f))

    def _repeated(self, msg: Message, f: FieldDescriptor, depth: int) -> None:
        target = getattr(msg, f.name)
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            assert f.message_type is not None
            if f.message_type.GetOptions().map_entry or depth >= MAX_DEPTH:
                return
            for _ in range(self.rng.randint(0, MAX_REPEATED)):
                self._fill(target.add(), f.message_type, depth + 1)
            return
        n = self.rng.choice([0, 1, 2, MAX_REPEATED, 1000 if f.type != FieldDescriptor.TYPE_STRING else 3])
        target.extend(self._scalar(f) for _ in range(n))

    def _scalar(self, f: FieldDescriptor) -> Any:
        t, rng = f.type, self.rng
        if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
            return rng.choice(_INT32)
        if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
            return rng.choice(_INT64)
        if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
            return rng.choice(_UINT32)
        if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
            return rng.choice(_UINT64)
        if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            v = rng.choice(_FLOATS)
            return v if t == FieldDescriptor.TYPE_DOUBLE or not math.isfinite(v) or abs(v) < 3e38 else 3e38
        if t == FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if t == FieldDescriptor.TYPE_ENUM:
            assert f.enum_type is not None
            values = [v.number for v in f.enum_type.values]
            return rng.choice([*values, 99, -1])
        if t == FieldDescriptor.TYPE_STRING:
            return rng.choice(_STRINGS)
        if t == FieldDescriptor.TYPE_BYTES:
            return rng.randbytes(rng.choice([0, 1, 16, 1024]))
        raise TypeError(f"unexpected field type {t} of {f.full_name}")
