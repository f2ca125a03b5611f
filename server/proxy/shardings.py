"""The shardings IFRT proxy clients send, read exactly: which devices, and which index domain of
the global array each device's shard holds.

Shardings arrive as `xla.ifrt.ShardingProto{Serialized{type_name, data}}` (requirement 8 in
docs/facts.md): `xla::ifrt::SingleDeviceSharding` (one device, the whole array),
`xla::ifrt::HloSharding` (devices + an `xla.OpSharding`; shard i is on `devices[i]`), and, in
RemapArrays plans, `xla::ifrt::ConcreteEvenSharding` (only its fully replicated form has a known
domain per shard). A shard's domain comes from XLA's own rule (`op_sharding_to_indices`), the one
JAX uses to place shards, so nothing is guessed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from .handles import HandleError

Message = Any
Index = tuple[slice, ...]

# The dimensions a shape may have: far above any array's (NumPy allows 64), and a bound on the work
# one request asks of the event loop (a GetDefaultLayout of 20 million dimensions, 74 MiB, held
# every other session's answers 8 s: the proxy fuzz)
MAX_RANK = 4096
SINGLE_DEVICE = "xla::ifrt::SingleDeviceSharding"
HLO = "xla::ifrt::HloSharding"
CONCRETE_EVEN = "xla::ifrt::ConcreteEvenSharding"


def shape_of(dims: Any, what: str = "a shape") -> tuple[int, ...]:
    """A ShapeProto's dims as a tuple; INVALID_ARGUMENT past `MAX_RANK` dimensions."""
    if len(dims) > MAX_RANK:
        raise HandleError("INVALID_ARGUMENT", f"{what} of {len(dims)} dimensions: at most {MAX_RANK}")
    return tuple(int(d) for d in dims)


@dataclass(frozen=True)
class Sharding:
    """A sharding over `devices` (client device ids, shard order). `op_sharding`: serialized
    `xla.OpSharding` bytes, or None for the whole array on every device (single device or
    fully replicated)."""

    devices: tuple[int, ...]
    op_sharding: bytes | None = None
    # the shards' domains when no OpSharding says them (a RemapArrays output); () : not known
    explicit: tuple[Index, ...] | None = None

    @property
    def single(self) -> bool:
        return len(self.devices) == 1

    def domains(self, shape: tuple[int, ...]) -> list[Index]:
        """The index domain of each device's shard, in device order."""
        full = tuple(slice(0, d) for d in shape)
        if self.explicit is not None:
            if not self.explicit:
                raise HandleError("UNIMPLEMENTED", "an array whose shards' places are not known (a "
                                  "ConcreteEvenSharding that is not fully replicated) is not supported by the "
                                  "Pathways IFRT proxy")
            return list(self.explicit)
        if self.op_sharding is None:
            return [full] * len(self.devices)
        from jax._src import op_shardings
        from jax._src.lib import xla_client as xc

        op = xc.OpSharding()
        op.ParseFromString(self.op_sharding)
        hlo = xc.HloSharding.from_proto(op)
        if hlo.is_replicated():
            return [full] * len(self.devices)
        out = []
        for idx in op_shardings.op_sharding_to_indices(hlo, shape, len(self.devices)):
            out.append(tuple(slice(s.start or 0, d if s.stop is None else s.stop) for s, d in zip(idx, shape,
                                                                                             strict=True)))
        return out

    @property
    def tiled(self) -> bool:
        """Whether its OpSharding is a plain tiling (replicated on its last tile dimension at
        most: no manual or other subgroups), which a worker can hold a part of as a NamedSharding
        (server/worker/parts.py `uploaded_part`)."""
        return self.op_sharding is not None and _is_plain_tiling(self.op_sharding)

    def with_devices(self, devices: tuple[int, ...]) -> Sharding:
        if len(devices) != len(self.devices):
            raise HandleError("INVALID_ARGUMENT", f"{len(devices)} devices for a sharding over {len(self.devices)}")
        return Sharding(devices, self.op_sharding, self.explicit)


@functools.lru_cache(maxsize=256)
def _is_plain_tiling(op_sharding: bytes) -> bool:
    """`Sharding.tiled` of a serialized OpSharding: parsed once per distinct sharding (a client
    uploads with the same few shardings over and over)."""
    from jax._src.lib import xla_client as xc

    op = xc.OpSharding()
    op.ParseFromString(op_sharding)
    hlo = xc.HloSharding.from_proto(op)
    return bool(hlo.is_tiled() and not hlo.subgroup_types())


def index_shape(index: Index) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in index)


def parse(sharding: Message, proto: Any, known: set[int]) -> Sharding:
    """A client's ShardingProto; HandleError for kinds this server does not read or bad devices."""
    serialized = sharding.serialized_sharding
    kind = serialized.type_name
    try:
        if kind == SINGLE_DEVICE:
            out = Sharding((int(proto.cls("xla.ifrt.SingleDeviceShardingProto").FromString(serialized.data)
                                .device_id),))
        elif kind == HLO:
            hlo = proto.cls("xla.ifrt.HloShardingProto").FromString(serialized.data)
            _few_devices(hlo.devices.device_ids, kind, known)
            devices = tuple(int(d) for d in hlo.devices.device_ids)
            op = hlo.xla_op_sharding
            # a tile per device at most (XLA would build every tile the assignment names)
            if len(op.tile_assignment_dimensions) > MAX_RANK + 1 or math.prod(op.tile_assignment_dimensions) > max(
                    len(devices), 1) or len(op.tile_assignment_devices) > len(devices):
                raise HandleError("INVALID_ARGUMENT", f"{kind}: a tile assignment of more tiles than its "
                                  f"{len(devices)} devices")
            replicated = op.type in (0, 1) and not op.tile_assignment_dimensions  # REPLICATED, MAXIMAL
            out = Sharding(devices, None if replicated or len(devices) == 1 else bytes(op.SerializeToString()))
        elif kind == CONCRETE_EVEN:
            even = proto.cls("xla.ifrt.ConcreteEvenShardingProto").FromString(serialized.data)
            _few_devices(even.devices.device_ids, kind, known)
            devices = tuple(int(d) for d in even.devices.device_ids)
            out = Sharding(devices, None, None if even.is_fully_replicated or len(devices) == 1 else
                           _even_domains(shape_of(even.shape.dims), shape_of(even.shard_shape.dims), len(devices)))
        else:
            raise HandleError("UNIMPLEMENTED", f"sharding {kind or '(none)'} is not supported by the Pathways IFRT "
                              "proxy server (single-device and HLO shardings are)")
    except HandleError:
        raise
    except Exception:
        raise HandleError("INVALID_ARGUMENT", f"undecodable {kind}") from None
    if not out.devices or len(set(out.devices)) != len(out.devices):
        raise HandleError("INVALID_ARGUMENT", f"a sharding over devices {list(out.devices)}")
    if not set(out.devices) <= known:
        raise HandleError("INVALID_ARGUMENT", f"devices {sorted(set(out.devices) - known)} are not the session's")
    return out


def _few_devices(ids: Any, kind: str, known: set[int]) -> None:
    """A sharding names each of the session's devices once at most: longer lists are refused
    before they are read."""
    if len(ids) > len(known):
        raise HandleError("INVALID_ARGUMENT", f"{kind}.devices.device_ids: {len(ids)} entries, at most "
                          f"{len(known)} (the session's devices)")


def _even_domains(shape: tuple[int, ...], shard: tuple[int, ...], n: int) -> tuple[Index, ...]:
    """The shards' domains of an even sharding when its shapes say them: split along one dimension
    into as many blocks as devices, in device order. () when they do not (a RemapArrays plan then
    takes them from its inputs)."""
    split = [i for i, (d, s) in enumerate(zip(shape, shard, strict=False)) if d != s]
    if len(shape) != len(shard) or len(split) != 1 or shard[split[0]] * n != shape[split[0]]:
        return ()
    k, size = split[0], shard[split[0]]
    return tuple(tuple(slice(t * size, (t + 1) * size) if i == k else slice(0, d) for i, d in enumerate(shape))
                 for t in range(n))


def to_proto(sharding: Sharding, out: Message, proto: Any) -> None:
    """Fills a ShardingProto: SingleDeviceSharding for one device, HloSharding otherwise."""
    s = out.serialized_sharding
    if sharding.single:
        s.type_name = SINGLE_DEVICE
        s.data = proto.cls("xla.ifrt.SingleDeviceShardingProto")(device_id=sharding.devices[0]).SerializeToString()
        return
    hlo = proto.cls("xla.ifrt.HloShardingProto")()
    hlo.devices.device_ids.extend(sharding.devices)
    if sharding.op_sharding is None:
        hlo.xla_op_sharding.type = 0  # REPLICATED
    else:
        hlo.xla_op_sharding.ParseFromString(sharding.op_sharding)
    s.type_name = HLO
    s.data = hlo.SerializeToString()


def op_sharding_proto(sharding: Sharding, proto: Any) -> Message:
    """The sharding's `xla.OpSharding` message (replicated when None)."""
    op = proto.cls("xla.OpSharding")()
    if sharding.op_sharding is None:
        op.type = 0
    else:
        op.ParseFromString(sharding.op_sharding)
    return op


def from_hlo_text(text: str | None) -> bytes | None:
    """Serialized OpSharding of an `mhlo.sharding` attribute, None when absent or replicated."""
    if not text:
        return None
    from jax._src.lib import xla_client as xc

    hlo = xc.HloSharding.from_string(text)
    if hlo.is_replicated():
        return None
    return bytes(hlo.to_proto().SerializeToString())


def replicated_none(op_sharding: bytes) -> bytes | None:
    """A serialized `xla.OpSharding`, None when it is replicated (as `Sharding.op_sharding` holds it)."""
    from jax._src.lib import xla_client as xc

    op = xc.OpSharding()
    op.ParseFromString(op_sharding)
    return None if xc.HloSharding.from_proto(op).is_replicated() else op_sharding
