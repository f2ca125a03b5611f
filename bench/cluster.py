"""The benchmark's own local cluster: a controller and two workers (islands a and b, 4 virtual CPU
devices each) on fresh loopback ports with a temporary PATHWAYS_HOME. It stops only what it started."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pwctl.client import Client
from pwctl.errors import ConnectionFailed, PathwaysError
from pwctl.local import stop_children
from pwctl.paths import load_or_create_token, read_token
from schemas.pathways.v1 import common_pb2 as pb
from server.ports import held_port, reserve_port

REPO = Path(__file__).resolve().parent.parent
XLA_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=60"




free_port = held_port  # a loopback port reserved for the rest of the run (server/ports.py)


class BenchCluster:
    def __init__(self, islands: tuple[str, ...] = ("a", "b"), devices: int | str = 4,
                 controller_args: tuple[str, ...] = ()) -> None:
        self.controller_args = list(controller_args)
        self._tmp = tempfile.TemporaryDirectory(prefix="pw-bench-")
        self.home = Path(self._tmp.name)
        self._port = reserve_port()  # held until close(): no other socket takes it first (server/ports.py)
        self.address = self._port.address
        self.islands = islands
        self.devices = devices
        self.controller: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PWCTL_SERVER", "PWCTL_TOKEN", "PWCTL_DISPATCH",
                                                                 "PWCTL_WEIGHT", "PWCTL_PRIORITY")}
        env.update(PATHWAYS_HOME=str(self.home), PWCTL_SERVER=self.address, XLA_FLAGS=XLA_FLAGS,
                   PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
        env.update(extra)
        return env

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        fh = open(self.home / log_name, "wb")  # noqa: SIM115 (closed in close())
        self._logs.append(fh)
        return subprocess.Popen(args, env=self.env(), cwd=REPO, stdin=subprocess.DEVNULL, stdout=fh,
                                stderr=subprocess.STDOUT)

    @property
    def token(self) -> str | None:
        """The cluster token (None with the controller's --no-token)."""
        return read_token(self.home / "token")

    def start(self, timeout: float = 90.0) -> BenchCluster:
        if "--no-token" not in self.controller_args:
            # every call needs it, the workers' registration too: made before they all start at once
            load_or_create_token(self.home / "token")
        self.controller = self._spawn(
            [sys.executable, "-m", "server.controller", "--listen", self.address, "--db",
             f"sqlite:///{self.home / 'pw.db'}", "--log-level", "WARNING", *self.controller_args],
            "controller.log")
        for island in self.islands:
            self.workers[island] = self._spawn(
                [sys.executable, "-m", "server.worker", "--island", island, "--devices", str(self.devices),
                 "--server", self.address, "--name", f"bench-{island}"], f"worker-{island}.log")
        deadline = time.monotonic() + timeout
        while True:
            for name, p in [("controller", self.controller), *self.workers.items()]:
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}: {self.log_tail(name)}")
            if self._ready():
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ready after {timeout:g} s (logs in {self.home})")
            time.sleep(0.05)

    def _ready(self) -> bool:
        try:
            with Client(server=self.address, token=self.token, timeout=1.0) as c:
                hosts = {h.name: h for h in c.hosts()}
        except (ConnectionFailed, PathwaysError):
            return False
        return all(
            f"bench-{i}" in hosts and hosts[f"bench-{i}"].state == pb.HOST_STATE_READY
            and hosts[f"bench-{i}"].pid == p.pid for i, p in self.workers.items()
        )

    def worker_addresses(self) -> dict[str, str]:
        with Client(server=self.address, token=self.token, timeout=5.0) as c:
            return {h.island: h.address for h in c.hosts() if h.name.startswith("bench-")}

    def pids(self) -> dict[str, int]:
        out = {"controller": self.controller.pid} if self.controller else {}
        out.update({f"worker-{i}": p.pid for i, p in self.workers.items()})
        return out

    def log_tail(self, name: str, lines: int = 20) -> str:
        fname = "controller.log" if name == "controller" else f"worker-{name}.log"
        with contextlib.suppress(OSError):
            return "\n".join((self.home / fname).read_text(errors="replace").splitlines()[-lines:])
        return ""

    def close(self) -> None:
        stop_children(p for p in [*self.workers.values(), self.controller] if p is not None)
        for fh in self._logs:
            fh.close()
        self._tmp.cleanup()
        self._port.close()

    def __enter__(self) -> BenchCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_json(args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Runs a Python subprocess that prints one JSON object as its last stdout line."""
    r = subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} exited {r.returncode}: {r.stderr[-1500:]}")
    lines = r.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"{' '.join(args[:3])} printed nothing: {r.stderr[-1500:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    return out
