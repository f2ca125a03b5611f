"""Compiling a function ahead of its first run, for a caller that needs what XLA decided.

A run compiles its nodes' functions on first use (segments.py, `Runners.node_executables`);
`Compile` (the Worker RPC) does the same earlier, into the same executable cache under the same
key (function id, devices, donation), so the first run finds it compiled. What it answers is the
compiled output shardings: for a result whose sharding the function leaves to XLA's sharding
propagation, only a compile knows it (the IFRT proxy reports them to its clients:
server/proxy/cluster_backend.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from schemas.pathways.v1 import worker_pb2 as wpb

from .executable import Executable
from .segments import Runners

MAX_FUNCTION_BYTES = 64 << 20


def hlo_sharding(sharding: Any, ndim: int, devices: Sequence[Any]) -> bytes:
    """`sharding` as a serialized xla.OpSharding whose device numbers are positions in `devices`."""
    hlo = sharding._to_xla_hlo_sharding(ndim)
    own = tuple(sharding._device_assignment)
    if own == tuple(devices) or hlo.is_replicated():
        return bytes(hlo.to_proto().SerializeToString())
    # the same devices in another order: renumber the tiles' devices
    position = {d.id: k for k, d in enumerate(devices)}
    if set(position) != {d.id for d in own}:
        raise ValueError(f"an output on devices {[d.id for d in own]}, not the function's {list(position)}")
    op = hlo.to_proto()
    tiles = [position[own[t].id] for t in hlo.tile_assignment_devices()]
    op.iota_reshape_dims, op.iota_transpose_perm, op.tile_assignment_devices = [], [], tiles
    return bytes(op.SerializeToString())


def compile_function(runners: Runners, request: wpb.CompileRequest) -> wpb.CompileReply:
    """(a thread) Compiles `request.function` for its devices; its output shardings, or why not."""
    blob = request.function
    if not blob.exported or len(blob.exported) > MAX_FUNCTION_BYTES:
        return wpb.CompileReply(error=f"a function of {len(blob.exported)} bytes (1 to {MAX_FUNCTION_BYTES})")
    if hashlib.sha256(blob.exported).hexdigest() != blob.function_id:
        return wpb.CompileReply(error=f"function {blob.name or '?'}: its bytes do not match its id")
    numbers = list(request.local_devices)
    group = runners.group
    if request.group_generation:  # group-wide numbers (server/worker/group.py)
        if request.group_generation != group.generation:
            return wpb.CompileReply(error=f"a function for island group generation {request.group_generation}, "
                                    f"this worker is in generation {group.generation}")
        numbers = [group.local_device_number(n) if n >= 0 else n for n in numbers]
    elif not all(0 <= n < len(runners.devices) for n in numbers):
        numbers = []
    if not numbers or len(set(numbers)) != len(numbers) or min(numbers) < 0:
        return wpb.CompileReply(error=f"devices {list(request.local_devices)}: not distinct devices of this worker "
                                f"(0..{len(runners.devices) - 1})")
    try:
        devices = [group.device(n, runners.devices) for n in numbers]
    except (ValueError, IndexError) as e:
        return wpb.CompileReply(error=f"devices {list(request.local_devices)}: {e}")
    try:
        ex: Executable = runners.cache.get_or_compile(blob.function_id, blob.exported, devices, tuple(blob.donate))
        out = [hlo_sharding(s, len(a.shape), ex.devices) for s, a in zip(ex.out_shardings, ex.out_avals,
                                                                         strict=True)]
    except Exception as e:
        return wpb.CompileReply(error=f"cannot compile {blob.name or blob.function_id[:12]}: "
                                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return wpb.CompileReply(out_shardings=out)
