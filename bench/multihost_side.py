"""The processes of the multi-host benchmarks (bench/multihost.py), each run inside one namespace
host as `python -m bench.multihost_side TASK JSON`. Served tasks print one JSON line when ready,
then one per request line read from stdin (so that the driver can alternate their windows); the
others print one JSON line at the end.

- `tcp_recv` / `tcp_send`: raw TCP, the baseline of the transfer row: on each "go" the receiver
  asks the sender (one byte) for NBYTES and times their arrival into a preallocated buffer.
- `transfer_pw`: a Pathways client. The transfer: NBYTES made on island a (host A) and waited
  for, then a computation reading them timed on island b (host B: moved worker to worker) and on
  island a (read in place). For context: a program that makes NBYTES on island a and a second
  computation takes them on island b or on island a; and the same two programs keeping the NBYTES
  as an output (so that both write them).
- `pipeline`: the pipeline suite's 4 stages (islands a and b) against the same stages in one
  plain-JAX process (`bench.jaxrun pipeline_serve`), windows alternating; `pipeline_pw`: its
  Pathways side alone, served for bench.pw_ab_multihost.
- `psum_member`: one process of a plain multi-controller `jax.distributed` group (gloo advertised
  at the host's own address, docs/multihost.md section 3), a blocking psum per call.
- `psum_pw`: the same psum through `pw.pmap` over a 4-device slice of island `pod`.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


# ------------------------------------------------------------------------------------- raw TCP


def tcp_recv(ip: str, nbytes: int) -> None:
    """Listens on `ip`; prints {"port"}, then {"ready"} once the sender is connected; for each
    line "go" on stdin, {"s": seconds from the request to the last of NBYTES received}."""
    server = socket.create_server((ip, 0))
    _say({"port": server.getsockname()[1]})
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    _say({"ready": True})
    for line in sys.stdin:
        if line.strip() != "go":
            break
        t0 = time.perf_counter()
        conn.sendall(b"g")
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], nbytes - got)
            if n == 0:
                raise RuntimeError("the sender closed the connection")
            got += n
        _say({"s": time.perf_counter() - t0})
    conn.close()


def tcp_send(ip: str, port: int, nbytes: int) -> None:
    """Connects to the receiver; sends NBYTES (the same buffer each time) per byte it receives."""
    data = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    conn = socket.create_connection((ip, port), timeout=60)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while conn.recv(1):
        conn.sendall(data)
    conn.close()


# ------------------------------------------------------------------------------ Pathways transfer


def transfer_pw(nbytes: int) -> None:
    """Prints {"ready"} once every variant ran once; for each line "go R", runs each variant R
    times, taking turns, each call blocking until its (1-element) result is back, and prints
    their median seconds: "moved" / "in_place" (a materialised array read on island b / a),
    "across" / "local" (the program making and reading it), "across_kept" / "local_kept"."""
    import jax.numpy as jnp
    import numpy as np

    import pwctl as pw

    n = nbytes // 4
    vds = pw.make_virtual_device_set()
    sa = vds.add_slice(devices=1, island="a")
    sb = vds.add_slice(devices=1, island="b")

    def make(s: Any) -> Any:
        return jnp.broadcast_to(s, (n,)) * 1.0  # NBYTES of float32, made on host A's device

    def take(y: Any) -> Any:
        return y[:1] + 1.0  # needs the whole array on its device; computes almost nothing

    gen = pw.jit(make, mesh=sa.mesh(("d",)))
    take_b = pw.jit(take, mesh=sb.mesh(("d",)))
    take_a = pw.jit(take, mesh=sa.mesh(("d",)))

    @pw.program
    def across(s: Any) -> Any:
        return take_b(gen(s))

    @pw.program
    def local(s: Any) -> Any:
        return take_a(gen(s))

    # the same two programs keeping the 64 MiB as a second output: on one island the fused
    # computation then writes them too, so the two differ by the transfer alone (in `local` XLA
    # fuses the broadcast into the slice and never writes the 64 MiB that `across` must produce)
    @pw.program
    def across_kept(s: Any) -> Any:
        y = gen(s)
        return take_b(y), y

    @pw.program
    def local_kept(s: Any) -> Any:
        y = gen(s)
        return take_a(y), y

    seed = np.ones((1,), np.float32)

    def once(fn: Callable[[Any], Any]) -> float:
        t0 = time.perf_counter()
        got = fn(seed)
        out = np.asarray(got[0] if isinstance(got, tuple) else got)
        dt = time.perf_counter() - t0
        if out.shape != (1,) or float(out[0]) != 2.0:
            raise RuntimeError(f"wrong result {out!r}")
        return dt

    def resident(take: Any) -> float:
        """The transfer alone: the 64 MiB made on host A's worker and waited for (materialised,
        untimed), then `take` of that array timed, on island b (moved from A to B) or on island a
        (read where it is). A fresh array each call, so that no copy of it is already on B."""
        y = gen(seed).block_until_ready(timeout=120)
        t0 = time.perf_counter()
        out = np.asarray(take(y))
        dt = time.perf_counter() - t0
        if out.shape != (1,) or float(out[0]) != 2.0:
            raise RuntimeError(f"wrong result {out!r}")
        del y
        return dt

    programs: dict[str, Callable[[], float]] = {
        "moved": lambda: resident(take_b), "in_place": lambda: resident(take_a),
        "across": lambda: once(across), "local": lambda: once(local),
        "across_kept": lambda: once(across_kept), "local_kept": lambda: once(local_kept)}
    for fn in programs.values():
        fn()
    _say({"ready": True})
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "go":
            break
        times: dict[str, list[float]] = {k: [] for k in programs}
        for _ in range(int(parts[1])):
            for k, fn in programs.items():
                times[k].append(fn())
        _say({**{k: _median(v) for k, v in times.items()}, **{f"{k}_all": v for k, v in times.items()}})


# -------------------------------------------------------------------------------------- pipeline


def pipeline(stages: int, micro_batches: int, windows: int, window_s: float) -> None:
    """The pipeline suite's measurement for one stage count (blocks layout: stages in contiguous
    blocks over islands a and b, one hop between them), windows alternating with plain JAX."""
    import os

    from bench import defs, pwside
    from bench.jaxproc import JaxServer

    variants = [(stages, "blocks")]
    env = {**os.environ, "BENCH_JAX_DEVICES": str(defs.PIPE_DEVICES)}
    jx = JaxServer(env, "pipeline_serve", {"variants": variants, "micro_batches": micro_batches})
    try:
        (once,) = pwside.pipeline_passes(variants, micro_batches)
        jx.first()
        once()
        jr: list[float] = []
        pr: list[float] = []
        for _ in range(windows):
            jr.append(float(jx.ask(f"0 {window_s}")["per_s"]))
            pr.append(defs.window_rate(once, window_s) * micro_batches)
    finally:
        jx.close()
    _say({"pw": pr, "jax": jr, "devices": [defs.stage_device(s, stages, "blocks") for s in range(stages)]})


def pipeline_pw(stages: int, micro_batches: int, passes: int) -> None:
    """The pipeline row's Pathways side alone, served (bench.pw_ab_multihost --mode pipeline):
    prints {"ready"}, then for each line "go" on stdin `passes` passes of `micro_batches`
    micro-batches and {"per_s"} (micro-batches/s). A one-micro-batch pass first opens the
    cross-host link with one transfer, so that both trees of an A/B start with it up."""
    from bench import pwside

    (warm,) = pwside.pipeline_passes([(stages, "blocks")], 1)
    warm()
    (once,) = pwside.pipeline_passes([(stages, "blocks")], micro_batches)
    once()
    _say({"ready": True})
    for line in sys.stdin:
        if line.strip() != "go":
            break
        t0 = time.perf_counter()
        for _ in range(passes):
            once()
        _say({"per_s": passes * micro_batches / (time.perf_counter() - t0)})


# ------------------------------------------------------------------------------------------ psum


def _psum_windows(step: Any, x0: Any, calls: int, result: Callable[[Any], Any]) -> None:
    """Serves windows: for each line "go" on stdin, `calls` calls of `step`, each on the last
    one's output and blocking until it is done; prints {"per_s"}. Checks each window's result:
    a psum of 4 equal values v times 0.25, plus 1, is v + 1, so `calls` calls from zeros give
    `calls`."""
    import numpy as np

    first = np.asarray(result(step(x0)))  # compile, collective set-up
    if not np.allclose(first, 1.0):
        raise RuntimeError(f"psum gave {first!r}, expected 1.0")
    _say({"ready": True})
    for line in sys.stdin:
        if line.strip() != "go":
            break
        x: Any = x0
        t0 = time.perf_counter()
        for _ in range(calls):
            x = result(step(x))
        rate = calls / (time.perf_counter() - t0)
        if not np.allclose(np.asarray(x), float(calls)):
            raise RuntimeError(f"after {calls} calls: {np.asarray(x)!r}")
        _say({"per_s": rate})


def psum_member(coordinator: str, process_id: int, processes: int, ip: str, devices: int, calls: int) -> None:
    """One member of a plain multi-controller `jax.distributed` group; gloo advertises `ip`
    (docs/multihost.md, section 3). `jax.pmap` of the psum step over every device of the group,
    blocking each call; every member must get the same "go" lines (a collective needs all)."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    jax.config.update("jax_enable_preemption_service", False)
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    def factory() -> Any:
        return xla_bridge.make_cpu_client(
            collectives=_jax.make_gloo_tcp_collectives(distributed.global_state.client, hostname=ip))

    xla_bridge.register_backend_factory("cpu", factory, priority=0, fail_quietly=False)
    jax.distributed.initialize(coordinator, processes, process_id, heartbeat_timeout_seconds=10,
                               shutdown_timeout_seconds=5, initialization_timeout=120)
    import numpy as np

    from bench import defs

    if jax.device_count() != processes * devices:
        raise RuntimeError(f"{jax.device_count()} global devices, expected {processes * devices}")
    step = jax.pmap(defs.allreduce_step, axis_name=defs.AXIS)
    _psum_windows(step, np.zeros((jax.local_device_count(),), np.float32), calls, lambda y: y.block_until_ready())
    import os

    os._exit(0)  # not sys.exit: the distributed shutdown barrier can hang (docs/facts.md)


def psum_pw(island: str, devices: int, calls: int) -> None:
    """The same blocking psum calls through `pw.pmap(..., axis_name)` over a slice of `devices`
    devices of `island` (one spanning two hosts), served like `psum_member`; where the slice or
    its first call fails, prints {"error"} (one line) instead of {"ready"}."""
    import numpy as np

    import pwctl as pw
    from bench import defs

    try:
        s = pw.make_virtual_device_set().add_slice(devices=devices, island=island)
        step = pw.pmap(defs.allreduce_step, devices=s.devices, axis_name=defs.AXIS)
        np.asarray(step(np.zeros((devices,), np.float32)))
    except Exception as e:
        _say({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]})
        return
    _psum_windows(step, np.zeros((devices,), np.float32), calls, lambda y: y.block_until_ready(timeout=120))


# ------------------------------------------------------------------- the gRPC stream alone (why)


def stream_recv(ip: str) -> None:
    """A gRPC server with only the worker's Transfer method, assembling as the worker does
    (server/worker/servicer.py: the chunks' bytes joined, then an array); prints {"port"}."""
    import asyncio

    from grpc import aio

    from schemas.pathways.v1 import worker_pb2 as wpb
    from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
    from server.worker.transfer import CHANNEL_OPTIONS, peer_array

    class Receiver(wgrpc.WorkerServicer):  # Transfer only
        async def Transfer(self, request_iterator: Any, context: Any) -> Any:
            loop = asyncio.get_running_loop()
            head: Any = None
            parts: list[bytes] = []
            total = 0
            t0 = time.perf_counter()
            wait = 0.0  # time waiting for the next message (the rest: taking the messages' bytes)
            it = request_iterator.__aiter__()
            while True:
                tw = time.perf_counter()
                try:
                    chunk = await it.__anext__()
                except StopAsyncIteration:
                    break
                wait += time.perf_counter() - tw
                head = head or chunk
                parts.append(chunk.array.data)
                if chunk.last:
                    ta = time.perf_counter()
                    arr = await loop.run_in_executor(None, peer_array, head.array, parts)
                    total += arr.nbytes
                    _say({"call_s": time.perf_counter() - t0, "wait_s": wait, "assemble_s": time.perf_counter() - ta,
                          "messages": len(parts)})
                    head, parts = None, []
            return wpb.TransferResponse(bytes=total)

    async def serve() -> None:
        server = aio.server(options=CHANNEL_OPTIONS)
        wgrpc.add_WorkerServicer_to_server(Receiver(), server)  # type: ignore[abstract]
        port = server.add_insecure_port(f"{ip}:0")
        await server.start()
        _say({"port": port})
        await server.wait_for_termination()

    asyncio.run(serve())


def _chunks_in_place(buffer_id: int, arr: Any, size: int) -> Any:
    """Like transfer.chunks, but each message is built in place (no ArrayProto copied into the
    TransferChunk): one copy of the bytes fewer on the sender."""
    from schemas.arrays import byte_view, dtype_name
    from schemas.pathways.v1 import worker_pb2 as wpb

    data = byte_view(arr)
    n = len(data)
    for off in range(0, max(n, 1), size):
        msg = wpb.TransferChunk(buffer_id=buffer_id, last=off + size >= n)
        msg.array.data = bytes(data[off : off + size])
        if off == 0:
            msg.array.dtype = dtype_name(arr.dtype)
            msg.array.shape[:] = list(arr.shape)
        yield msg


def stream_send(address: str, nbytes: int, variants: list[list[Any]], rounds: int, reps: int) -> None:
    """Sends NBYTES as the worker does (server/worker/transfer.py `chunks`, one array per
    Transfer call) for each variant [chunk size, "current" or "in_place"], the variants taking
    turns for `rounds` rounds of `reps` calls; prints the median seconds per variant, and the
    time the sender alone spends making and serializing the messages."""
    import grpc
    import numpy as np

    from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
    from server.worker import transfer

    arr = np.arange(nbytes // 4, dtype=np.float32)
    stub = wgrpc.WorkerStub(grpc.insecure_channel(address, options=transfer.CHANNEL_OPTIONS))
    saved = transfer.TRANSFER_CHUNK

    def msgs(size: int, how: str) -> Any:
        if how == "in_place":
            return _chunks_in_place(1, arr, size)
        transfer.TRANSFER_CHUNK = size
        return transfer.chunks(1, arr)

    times: dict[str, list[float]] = {f"{size} {how}": [] for size, how in variants}
    ser: dict[str, list[float]] = {k: [] for k in times}
    try:
        for size, how in variants:
            stub.Transfer(msgs(size, how))  # warm-up (and the connection)
        for _ in range(rounds):
            for size, how in variants:
                key = f"{size} {how}"
                for _ in range(reps):
                    t0 = time.perf_counter()
                    r = stub.Transfer(msgs(size, how))
                    times[key].append(time.perf_counter() - t0)
                    if r.bytes != nbytes:
                        raise RuntimeError(f"received {r.bytes} bytes")
                t0 = time.perf_counter()
                for m in msgs(size, how):
                    m.SerializeToString()
                ser[key].append(time.perf_counter() - t0)
    finally:
        transfer.TRANSFER_CHUNK = saved
    _say({k: {"s": _median(v), "serialize_s": _median(ser[k])} for k, v in times.items()})

TASKS: dict[str, Callable[..., None]] = {
    "tcp_recv": tcp_recv,
    "tcp_send": tcp_send,
    "transfer_pw": transfer_pw,
    "pipeline": pipeline,
    "pipeline_pw": pipeline_pw,
    "psum_member": psum_member,
    "psum_pw": psum_pw,
    "stream_recv": stream_recv,
    "stream_send": stream_send,
}


def main() -> None:
    TASKS[sys.argv[1]](**json.loads(sys.argv[2]))


if __name__ == "__main__":
    main()
