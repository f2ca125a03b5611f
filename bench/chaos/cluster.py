"""The chaos run's own local cluster: a controller and one worker per island, each a real
process that can be killed (-9) and started again on the same port, database and data directory.
Every start logs to its own file, so the logs can be searched for tracebacks afterwards. It stops
only what it started."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench.cluster import REPO, XLA_FLAGS, free_port
from pwctl.client import Client
from pwctl.errors import PathwaysError
from pwctl.local import stop_children
from pwctl.paths import load_or_create_token, read_token
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

POLL_S = 0.05


class ChaosCluster:
    def __init__(self, islands: tuple[str, ...] = ("a", "b"), devices: int = 2, heartbeat_timeout: float = 2.0,
                 home: Path | None = None, controller_args: tuple[str, ...] = ()) -> None:
        self._tmp = None if home is not None else tempfile.TemporaryDirectory(prefix="pw-chaos-")
        self.home = home if home is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        self.address = f"127.0.0.1:{free_port()}"
        self.islands = islands
        self.devices = devices
        self.heartbeat_timeout = heartbeat_timeout
        self.controller_args = list(controller_args)
        self.controller: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.starts = 0
        self._files: list[Any] = []

    # ---- processes ----
    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PWCTL_")}
        env.update(PATHWAYS_HOME=str(self.home), PWCTL_SERVER=self.address, XLA_FLAGS=XLA_FLAGS,
                   PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
        env.update(extra)
        return env

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        self.starts += 1
        fh = open(self.home / f"{log}-{self.starts}.log", "wb")  # noqa: SIM115 (closed in close())
        self._files.append(fh)
        return subprocess.Popen(args, env=self.env(), cwd=REPO, stdin=subprocess.DEVNULL, stdout=fh,
                                stderr=subprocess.STDOUT)

    def start_controller(self) -> None:
        self.controller = self._spawn(
            [sys.executable, "-m", "server.controller", "--listen", self.address, "--db",
             f"sqlite:///{self.home / 'pw.db'}", "--heartbeat-timeout", f"{self.heartbeat_timeout:g}",
             "--metrics-listen", "off", "--log-level", "INFO", *self.controller_args], "controller")

    def start_worker(self, island: str) -> None:
        self.workers[island] = self._spawn(
            [sys.executable, "-m", "server.worker", "--island", island, "--devices", str(self.devices),
             "--server", self.address, "--name", f"chaos-{island}"], f"worker-{island}")

    def kill(self, proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def dump_stacks(self) -> None:
        """Every thread's stack of the controller and the workers, into their logs (SIGUSR1,
        server/stackdump.py), and the controller's status document beside them: what a stuck
        call is diagnosed from."""
        for p in [self.controller, *self.workers.values()]:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGUSR1)
        with contextlib.suppress(PathwaysError, OSError), self.client() as c:
            from google.protobuf import json_format

            status = c.status()
            (self.home / f"status-{time.time():.3f}.json").write_text(json_format.MessageToJson(status))

    @property
    def token(self) -> str | None:
        """The cluster token, which every call needs (the workers' registration too)."""
        return read_token(self.home / "token")

    def start(self, timeout: float = 90.0) -> ChaosCluster:
        load_or_create_token(self.home / "token")  # before the controller and the workers start at once
        self.start_controller()
        for island in self.islands:
            self.start_worker(island)
        self.wait_ready(timeout)
        return self

    # ---- state ----
    def client(self, timeout: float = 5.0) -> Client:
        return Client(server=self.address, token=self.token, timeout=timeout)

    def answers(self) -> bool:
        try:
            with self.client(timeout=1.0) as c:
                c.info(timeout=1.0)
            return True
        except PathwaysError:
            return False

    def hosts(self) -> dict[str, Any]:
        with self.client() as c:
            return {h.name: h for h in c.hosts()}

    def ready(self) -> bool:
        try:
            hosts = self.hosts()
        except PathwaysError:
            return False
        return all(hosts.get(f"chaos-{i}") is not None and hosts[f"chaos-{i}"].state == pb.HOST_STATE_READY
                   and hosts[f"chaos-{i}"].pid == self.workers[i].pid for i in self.islands)

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Waits until the controller answers and every worker is ready; returns the time taken."""
        start = time.monotonic()
        while not self.ready():
            for name, p in [("controller", self.controller), *self.workers.items()]:
                if p is not None and p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode} (logs in {self.home})")
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"cluster not ready after {timeout:g} s (logs in {self.home})")
            time.sleep(POLL_S)
        return time.monotonic() - start

    def snapshot(self) -> dict[str, Any]:
        """What must survive kills and hostile requests: islands, hosts and named slices."""
        with self.client() as c:
            return {"islands": sorted(i.name for i in c.islands()),
                    "hosts": sorted((h.name, h.island, h.devices) for h in c.hosts()),
                    "named_slices": sorted((s.name, s.spec.devices) for s in c.slices() if not s.owner)}

    def worker_buffers(self, what: str = "buffers") -> dict[str, int]:
        """The buffers each worker holds (its `Stats`; `what`: "tombstones" for its releases of
        buffers that never came), by island."""
        out = {}
        for island in self.islands:
            with grpc.insecure_channel(self.hosts()[f"chaos-{island}"].address) as ch:
                stats = wgrpc.WorkerStub(ch).Stats(wpb.WorkerStatsRequest(), timeout=10,
                                                   metadata=(("authorization", f"Bearer {self.token}"),))
            out[island] = int(getattr(stats, what))
        return out

    def logs(self, prefix: str) -> list[Path]:
        return sorted(self.home.glob(f"{prefix}-*.log"))

    def tracebacks(self, prefix: str) -> int:
        return sum(p.read_text(errors="replace").count("Traceback (most recent call last)") for p in self.logs(prefix))

    def integrity(self) -> str:
        """SQLite's integrity check of the database ("ok" when sound)."""
        with contextlib.closing(sqlite3.connect(self.home / "pw.db")) as db:
            return str(db.execute("PRAGMA integrity_check").fetchone()[0])

    def close(self) -> None:
        procs = [p for p in [*self.workers.values(), self.controller] if p is not None]
        stop_children(procs)
        for fh in self._files:
            fh.close()
        if self._tmp is not None:
            self._tmp.cleanup()
