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
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .transport_recv import recv_role
from .transport_send import send_role
from .transport_wire import MIB


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
