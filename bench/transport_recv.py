"""The transport probe's host B (bench/transport_probe.py, `--role recv`): the control and raw-TCP
listener, a minimal Transfer servicer, a JAX transfer server, a real controller and (on request)
a real worker as child processes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np

from .transport_wire import check, cpu_ns, recv_exact, recv_msg, send_msg


# ---------------------------------------------------------------- host B
def recv_role(ip: str) -> None:
    """Host B: the control/raw-TCP listener, a minimal Transfer servicer, a JAX transfer server and
    (on request) a real worker as a child process. Prints `READY <tcp port> <grpc port>`."""
    import grpc
    import jax
    import jax.numpy as jnp
    from jax.experimental import transfer as jxt

    from schemas.pathways.v1 import worker_pb2 as wpb
    from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
    from server.worker.transfer import CHANNEL_OPTIONS

    class MinimalTransfer(wgrpc.WorkerServicer):
        """Copies each chunk of the one array a call carries into a preallocated buffer."""

        def Transfer(self, request_iterator: Iterator[wpb.TransferChunk], context: Any) -> wpb.TransferResponse:
            out: np.ndarray | None = None
            off = 0
            for chunk in request_iterator:
                if out is None:
                    out = np.empty(int(np.prod(chunk.array.shape)), np.uint8)
                data = chunk.array.data
                out[off : off + len(data)] = np.frombuffer(data, np.uint8)
                off += len(data)
            assert out is not None and off == out.size, (off, None if out is None else out.size)
            check(out, "grpc")
            return wpb.TransferResponse(bytes=off)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    wgrpc.add_WorkerServicer_to_server(MinimalTransfer(), server)  # type: ignore[abstract]  # Transfer only
    grpc_port = server.add_insecure_port(f"{ip}:0")
    server.start()

    device = jax.devices("cpu")[0]
    jserver = jxt.start_transfer_server(device.client, f"{ip}:0", [f"{ip}:0"])
    controller = _start_controller(ip)
    lst = socket.create_server((ip, 0))
    print(f"READY {lst.getsockname()[1]} {grpc_port}", flush=True)
    conn, _ = lst.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bufs: dict[int, np.ndarray] = {}
    worker: subprocess.Popen[str] | None = None
    connections: dict[str, Any] = {}
    try:
        while True:
            cmd = recv_msg(conn).split()
            if cmd[0] == "tcp":
                n = int(cmd[1])
                buf = bufs.get(n)
                if buf is None:
                    buf = bufs[n] = np.empty(n, np.uint8)
                recv_exact(conn, memoryview(buf))  # type: ignore[arg-type]
                send_msg(conn, "ok")
                check(buf, "tcp")
                send_msg(conn, "checked")
            elif cmd[0] == "jax":
                uuid, n, addr = int(cmd[1]), int(cmd[2]), cmd[3]
                c = connections.get(addr)
                if c is None:
                    c = connections[addr] = jserver.connect(addr)
                spec = jax.ShapeDtypeStruct((n,), jnp.uint8, sharding=jax.sharding.SingleDeviceSharding(device))
                (arr,) = c.pull(uuid, [spec])
                arr.block_until_ready()
                send_msg(conn, "ok")
                check(np.asarray(arr), "jax")
                del arr
                send_msg(conn, "checked")
            elif cmd[0] == "creds":  # the cluster token and the controller's worker key
                token, key = _credentials(controller)
                send_msg(conn, f"creds {token} {key.hex()}")
            elif cmd[0] == "worker":  # (re)start the real worker: `worker NAME`
                if worker is not None:
                    worker.kill()
                    worker.wait()
                worker = _start_worker(ip, cmd[1])
                send_msg(conn, f"addr {_worker_address(worker)}")
            elif cmd[0] == "cpu":  # this process's and the worker's CPU time so far
                send_msg(conn, f"cpu {cpu_ns()} {cpu_ns(worker.pid) if worker is not None else 0}")
            elif cmd[0] == "quit":
                return
            else:
                raise ValueError(f"unknown command {cmd}")
    finally:
        for proc in (worker, controller):
            if proc is not None:
                proc.kill()
                proc.wait()
        server.stop(0)


CONTROLLER_PORT = 7070  # on host B's own address: the namespace is private


def _start_controller(ip: str) -> subprocess.Popen[bytes]:
    """A real controller on host B (its data directory is $PATHWAYS_HOME, host B's): since main's
    worker-side trust (issue 29) a worker serves transfers and waits only once registered."""
    return subprocess.Popen([sys.executable, "-m", "server.controller", "--listen", f"{ip}:{CONTROLLER_PORT}",
                             "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _credentials(controller: subprocess.Popen[bytes]) -> tuple[str, bytes]:
    """The token and worker key the controller keeps in its data directory (the probe acts as a
    client and as a peer worker of this cluster, as an operator on the same machine could)."""
    home = Path(os.environ["PATHWAYS_HOME"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            token = (home / "token").read_text().strip()
            key = bytes.fromhex((home / "worker.key").read_text().strip())
            if token and key:
                return token, key
        if controller.poll() is not None:
            raise RuntimeError(f"the controller on host B exited (rc {controller.returncode})")
        time.sleep(0.2)
    raise RuntimeError("the controller on host B wrote no token and key within 60 s")


def _start_worker(ip: str, name: str) -> subprocess.Popen[str]:
    # the token from host B's data directory, as any worker started there
    argv = [sys.executable, "-m", "server.worker", "--island", "probe", "--devices", "1", "--name", name,
            "--listen", f"{ip}:0", "--server", f"{ip}:{CONTROLLER_PORT}", "--unload-after", "0"]
    env = {k: v for k, v in os.environ.items() if k != "PWCTL_TOKEN"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)


def _worker_address(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if " serving at " in line:
            addr = line.rsplit(" serving at ", 1)[1].strip()
            threading.Thread(target=_drain, args=(proc,), daemon=True).start()
            return addr
    raise RuntimeError("the worker did not start: " + "".join(lines[-5:]))


def _drain(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    for _ in proc.stdout:
        pass
