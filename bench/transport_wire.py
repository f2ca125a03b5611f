"""The transport probe's shared pieces (bench/transport_probe.py): fixed-size control messages on
the TCP connection between its processes on host A and host B, the CPU time of a process, and the
byte pattern the arrays carry with its check on the receiving side."""

from __future__ import annotations

import os
import resource
import socket
from pathlib import Path

import numpy as np

MIB = 1024 * 1024
MSG = 256  # control messages: fixed-size ASCII, space-padded


def send_msg(sock: socket.socket, text: str) -> None:
    raw = text.encode()
    if len(raw) > MSG:
        raise ValueError(f"control message too long: {text!r}")
    sock.sendall(raw.ljust(MSG))


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def recv_msg(sock: socket.socket) -> str:
    buf = bytearray(MSG)
    recv_exact(sock, memoryview(buf))
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
