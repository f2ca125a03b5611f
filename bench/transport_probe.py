"""`python -m bench.transport_probe`: cross-host array transports, measured against raw TCP (issue 27).

Needs root: it makes two hosts as network namespaces on this machine with `bench/netns.py`'s
`Hosts` (host A 10.251.K.1, host B 10.251.K.2 on a bridge of their own; only what it created is
torn down, also on errors and Ctrl-C) and exits with a one-line message where it cannot.

It moves an array of each size from a process on host A (`send` role) to a process on host B
(`recv` role) by:

* `tcp`: raw TCP, `socket.sendall` of the array's bytes, `recv_into` a preallocated buffer on B;
* `grpc-N`: our gRPC stream with N-MiB chunks (`server/worker/transfer.py`'s `chunks()` with
  `TRANSFER_CHUNK`, `CHUNK` before main's cb8da10, set in the sending process), one
  `Worker.Transfer` call per array into a minimal servicer on B that copies each chunk into a
  preallocated buffer;
* `worker-N`: end to end into a real worker (`python -m server.worker` on B, registered with a
  real controller on B; the probe reads the cluster token and the worker key from host B's data
  directory and presents the peer and a session credential as a worker and a client would): the
  worker's own `TransferSender` forced onto its gRPC stream (`PATHWAYS_TRANSFER=grpc`; one
  long-lived stream per peer, chunks of N MiB), then `Worker.Wait` on the buffer, which returns
  once B's worker stored it;
* `worker-tcp`: the same with the sender's default cross-host path, the worker's TCP link
  (`server/worker/tcplink.py`);
* `jax`: JAX's transfer server (`jax.experimental.transfer.start_transfer_server` in each process;
  A `await_pull`s the array, B `connect(A).pull`s it onto its CPU device).

Alongside, the CPU time all three processes involved spent (sender on A, receiver and worker on B,
every thread, from getrusage and /proc/PID/stat) per GB moved: on a shared, loaded machine the
throughputs measure each method's share of the CPUs as much as the link, and CPU per byte is the
steadier comparison (the worker's is read in 10 ms ticks: too coarse for small arrays; the idle
controller is not counted). Each throughput figure is the time on A from the start of a send
(serialisation included) to B's acknowledgement: a short reply on the TCP control connection (tcp,
jax), the end of the call (grpc), the `Wait` reply (worker). Methods take turns within a round (the
order rotates per round) so drift on a shared machine falls on all of them alike; the figure is the
median over the rounds. B's worker is restarted (under a new name) every round so that the buffers
it receives, which nothing releases, do not pile up. Bytes are checked on B (a sample of every
1 MiB) for tcp, grpc and jax.

    sudo python -m bench.transport_probe [--sizes 4,64,256] [--chunks 1,4,16] [--reps 5] [--json F]

Run niced on a shared machine; the load average before and after is printed with the table.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np

MIB = 1024 * 1024
MSG = 256  # control messages: fixed-size ASCII, space-padded


def _send_msg(sock: socket.socket, text: str) -> None:
    raw = text.encode()
    if len(raw) > MSG:
        raise ValueError(f"control message too long: {text!r}")
    sock.sendall(raw.ljust(MSG))


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def _recv_msg(sock: socket.socket) -> str:
    buf = bytearray(MSG)
    _recv_exact(sock, memoryview(buf))
    return buf.decode().strip()


def cpu_ns(pid: int | None = None) -> int:
    """CPU time (user + system) of a process, every thread including those that already exited
    (gRPC's per-call request-iterator threads), in ns: this process's from getrusage (µs), another
    one's from /proc/PID/stat (clock ticks, 10 ms)."""
    if pid is None:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return int((ru.ru_utime + ru.ru_stime) * 1e9)
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def pattern(nbytes: int) -> np.ndarray:
    return (np.arange(nbytes, dtype=np.uint32) % 251).astype(np.uint8)


def check(arr: np.ndarray, what: str) -> None:
    """A sample of the bytes (one every MiB, and the last) against `pattern`."""
    idx = np.append(np.arange(0, arr.size, MIB), arr.size - 1)
    if not np.array_equal(arr[idx], (idx % 251).astype(np.uint8)):
        raise RuntimeError(f"{what}: received bytes differ from those sent")


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
            cmd = _recv_msg(conn).split()
            if cmd[0] == "tcp":
                n = int(cmd[1])
                buf = bufs.get(n)
                if buf is None:
                    buf = bufs[n] = np.empty(n, np.uint8)
                _recv_exact(conn, memoryview(buf))  # type: ignore[arg-type]
                _send_msg(conn, "ok")
                check(buf, "tcp")
                _send_msg(conn, "checked")
            elif cmd[0] == "jax":
                uuid, n, addr = int(cmd[1]), int(cmd[2]), cmd[3]
                c = connections.get(addr)
                if c is None:
                    c = connections[addr] = jserver.connect(addr)
                spec = jax.ShapeDtypeStruct((n,), jnp.uint8, sharding=jax.sharding.SingleDeviceSharding(device))
                (arr,) = c.pull(uuid, [spec])
                arr.block_until_ready()
                _send_msg(conn, "ok")
                check(np.asarray(arr), "jax")
                del arr
                _send_msg(conn, "checked")
            elif cmd[0] == "creds":  # the cluster token and the controller's worker key
                token, key = _credentials(controller)
                _send_msg(conn, f"creds {token} {key.hex()}")
            elif cmd[0] == "worker":  # (re)start the real worker: `worker NAME`
                if worker is not None:
                    worker.kill()
                    worker.wait()
                worker = _start_worker(ip, cmd[1])
                _send_msg(conn, f"addr {_worker_address(worker)}")
            elif cmd[0] == "cpu":  # this process's and the worker's CPU time so far
                _send_msg(conn, f"cpu {cpu_ns()} {cpu_ns(worker.pid) if worker is not None else 0}")
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
    _send_msg(ctl, "creds")
    _, token, key_hex = _recv_msg(ctl).split()
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
        _send_msg(ctl, f"worker probe-b{next(workers_started)}")
        addr = _recv_msg(ctl).split()[1]
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
        _send_msg(ctl, "cpu")
        return sum(int(x) for x in _recv_msg(ctl).split()[1:])

    def run(method: str, arr: np.ndarray, jarr: Any) -> tuple[float, float, float]:
        """(seconds, CPU seconds of the sender on A, CPU seconds of B's receiver and worker)."""
        n = arr.nbytes
        a0, b0 = cpu_ns(), b_cpu()
        if method == "tcp":
            t0 = time.perf_counter()
            _send_msg(ctl, f"tcp {n}")
            ctl.sendall(memoryview(arr))  # type: ignore[arg-type]
            reply = _recv_msg(ctl)
        elif method == "jax":
            uuid = next(ids)
            t0 = time.perf_counter()
            jserver.await_pull(uuid, [jarr])
            _send_msg(ctl, f"jax {uuid} {n} {jaddr}")
            reply = _recv_msg(ctl)
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
            done = threading.Event()
            t0 = time.perf_counter()
            sender.send(bid, arr, wstub[0], False, done.set)
            w = wstub[1].Wait(wpb.WaitRequest(buffer_ids=[bid], timeout_s=120), metadata=meta)
            reply = "ok" if w.ready else f"not ready: {w.error}"
        dt = time.perf_counter() - t0
        if reply != "ok":
            raise RuntimeError(f"{method}: {reply}")
        if method == "tcp" or method == "jax":
            _recv_msg(ctl)  # B's "checked" (its sample of the bytes costs microseconds)
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
    _send_msg(ctl, "quit")
    for sender in senders.values():
        sender.close()


# ---------------------------------------------------------------- driver (root namespace)
def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def drive(sizes: list[int], chunk_sizes: list[float], reps: int, json_out: str) -> int:
    from .netns import REPO, Hosts, NamespaceUnavailable, unavailable

    if os.geteuid() != 0:
        print("transport_probe: needs root (it makes network, mount and UTS namespaces)", file=sys.stderr)
        return 2
    why = unavailable()
    if why is not None:
        print(f"transport_probe: cannot make network namespaces here: {why}", file=sys.stderr)
        return 2
    load_before = _loadavg()
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pw-xferprobe-") as tmp:
        hosts = Hosts(Path(tmp))
        try:
            try:
                a, b = hosts.start(2)
            except NamespaceUnavailable as e:
                print(f"transport_probe: cannot make network namespaces here: {e}", file=sys.stderr)
                return 2
            me = [sys.executable, "-m", "bench.transport_probe"]
            recv = b.popen([*me, "--role", "recv", "--ip", b.ip], PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
            assert recv.stdout is not None
            line = ""
            while not line.startswith("READY"):
                line = recv.stdout.readline()
                if not line:
                    raise RuntimeError(f"host B's receiver did not start (rc {recv.wait()})")
            tcp_port, grpc_port = line.split()[1:3]
            threading.Thread(target=_echo, args=(recv, "B"), daemon=True).start()
            send = a.popen([*me, "--role", "send", "--ip", a.ip, "--peer", f"{b.ip}:{tcp_port}",
                            "--grpc-port", grpc_port, "--sizes", ",".join(map(str, sizes)),
                            "--chunks", ",".join(f"{c:g}" for c in chunk_sizes), "--reps", str(reps)],
                           PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
            assert send.stdout is not None
            for out in send.stdout:
                if out.startswith("{"):
                    row = json.loads(out)
                    if "skipped" in row:
                        skipped.append(row)
                    else:
                        results.append(row)
                else:
                    print(f"[A] {out}", end="", file=sys.stderr)
            rc = send.wait()
            with contextlib.suppress(subprocess.TimeoutExpired):
                recv.wait(timeout=10)
            if rc != 0:
                print(f"transport_probe: host A's sender failed (rc {rc})", file=sys.stderr)
                return 1
        finally:
            hosts.close()
    report(results, skipped, load_before, _loadavg(), json_out)
    return 0


def _echo(proc: subprocess.Popen[str], tag: str) -> None:
    assert proc.stdout is not None
    for out in proc.stdout:
        print(f"[{tag}] {out}", end="", file=sys.stderr)


def report(results: list[dict[str, Any]], skipped: list[dict[str, Any]], load_before: str, load_after: str,
           json_out: str) -> None:
    tcp = {r["size_mib"]: statistics.median(r["seconds"]) for r in results if r["method"] == "tcp"}
    print(f"load average before: {load_before}; after: {load_after}; {os.cpu_count()} CPUs")
    print(f"{'size':>8} {'method':>11} {'GB/s median':>12} {'min-max GB/s':>14} {'x raw TCP':>10} "
          f"{'CPU s/GB':>9} {'x TCP CPU':>9} {'send/recv s/GB':>15}")
    tcp_cpu = {r["size_mib"]: statistics.median(r["cpu_seconds"]) for r in results if r["method"] == "tcp"}
    for r in results:
        n = r["size_mib"] * MIB
        med = statistics.median(r["seconds"])
        lo, hi = n / max(r["seconds"]) / 1e9, n / min(r["seconds"]) / 1e9
        r["gbps_median"] = n / med / 1e9
        r["ratio_to_tcp"] = tcp[r["size_mib"]] / med
        cpu = statistics.median(r["cpu_seconds"])
        r["cpu_s_per_gb"] = cpu / (n / 1e9)
        r["cpu_ratio_to_tcp"] = cpu / tcp_cpu[r["size_mib"]]
        send_cpu = statistics.median(r["cpu_sender"]) / (n / 1e9)
        recv_cpu = statistics.median(r["cpu_receiver"]) / (n / 1e9)
        print(f"{r['size_mib']:>5}MiB {r['method']:>11} {r['gbps_median']:>12.2f} {lo:>6.2f}-{hi:<7.2f} "
              f"{r['ratio_to_tcp']:>10.2f} {r['cpu_s_per_gb']:>9.2f} {r['cpu_ratio_to_tcp']:>9.1f} "
              f"{send_cpu:>7.2f}/{recv_cpu:<7.2f}")
    Path(json_out).write_text(json.dumps({"load_before": load_before, "load_after": load_after,
                                          "cpus": os.cpu_count(), "results": results, "skipped": skipped},
                                         indent=1))
    for sk in skipped:
        print(f"not measured: {sk['skipped']} ({sk['reason']})")
    print(f"written to {json_out}")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.transport_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["drive", "recv", "send"], default="drive", help=argparse.SUPPRESS)
    p.add_argument("--ip", help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--grpc-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="4,64,256", help="array sizes in MiB (default 4,64,256)")
    p.add_argument("--chunks", default="1,4,16", help="gRPC chunk sizes in MiB, fractions allowed (default 1,4,16)")
    p.add_argument("--reps", type=int, default=5, help="rounds; each figure is the median (default 5)")
    p.add_argument("--json", default=None,
                   help="where to write the raw times and figures (default bench/results/transport-<UTC time>.json)")
    ns = p.parse_args()
    sizes = [int(s) for s in ns.sizes.split(",")]
    chunk_sizes = [float(c) for c in ns.chunks.split(",")]
    if ns.role == "recv":
        recv_role(ns.ip)
    elif ns.role == "send":
        send_role(ns.ip, ns.peer, ns.grpc_port, sizes, chunk_sizes, ns.reps)
    else:
        out = ns.json or str(Path(__file__).resolve().parent / "results" /
                             time.strftime("transport-%Y%m%dT%H%M%SZ.json", time.gmtime()))
        sys.exit(drive(sizes, chunk_sizes, ns.reps, out))


if __name__ == "__main__":
    main()
