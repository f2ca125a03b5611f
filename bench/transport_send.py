"""The transport probe's host A (bench/transport_probe.py, `--role send`): drives every round
against host B and prints one JSON line per measurement."""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from .transport_wire import MIB, cpu_ns, pattern, recv_msg, send_msg


# ---------------------------------------------------------------- host A
def send_role(ip: str, peer: str, grpc_port: int, sizes: list[int], chunk_sizes: list[float], reps: int) -> None:
    """Host A: drives every round and prints one JSON line per measurement."""
    import grpc
    import jax
    from jax.experimental import transfer as jxt

    from schemas.pathways.v1 import worker_pb2 as wpb
    from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
    from server.credentials import PREFIX_SHIFT, SESSION_HEADER, session_credential
    from server.worker import transfer

    ctl = socket.create_connection((peer.split(":")[0], int(peer.split(":")[1])))
    ctl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_msg(ctl, "creds")
    _, token, key_hex = recv_msg(ctl).split()
    key = bytes.fromhex(key_hex)
    bip = peer.split(":")[0]
    stub = wgrpc.WorkerStub(grpc.insecure_channel(f"{bip}:{grpc_port}", options=transfer.CHANNEL_OPTIONS))
    device = jax.devices("cpu")[0]
    jserver = jxt.start_transfer_server(device.client, f"{ip}:0", [f"{ip}:0"])
    jaddr = jserver.address()
    senders = {}
    for mode in ("grpc", "auto"):  # TransferSender reads PATHWAYS_TRANSFER when it is made
        os.environ["PATHWAYS_TRANSFER"] = mode
        senders[mode] = transfer.TransferSender(token=token)
        senders[mode].set_key(key)  # as a worker's at registration: the peer credential
    os.environ.pop("PATHWAYS_TRANSFER")
    prefix = 7  # this probe's session: buffer ids under its prefix, waits with its credential
    meta = (("authorization", f"Bearer {token}"),
            (SESSION_HEADER, session_credential(key, "client:transport-probe", prefix)))
    ids = iter(range((prefix << PREFIX_SHIFT) + 1, (prefix + 1) << PREFIX_SHIFT))
    wstub: Any = None
    workers_started = itertools.count()

    def restart_worker() -> None:
        """A fresh worker (a new name each time), once its controller registered it."""
        nonlocal wstub
        send_msg(ctl, f"worker probe-b{next(workers_started)}")
        addr = recv_msg(ctl).split()[1]
        wstub = (addr, wgrpc.WorkerStub(grpc.insecure_channel(addr, options=transfer.CHANNEL_OPTIONS)))
        deadline = time.monotonic() + 60
        while True:  # UNAVAILABLE until registered
            try:
                wstub[1].Wait(wpb.WaitRequest(buffer_ids=[next(ids)], timeout_s=0.01), metadata=meta, timeout=5)
                return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def set_chunk(method: str) -> None:
        """Peer transfers' chunk size in this process (TRANSFER_CHUNK since main's cb8da10, CHUNK before)."""
        size = int(float(method.split("-")[1]) * MIB)
        if hasattr(transfer, "TRANSFER_CHUNK"):
            transfer.TRANSFER_CHUNK = size
        else:
            transfer.CHUNK = size

    def b_cpu() -> int:
        send_msg(ctl, "cpu")
        return sum(int(x) for x in recv_msg(ctl).split()[1:])

    def run(method: str, arr: np.ndarray, jarr: Any) -> tuple[float, float, float]:
        """(seconds, CPU seconds of the sender on A, CPU seconds of B's receiver and worker)."""
        n = arr.nbytes
        a0, b0 = cpu_ns(), b_cpu()
        sent: threading.Event | None = None  # a worker path's: set once the sender's thread is done
        if method == "tcp":
            t0 = time.perf_counter()
            send_msg(ctl, f"tcp {n}")
            ctl.sendall(memoryview(arr))  # type: ignore[arg-type]
            reply = recv_msg(ctl)
        elif method == "jax":
            uuid = next(ids)
            t0 = time.perf_counter()
            jserver.await_pull(uuid, [jarr])
            send_msg(ctl, f"jax {uuid} {n} {jaddr}")
            reply = recv_msg(ctl)
        elif method.startswith("grpc-"):
            set_chunk(method)
            t0 = time.perf_counter()
            resp = stub.Transfer(transfer.chunks(next(ids), arr))
            reply = "ok" if resp.bytes == n else f"short: {resp.bytes}"
        else:  # worker-N, worker-tcp
            sender = senders["auto"]
            if method != "worker-tcp":
                set_chunk(method)
                sender = senders["grpc"]
            bid = next(ids)
            sent = threading.Event()
            t0 = time.perf_counter()
            sender.send(bid, arr, wstub[0], False, sent.set)
            w = wstub[1].Wait(wpb.WaitRequest(buffer_ids=[bid], timeout_s=120), metadata=meta)
            reply = "ok" if w.ready else f"not ready: {w.error}"
        dt = time.perf_counter() - t0
        # the receiver can hold the bytes before the sender's thread, back from its last write, notes
        # which transport it used (`check_workers` reads that): wait for it, outside the timing
        if sent is not None and not sent.wait(60):
            raise RuntimeError(f"{method}: the sender's thread did not finish")
        if reply != "ok":
            raise RuntimeError(f"{method}: {reply}")
        if method == "tcp" or method == "jax":
            recv_msg(ctl)  # B's "checked" (its sample of the bytes costs microseconds)
        a1 = cpu_ns()
        return dt, (a1 - a0) / 1e9, (b_cpu() - b0) / 1e9

    def check_workers() -> None:
        """A fresh worker on B (its buffers are never released without a controller), warmed on
        both paths, each checked to have gone by the transport it is named after."""
        restart_worker()
        run("worker-4", warm, jwarm)  # the new worker's stream, link and first buffers, untimed
        run("worker-tcp", warm, jwarm)
        used = {kind: wstub[0] in senders[mode]._used.get(kind, set())
                for mode, kind in (("grpc", transfer.STREAM), ("auto", getattr(transfer, "TCP", "")))}
        if not all(used.values()):
            raise RuntimeError(f"a worker path did not use its transport: {used}")

    methods = ["tcp", *[f"grpc-{c:g}" for c in chunk_sizes], *[f"worker-{c:g}" for c in chunk_sizes], "worker-tcp",
               "jax"]
    restart_worker()
    warm = pattern(4 * MIB)
    jwarm = jax.device_put(warm, device)
    try:
        run("worker-tcp", warm, jwarm)
        workers = True
    except grpc.RpcError as e:
        # since main's worker-side trust (issue 29) a worker serves transfers and waits only once a
        # controller registered it and issued credentials; this probe starts no controller yet
        workers = False
        methods = [m for m in methods if not m.startswith("worker-")]
        print(json.dumps({"skipped": "worker-*", "reason": f"{e.code().name}: {e.details()}"}), flush=True)
    for m in methods:  # connections, streams, first-call costs
        run(m, warm, jwarm)
    for size in sizes:
        arr = pattern(size * MIB)
        jarr = jax.device_put(arr, device)
        jarr.block_until_ready()
        times: dict[str, list[float]] = {m: [] for m in methods}
        cpus: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
        for r in range(reps):
            if workers:
                check_workers()
            order = methods[r % len(methods):] + methods[: r % len(methods)]
            for m in order:
                dt, cpu_a, cpu_b = run(m, arr, jarr)
                times[m].append(dt)
                cpus[m].append((cpu_a, cpu_b))
        for m in methods:
            print(json.dumps({"size_mib": size, "method": m, "seconds": times[m],
                              "cpu_seconds": [a + b for a, b in cpus[m]],
                              "cpu_sender": [a for a, _ in cpus[m]], "cpu_receiver": [b for _, b in cpus[m]]}),
                  flush=True)
        del jarr
    send_msg(ctl, "quit")
    for sender in senders.values():
        sender.close()
