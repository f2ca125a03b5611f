"""Compiling a proxy client's program on the slice's worker at Compile time.

The controller never compiles (modules.py only reads the module). A result whose sharding the
module leaves to XLA's sharding propagation has the sharding only a compile decides, and the
client must be told it at Compile time (LoadedExecutableMetadata, the arrays an Execute
returns). So the proxy asks the slice's worker to compile the function now (the Worker RPC
`Compile`, server/worker/compiling.py), into the executable cache its runs use, and reports the
compiled output shardings. A compile error then surfaces at the client's compile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

from .backend import BackendError
from .host_watch import HostWatch
from .shardings import replicated_none

COMPILE_S = 600.0  # the longest a worker may take to compile a program


async def compile_on_worker(stub: wgrpc.WorkerStub, metadata: Sequence[tuple[str, str]], address: str,
                            blob: wpb.FunctionBlob, local_devices: Sequence[int],
                            num_outputs: int, group_generation: int = 0,
                            watch: HostWatch | None = None) -> tuple[bytes | None, ...]:
    """The compiled output shardings of `blob` on the worker's `local_devices` (group-wide numbers
    of island group `group_generation` on a slice spanning hosts; serialized xla.OpSharding over
    them in order; None: replicated). BackendError if it does not compile; `watch`: also once the
    worker's host is lost (host_watch.py)."""
    request = wpb.CompileRequest(function=blob, local_devices=list(local_devices), group_generation=group_generation)
    try:
        call = stub.Compile(request, metadata=metadata, timeout=COMPILE_S)
        doing = f"compiling {blob.name} on"
        reply: Any = await (watch.unless_lost(address, call, doing) if watch is not None else call)
    except grpc.RpcError as e:
        raise BackendError("UNAVAILABLE", f"compiling {blob.name} on worker {address} failed: {e.details()}") from None
    if reply.error:
        raise BackendError("INVALID_ARGUMENT", reply.error)
    if len(reply.out_shardings) != num_outputs:
        raise BackendError("INTERNAL", f"worker {address} compiled {blob.name} with {len(reply.out_shardings)} "
                           f"outputs, the module has {num_outputs}")
    return tuple(replicated_none(b) for b in reply.out_shardings)
