"""Separate hosts on one machine: one network, mount and UTS namespace per host (needs root).

Shared by the tests (tests/hosts.py wraps it in the `hosts` fixture) and the multi-host
benchmarks (bench/multihost.py); no pytest here.

Each host has its own network namespace with one address, 10.251.K.(i+1)/24, on a bridge that
lives in a namespace of its own (K differs per `Hosts` instance), loopback up, its own hostname
and a private tmpfs on /dev/shm. A holder process (`sleep infinity`) keeps each host's mount and
UTS namespaces; everything run "on" a host enters all three through `nsenter`.

The root namespace has no route to 10.251.K.0/24: a connect from it would leave the machine by the
default gateway. So every client of a cluster on these hosts (the CLI, programs, probes) runs
inside one of them (`Host.run`, `Host.popen`, `Host.pwctl`).

Teardown kills every process whose network namespace is one of ours (only what the caller started
can be in them), then deletes exactly the namespaces this instance created. Where `ip netns` is not
usable the namespaces are held by `unshare --net` processes instead, and veths are created
straight into them by pid.

`unavailable()` says why namespaces cannot be made here (not root, a tool missing), or None;
`Hosts.start` raises `NamespaceUnavailable` with the reason when the kernel refuses.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
XLA_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=20"
READY_TIMEOUT_S = 15.0
_instances = itertools.count((os.getpid() % 200) + 1)  # K of 10.251.K.0/24, per instance


class NamespaceUnavailable(Exception):
    """Namespaces cannot be made here (the reason is the message)."""


def _run(args: Sequence[str], timeout: float = 15.0) -> None:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise NamespaceUnavailable(f"`{' '.join(args)}` failed: {(r.stderr or r.stdout).strip()}")


def _netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _pids_in_netns(inode: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                    pids.append(int(entry))
    return pids


def _wait_line(proc: subprocess.Popen[str], want: str, timeout: float) -> None:
    """Reads the holder's stdout until `want` (its set-up is done) or raises with its stderr."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.strip() == want:
                return
            if not line:
                break
        if proc.poll() is not None:
            break
    proc.kill()
    err = proc.stderr.read() if proc.stderr is not None else ""
    raise NamespaceUnavailable(f"a namespace holder did not start: {err.strip() or 'no output'}")


@dataclass
class Host:
    """One host: its namespaces (held by `holder`), address, hostname and data directory."""

    index: int
    hostname: str
    ip: str
    home: Path  # PATHWAYS_HOME of this host's processes (a host's disk; /dev/shm is private)
    holder: subprocess.Popen[str]
    netns: str | None  # the `ip netns` name, None with unshare holders
    inode: int = 0  # the network namespace's identity

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` as run inside this host's network, mount and UTS namespaces, from the repository."""
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-m", "-u", f"--wd={REPO}", "--", *cmd]

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PWCTL_SERVER", "PWCTL_TOKEN")}
        env.update(PATHWAYS_HOME=str(self.home), XLA_FLAGS=XLA_FLAGS, NO_COLOR="1", COLUMNS="200",
                   PYTHONUNBUFFERED="1", PATHWAYS_VALIDATE="1")
        env.update(extra)
        return env

    def run(self, cmd: Sequence[str], timeout: float = 60.0, **env: str) -> subprocess.CompletedProcess[str]:
        """Runs `cmd` on this host to its end. Past `timeout` a Python process is sent SIGABRT
        first, so that its threads' stacks (PYTHONFAULTHANDLER) come with the TimeoutExpired's
        stderr: a hang in a test says where it hung."""
        with subprocess.Popen(self.argv(cmd), env=self.env(PYTHONFAULTHANDLER="1", **env), text=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)  # nsenter execs the command: this is its pid
                try:
                    out, err = proc.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, err = proc.communicate()
                # shown with the failing test (pytest's captured stderr)
                sys.stderr.write(f"{' '.join(map(str, cmd))} timed out after {timeout} s; its output:\n{out}\n{err}\n")
                raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def popen(self, cmd: Sequence[str], stdin: int = subprocess.DEVNULL, **env: str) -> subprocess.Popen[str]:
        """Starts `cmd` on this host, stdout piped (line-buffered text), stderr merged into it;
        `stdin=subprocess.PIPE` to write to it."""
        return subprocess.Popen(self.argv(cmd), env=self.env(**env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, stdin=stdin)

    def pwctl(self, *args: str, timeout: float = 90.0, **env: str) -> subprocess.CompletedProcess[str]:
        return self.run([sys.executable, "-m", "pwctl.cli.main", *args], timeout=timeout, **env)

    def kill_all(self) -> list[int]:
        """kill -9 of every process on this host but its holder (the host fails; its namespaces
        stay for the teardown); returns their pids."""
        pids = [p for p in _pids_in_netns(self.inode) if p != self.holder.pid]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def python(self, code: str, timeout: float = 90.0, **env: str) -> subprocess.CompletedProcess[str]:
        return self.run([sys.executable, "-c", code], timeout=timeout, **env)


@dataclass
class Hosts:
    """The hosts of one test and the bridge between them; `close()` undoes exactly what was made."""

    root: Path
    k: int = field(default_factory=lambda: next(_instances) % 250 + 1)
    hosts: list[Host] = field(default_factory=list)
    _netns: list[str] = field(default_factory=list)  # `ip netns` names created, deleted at close
    _bridge: subprocess.Popen[str] | None = None  # the bridge's holder without `ip netns`
    _use_netns: bool = True

    @property
    def prefix(self) -> str:
        return f"pwt{os.getpid()}k{self.k}"

    # ---- namespaces ----
    def _ip_in(self, target: str | int, *args: str) -> None:
        """`ip ARGS` inside a namespace: an `ip netns` name, or the pid of a holder."""
        if isinstance(target, int):
            _run(["nsenter", "-t", str(target), "-n", "ip", *args])
        else:
            _run(["ip", "-n", target, *args])

    def _make_bridge(self) -> str | int:
        name = f"{self.prefix}br"
        if self._use_netns:
            try:
                _run(["ip", "netns", "add", name])
                self._netns.append(name)
                return name
            except NamespaceUnavailable:
                self._use_netns = False
        proc = subprocess.Popen(["unshare", "--net", "sh", "-c", "echo ready; exec sleep infinity"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._bridge = proc
        _wait_line(proc, "ready", READY_TIMEOUT_S)
        return proc.pid

    def start(self, n: int) -> list[Host]:
        for tool in ("ip", "nsenter", "unshare"):
            if shutil.which(tool) is None:
                raise NamespaceUnavailable(f"`{tool}` is not installed")
        bridge = self._make_bridge()
        self._ip_in(bridge, "link", "set", "lo", "up")
        self._ip_in(bridge, "link", "add", "br0", "type", "bridge")
        self._ip_in(bridge, "link", "set", "br0", "up")
        for i in range(n):
            self._make_host(i, bridge)
        return list(self.hosts)

    def _make_host(self, i: int, bridge: str | int) -> None:
        hostname = f"pw-host{i}"
        # the host's own mount (a private /dev/shm) and UTS (hostname) namespaces, kept by a holder
        setup = (f"mount -t tmpfs -o size=256m,mode=1777 tmpfs /dev/shm && hostname {hostname} "
                 "&& echo ready && exec sleep infinity")
        inner = ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", setup]
        netns = None
        if self._use_netns:
            netns = f"{self.prefix}h{i}"
            _run(["ip", "netns", "add", netns])
            self._netns.append(netns)
            args = ["ip", "netns", "exec", netns, *inner]
        else:
            args = ["unshare", "--net", *inner[1:]]
        holder = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  stdin=subprocess.DEVNULL)
        host = Host(index=i, hostname=hostname, ip=f"10.251.{self.k}.{i + 1}", home=self.root / hostname,
                    holder=holder, netns=netns)
        self.hosts.append(host)  # torn down from here on, even if the set-up below fails
        _wait_line(holder, "ready", READY_TIMEOUT_S)
        host.inode = _netns_inode(holder.pid)
        host.home.mkdir(parents=True, exist_ok=True)
        target: str | int = netns if netns is not None else holder.pid
        # the veth pair is made straight into the two namespaces: it never exists in the root one
        bridge_side = f"h{i}"
        _run(["ip", "link", "add", "name", "eth0", "netns", str(target), "type", "veth",
              "peer", "name", bridge_side, "netns", str(bridge)])
        self._ip_in(bridge, "link", "set", bridge_side, "master", "br0", "up")
        self._ip_in(holder.pid, "link", "set", "lo", "up")
        self._ip_in(holder.pid, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        self._ip_in(holder.pid, "link", "set", "eth0", "up")

    # ---- teardown ----
    def close(self) -> None:
        errors = []
        for host in self.hosts:
            if host.inode:
                # everything in our namespaces is ours; detached daemons too (pwctl's workers)
                for _ in range(50):
                    pids = _pids_in_netns(host.inode)
                    if not pids:
                        break
                    for pid in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    time.sleep(0.05)
            host.holder.kill()
            host.holder.wait(timeout=10)
        if self._bridge is not None:
            self._bridge.kill()
            self._bridge.wait(timeout=10)
        for name in reversed(self._netns):
            r = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, timeout=15)
            if r.returncode != 0:
                errors.append(f"ip netns del {name}: {r.stderr.strip()}")
        self._netns.clear()
        self.hosts.clear()
        if errors:
            raise RuntimeError("; ".join(errors))


def unavailable() -> str | None:
    """Why separate hosts cannot be made here before trying (None: try `Hosts.start`)."""
    if os.geteuid() != 0:
        return "separate hosts need root (network, mount and UTS namespaces)"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None
