"""Shared fixtures: an isolated data directory and a real local cluster of subprocesses.

`LocalCluster` starts `python -m server.controller` and `python -m server.worker` processes on
free loopback ports with a temporary SQLite database, waits by polling (never sleeping for a
fixed time), and on teardown stops only the processes it started.

Fixtures:
- `pw_home`: a temporary PATHWAYS_HOME for this test (also set in the environment).
- `cluster`: function-scoped cluster; workers from `@pytest.mark.cluster(islands=.., devices=..,
  controller_args=[..], heartbeat_timeout=.., worker_env={..})`, default 2 islands ("a", "b") x 2
  devices, workers "w-a", "w-b". `worker_env` is extra environment for every worker process.
- `module_cluster`: the same, one per test module (read-only tests share it).
- `make_cluster`: factory `make_cluster(islands=1, devices=2, controller_args=(), start=True)`.

Every process a cluster starts runs with `PATHWAYS_VALIDATE=1`: the state machines validate their
invariants after every stimulus. At teardown the fixtures scan the controller and worker logs for
"InvariantError" and fail the test when one was logged, so a broken invariant on real traffic
cannot pass unnoticed.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from precompile import compile_checkout

from pwctl.client import Client
from pwctl.errors import PathwaysError
from pwctl.local import stop_children, stop_island_services
from pwctl.paths import load_or_create_token, read_token
from schemas.pathways.v1 import common_pb2 as pb
from server.controller.job_process import end_all as end_job_supervisors
from server.ports import held_port, reserve_port

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
POLL_S = 0.05
XLA_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=20"
# The controller's --heartbeat-timeout for test clusters. On the shared 2-core machine a worker
# went silent for over 2 s now and then (an idle one, too), so at 2 s the controller marked it
# lost mid-test and it registered again: its runs failed ("host w-a lost: it held node 0") and its
# seqs restarted. A test that wants a silent worker found lost names a short timeout itself.
HEARTBEAT_TIMEOUT_S = 10.0


# A loopback port reserved for the rest of the test session: no other socket is handed it, while
# a server this test starts can bind it (server/ports.py). Closing a socket bound to port 0 and
# passing its port on was racy: a worker starting at the same time could get that port first.
free_port = held_port


def popen_interruptible(args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    """`subprocess.Popen` of a child that a test interrupts as Ctrl-C would, with SIGINT at its
    default in the child. A test runner started in the background by a non-interactive shell
    inherits SIGINT ignored, and an ignored signal stays ignored across exec, so the child would
    never see the test's SIGINT. A handled signal goes back to its default at exec: SIGINT is
    handled here for the moment of the start. (A `preexec_fn` did the same from the child, but
    forces a plain fork of this multi-threaded, JAX-importing process, which JAX warns of.)"""
    old = signal.getsignal(signal.SIGINT)
    if old is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(args, text=True, **kwargs)
    finally:
        if old is signal.SIG_IGN:
            signal.signal(signal.SIGINT, old)


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process `pid` holds (Linux /proc; empty once it is gone)."""
    found = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    found.add(link[len("socket:["):-1])
    return found


def connected_to(pid: int, port: int) -> bool:
    """Whether process `pid` holds an established TCP connection to loopback port `port` (Linux
    /proc). A client that talks to a server only inside its main loop is then past its imports
    and set-up: a test may interrupt it there, where a fixed sleep would race its start."""
    sockets = socket_inodes(pid)
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()  # sl local_address rem_address st ... inode
            if (len(fields) > 9 and fields[9] in sockets and fields[3] == "01"
                    and int(fields[2].rsplit(":", 1)[1], 16) == port):
                return True
    return False


def wait_for(predicate: Callable[[], T | None], timeout: float = 30.0, what: str = "condition",
             interval: float = POLL_S) -> T:
    """Polls `predicate` until it returns something truthy; returns that value."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (PathwaysError, OSError) as e:
            last_error = e
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}"
                               + (f" (last error: {last_error})" if last_error else ""))
        time.sleep(interval)


CONTROLLER_START_CAP_S = 90.0  # the longest a starting controller is waited for: under pytest's 120 s a test


def _progress(pid: int, log: Path) -> tuple[int, int]:
    """(CPU clock ticks, log bytes) of a starting process: either growing is progress."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (the stat file's 14th and 15th)
    except (OSError, ValueError, IndexError):
        ticks = 0
    try:
        size = log.stat().st_size
    except OSError:
        size = 0
    return ticks, size


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# The files that take longest (a run's `--durations=0`, summed per file), first: scripts/test.sh gives
# pytest-xdist whole files in collection order, and a long file started last keeps one worker busy
# while the other has nothing left to do.
LONGEST_FILES = ("test_multihost.py", "test_restart_sessions.py", "test_scheduling.py",
                 "test_slices_integration.py", "test_jobs.py", "test_trust_worker.py", "test_proxy_sharded.py",
                 "test_operator_edges.py", "test_programs.py", "test_hosts.py", "test_relays.py",
                 "test_status.py", "test_job_supervisor.py", "test_tls.py", "test_frozen_peer.py",
                 "test_chaos.py", "test_grpc_dead_peer.py", "test_tcp_dead_peer.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's order is kept


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # once, before pytest-xdist starts its workers
        compile_checkout(REPO)  # the processes the suite starts read it (tests/precompile.py)


@pytest.fixture(scope="session", autouse=True)
def _isolated_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No test reads or writes the user's real data directory, token or server setting."""
    saved = {k: os.environ.get(k) for k in ("PATHWAYS_HOME", "PWCTL_SERVER", "PWCTL_TOKEN")}
    os.environ["PATHWAYS_HOME"] = str(tmp_path_factory.mktemp("pw-session-home"))
    os.environ.pop("PWCTL_SERVER", None)
    os.environ.pop("PWCTL_TOKEN", None)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def pw_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh PATHWAYS_HOME for this test (pwctl.local and the CLI write their files there)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("PATHWAYS_HOME", str(home))
    return home


def base_env(home: Path, **extra: str) -> dict[str, str]:
    """A cluster's processes' environment. PYTHONPATH puts this checkout first, whatever a
    process's cwd (a client script under tests/clients): a git worktree sharing another
    checkout's editable install then runs its own code, not the install's."""
    env = {k: v for k, v in os.environ.items() if k not in ("PWCTL_SERVER", "PWCTL_TOKEN")}
    path = [str(REPO), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO))]
    env.update(PATHWAYS_HOME=str(home), XLA_FLAGS=XLA_FLAGS, NO_COLOR="1", COLUMNS="200",
               PYTHONUNBUFFERED="1", PATHWAYS_VALIDATE="1", PYTHONPATH=os.pathsep.join(path))
    env.update(extra)
    return env


def run_pwctl(*args: str, env: dict[str, str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pwctl.cli.main", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                            "compression")),
    grpc.ClientCallDetails,
):
    pass


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call, as pwctl's transport does."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._header], d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


def token_channel(address: str, token: str | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to `address` whose every call carries the cluster `token` (none: a plain one)."""
    channel = grpc.insecure_channel(address, options=list(options))
    return grpc.intercept_channel(channel, _Bearer(token)) if token else channel


@dataclass
class WorkerProc:
    name: str
    island: str
    devices: int | str  # a count of virtual CPU devices, or "all" (the accelerators)
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


class LocalCluster:
    """A controller and workers as real subprocesses, on a free loopback port and a temp database.

    Every process it starts is kept in `self.controller` / `self.workers`; `close()` stops those
    and nothing else.
    """

    def __init__(self, home: Path, heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
                 controller_args: Sequence[str] = (), worker_env: dict[str, str] | None = None) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        # the controller's port, held for this cluster so that no other socket takes it before the
        # controller binds it, nor between a stop and a restart on it (server/ports.py)
        self._port = reserve_port()
        self.port = self._port.port
        self.address = f"127.0.0.1:{self.port}"
        self.db_url = f"sqlite:///{home / 'pw.db'}"
        self.heartbeat_timeout = heartbeat_timeout
        self.controller_args = list(controller_args)
        self.worker_env = dict(worker_env or {})  # extra environment of every worker process
        self.controller: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, WorkerProc] = {}
        self._stopped: set[int] = set()  # SIGSTOPped pids, continued before teardown
        self._restarts = 0

    # ---- environment ----
    def env(self, **extra: str) -> dict[str, str]:
        """Environment for processes of this cluster (PATHWAYS_HOME, PWCTL_SERVER, XLA_FLAGS)."""
        return base_env(self.home, PWCTL_SERVER=self.address, **extra)

    @property
    def token(self) -> str | None:
        return read_token(self.home / "token")

    def channel(self, address: str | None = None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A raw gRPC channel to the controller (or a worker's `address`) that sends the token."""
        return token_channel(address or self.address, self.token, options)

    def client(self, timeout: float = 5.0) -> Client:
        return Client(server=self.address, token=self.token, timeout=timeout)

    # ---- controller ----
    def start_controller(self, wait: bool = True,
                         program: Sequence[str] = ("-m", "server.controller")) -> subprocess.Popen[bytes]:
        """Starts the controller (`program`: what Python runs, given the controller's flags)."""
        assert self.controller is None or self.controller.poll() is not None, "controller already running"
        log = self.home / f"controller-{self._restarts}.log"
        self._restarts += 1
        args = [sys.executable, *program, "--listen", self.address, "--db", self.db_url,
                "--heartbeat-timeout", f"{self.heartbeat_timeout:g}", "--log-level", "INFO",
                *self.controller_args]
        with open(log, "wb") as fh:
            self.controller = subprocess.Popen(args, env=self.env(), cwd=REPO, stdin=subprocess.DEVNULL,
                                               stdout=fh, stderr=subprocess.STDOUT)
        self._controller_log = log
        if wait:
            self.wait_controller()
        return self.controller

    def wait_controller(self, timeout: float = 30.0, cap: float = CONTROLLER_START_CAP_S) -> None:
        """Until the controller answers. A controller that exited fails at once, with its log's
        tail; one that makes no progress (neither its CPU time nor its log grows) for `timeout`
        s fails then; one still starting (a loaded machine: at load 13-15 a start took over 30 s)
        gets up to `cap` s in all."""
        proc = self.controller
        assert proc is not None
        started = moved = time.monotonic()
        seen = _progress(proc.pid, self._controller_log)
        last_error: Exception | None = None
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"controller exited with {proc.returncode}:\n" + log_tail(self._controller_log))
            try:
                with self.client(timeout=1.0) as c:
                    c.info(timeout=1.0)
                return
            except (PathwaysError, OSError) as e:
                last_error = e
            now = time.monotonic()
            progress = _progress(proc.pid, self._controller_log)
            if progress != seen:
                seen, moved = progress, now
            if now - moved > timeout or now - started > cap:
                why = f"no progress for {timeout:g} s" if now - moved > timeout else f"still starting after {cap:g} s"
                raise TimeoutError(f"the controller at {self.address} did not answer ({why}; last error: "
                                   f"{last_error}):\n" + log_tail(self._controller_log))
            time.sleep(POLL_S)

    def stop_controller(self, kill: bool = False) -> None:
        """SIGTERM (or SIGKILL) the controller and wait until it exited."""
        if self.controller is None or self.controller.poll() is not None:
            return
        self.controller.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.controller.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.controller.kill()
            self.controller.wait(timeout=10)

    def controller_logs(self) -> str:
        """Everything every controller of this cluster logged (one file per start)."""
        return "".join(p.read_text(errors="replace") for p in sorted(self.home.glob("controller-*.log")))

    def restart_controller(self, kill: bool = False) -> None:
        """Stops the controller and starts it again on the same port and database."""
        self.stop_controller(kill=kill)
        self.start_controller(wait=True)

    # ---- workers ----
    def add_worker(self, island: str, devices: int | str = 2, name: str | None = None,
                   wait: bool = True, env: dict[str, str] | None = None,
                   program: Sequence[str] = ("-m", "server.worker")) -> WorkerProc:
        """Starts a worker; `env` adds to the cluster's `worker_env` for this one; `program`: what
        Python runs (a script that wraps the worker: tests/clients/hostile_relay.py)."""
        name = name or f"w-{island}"
        assert name not in self.workers or self.workers[name].proc.poll() is not None, f"{name} is running"
        log = self.home / f"worker-{name}-{self._restarts}-{len(self.workers)}.log"
        args = [sys.executable, *program, "--island", island, "--devices", str(devices),
                "--server", self.address, "--name", name]
        extra = {"PWCTL_TOKEN": self.token} if self.token else {}
        extra.update(self.worker_env)
        extra.update(env or {})
        with open(log, "wb") as fh:
            proc = subprocess.Popen(args, env=self.env(**extra), cwd=REPO, stdin=subprocess.DEVNULL,
                                    stdout=fh, stderr=subprocess.STDOUT)
        worker = WorkerProc(name=name, island=island, devices=devices, proc=proc, log=log)
        self.workers[name] = worker
        if wait:
            self.wait_ready([name])
        return worker

    def start(self, workers: Sequence[tuple[str, int | str]] = (("a", 2), ("b", 2))) -> LocalCluster:
        """Starts the controller and the given (island, devices) workers at once; waits for all."""
        # the workers need the token (every call does, unless --no-token): made first, as `pwctl up`
        # does, so that the controller (which reads it) and the workers start at once
        if "--no-token" not in self.controller_args:
            load_or_create_token(self.home / "token")
        self.start_controller(wait=False)
        for island, devices in workers:
            self.add_worker(island, devices, wait=False)
        self.wait_controller()
        self.wait_ready()
        return self

    def hosts(self) -> dict[str, pb.Host]:
        with self.client() as c:
            return {h.name: h for h in c.hosts()}

    def wait_ready(self, names: Sequence[str] | None = None, timeout: float = 60.0) -> dict[str, pb.Host]:
        """Waits until the named workers (default: all started) are registered and ready, with
        the pid of the process this cluster started."""
        names = list(names if names is not None else self.workers)

        def ready() -> dict[str, pb.Host] | None:
            for n in names:
                w = self.workers[n]
                if w.proc.poll() is not None:
                    raise RuntimeError(f"worker {n} exited with {w.proc.returncode}:\n{log_tail(w.log)}")
            hosts = self.hosts()
            ok = all(n in hosts and hosts[n].state == pb.HOST_STATE_READY
                     and hosts[n].pid == self.workers[n].pid for n in names)
            return hosts if ok else None

        return wait_for(ready, timeout, f"workers {names} to be ready")

    def wait_host_state(self, name: str, state: pb.HostState.ValueType, timeout: float = 30.0) -> pb.Host:
        def in_state() -> pb.Host | None:
            h = self.hosts().get(name)
            return h if h is not None and h.state == state else None

        return wait_for(in_state, timeout, f"host {name} in state {pb.HostState.Name(state)}")

    def kill_worker(self, name: str) -> None:
        """SIGKILL the worker and reap it."""
        w = self.workers[name]
        self.cont_worker(name)
        w.proc.kill()
        w.proc.wait(timeout=10)

    def stop_worker(self, name: str) -> None:
        """SIGSTOP: the worker freezes (its heartbeats stop) but keeps its connection."""
        pid = self.workers[name].pid
        os.kill(pid, signal.SIGSTOP)
        self._stopped.add(pid)

    def cont_worker(self, name: str) -> None:
        pid = self.workers[name].pid
        if pid in self._stopped:
            os.kill(pid, signal.SIGCONT)
            self._stopped.discard(pid)

    # ---- the CLI, as a user runs it ----
    def pwctl(self, *args: str, env: dict[str, str] | None = None, timeout: float = 60.0,
              **extra_env: str) -> subprocess.CompletedProcess[str]:
        """Runs `python -m pwctl.cli.main ARGS` against this cluster (PWCTL_SERVER in the env)."""
        return run_pwctl(*args, env=env if env is not None else self.env(**extra_env), timeout=timeout)

    def pwctl_json(self, *args: str, **extra_env: str) -> Any:
        """Runs pwctl with `-o json`, asserts exit 0, returns the parsed document."""
        r = self.pwctl(*args, "-o", "json", env=self.env(**extra_env))
        assert r.returncode == 0, f"pwctl {' '.join(args)} exited {r.returncode}: {r.stderr}"
        return json.loads(r.stdout)

    # ---- teardown ----
    def close(self) -> None:
        """Stops only the processes this cluster started: SIGTERM, then SIGKILL after 5 s."""
        for pid in list(self._stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._stopped.clear()
        procs = [w.proc for w in self.workers.values()]
        if self.controller is not None:
            procs.append(self.controller)
        stop_children(procs)
        end_job_supervisors(self.home / "jobs")  # jobs outlive their controller by design
        stop_island_services(self.home / "island-services.json")  # they outlive it too
        self._port.close()

    def invariant_failures(self) -> list[str]:
        """The logs of this cluster's processes that report a broken invariant, with the report."""
        found: list[str] = []
        for log in sorted(self.home.glob("*.log")):
            text = log.read_text(errors="replace")
            at = text.find("InvariantError")
            if at >= 0:
                found.append(f"{log.name}:\n{text[max(0, at - 200):at + 4000]}")
        return found

    def check_invariants(self) -> None:
        """Fails the running test if a process of this cluster logged an InvariantError."""
        found = self.invariant_failures()
        if found:
            pytest.fail("a state machine's invariant broke on real traffic:\n" + "\n\n".join(found),
                        pytrace=False)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close()
        if exc_type is None:  # after close(): every log is complete
            self.check_invariants()


def _cluster_from_marker(request: pytest.FixtureRequest, home: Path) -> Iterator[LocalCluster]:
    marker = request.node.get_closest_marker("cluster")
    kw: dict[str, Any] = dict(marker.kwargs) if marker else {}
    islands = int(kw.get("islands", 2))
    devices = int(kw.get("devices", 2))
    names = [chr(ord("a") + i) for i in range(islands)]
    with LocalCluster(home, heartbeat_timeout=float(kw.get("heartbeat_timeout", HEARTBEAT_TIMEOUT_S)),
                      controller_args=kw.get("controller_args", ()), worker_env=kw.get("worker_env")) as c:
        c.start([(n, devices) for n in names])
        yield c


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalCluster]:
    """A fresh cluster for this test; size via `@pytest.mark.cluster(islands=2, devices=2)`."""
    yield from _cluster_from_marker(request, tmp_path / "cluster")


@pytest.fixture(scope="module")
def module_cluster(request: pytest.FixtureRequest,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One cluster shared by a module's tests (2 islands x 2 devices unless the module's
    `pytestmark` carries `pytest.mark.cluster(...)`). Tests must leave it as they found it."""
    yield from _cluster_from_marker(request, tmp_path_factory.mktemp("module-cluster"))


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """Factory for tests needing special clusters: make_cluster(islands=1, devices=2,
    controller_args=(), heartbeat_timeout=HEARTBEAT_TIMEOUT_S, start=True). All are closed at teardown."""
    made: list[LocalCluster] = []

    def make(islands: int = 1, devices: int = 2, controller_args: Sequence[str] = (),
             heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S, start: bool = True) -> LocalCluster:
        c = LocalCluster(tmp_path / f"cluster-{len(made)}", heartbeat_timeout, controller_args)
        made.append(c)
        if start:
            c.start([(chr(ord("a") + i), devices) for i in range(islands)])
        return c

    yield make
    for c in made:
        c.close()
    for c in made:
        c.check_invariants()
