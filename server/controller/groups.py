"""One `jax.distributed` group per island that spans hosts, decided here.

An island's live hosts form one multi-process JAX group, so that a slice over devices of several
of them runs one SPMD computation whose collectives cross hosts (server/worker/group.py is the
worker's side; docs/multihost.md has the measurements behind every choice below).

- A group cannot be rejoined, so every change of membership (a host joins, is lost, returns) is
  a new *generation*: new members list, process ids 0..n-1 in host-name order, and a new
  coordination service on a fresh port.
- The service runs in a process of its own (`python -m server.controller.coordsvc`), started
  detached by the controller with ``recoverable=True``: a member's death then never aborts the
  others, and a controller restart does not end it (a service's death aborts every member still
  connected to it within ~0.2 s, so a service is stopped only once no member is left in it:
  each joined a newer generation or is gone).
- Until every member reports `GroupJoined` for the generation, it is *forming*: a multi-host
  slice on the island cannot run (placements say so). Runs of an older generation fail on the
  workers ("generation replaced"); the scheduler fails runs that touched a lost host at once.

Everything runs on the controller's event loop. Membership changes come in bursts (hosts
registering together at start), so a re-form waits `SETTLE_S` for the burst to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from schemas.pathways.v1 import controller_pb2 as cpb

from .. import paths
from ..ports import reserve_port
from .cluster import READY, HostInfo

log = logging.getLogger(__name__)

GROUP_STRIDE = 65536  # group-wide device number = process * GROUP_STRIDE + local index (as the worker's)
SETTLE_S = 0.3  # a burst of membership changes makes one generation
# an old generation's service is stopped this long after it was replaced even if a member never
# left it (that member is then aborted: it ignored the controller for two minutes)
RETIRE_AFTER_S = 120.0
SERVICE_START_S = 10.0


@dataclass
class Generation:
    """One group of an island: its members by process id and who has joined so far."""

    island: str
    number: int
    members: tuple[str, ...]
    coordinator: str
    service: subprocess.Popen[bytes] | None
    started: float = field(default_factory=time.monotonic)
    joined: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # member -> why it could not join
    left: set[str] = field(default_factory=set)  # members in a newer generation, or gone
    retired: float = 0.0  # when a newer generation replaced it (monotonic)

    @property
    def ready(self) -> bool:
        return set(self.members) <= self.joined and not self.failed

    def process_of(self, host: str) -> int:
        return self.members.index(host)


class IslandGroups:
    """The current generation of every multi-host island, and the services of older ones until
    their members have left them."""

    def __init__(self, hosts: dict[str, HostInfo], hosts_of: Callable[[str], Iterable[HostInfo]],
                 send: Callable[[str, cpb.ControllerToWorker], None], bind_host: str,
                 start_service: Callable[[str, int], subprocess.Popen[bytes]] | None = None) -> None:
        self._hosts = hosts
        self._hosts_of = hosts_of
        self._send = send
        self._bind_host = bind_host
        self._start_service = start_service or start_service_process
        self.current: dict[str, Generation] = {}
        self._retiring: list[Generation] = []
        self._due: dict[str, asyncio.TimerHandle] = {}
        # generations are unique over controller restarts too (a worker compares them)
        self._numbers = itertools.count(int(time.time() * 1000) % (1 << 40))
        self.listeners: list[Callable[[str], None]] = []  # island whose usable group changed
        self._forming: set[str] = set()  # islands whose next service is starting
        self._ready_events: dict[str, asyncio.Event] = {}  # wait_usable's wake-ups
        self._wanted: set[str] = set()  # islands with a slice over several hosts (see want)
        self._tasks: set[asyncio.Task[None]] = set()
        self._record_path = paths.island_services_path()
        # services an earlier controller left running: listed (so they stay) until reaped
        self._inherited: list[int] = []
        try:
            old = json.loads(self._record_path.read_text()).get("pids", [])
            self._inherited = [p for p in old if isinstance(p, int) and _is_service(p)]
        except (OSError, ValueError, AttributeError):
            pass
        self._record()  # this controller's pid now: a restart does not orphan the services

    # ---- queries ----
    def usable(self, island: str) -> Generation | None:
        """The island's generation when every member has joined it, else None."""
        g = self.current.get(island)
        return g if g is not None and g.ready else None

    async def wait_usable(self, island: str, timeout: float) -> bool:
        """Waits until the island's group is usable (True) or `timeout` passed (False)."""
        deadline = time.monotonic() + timeout
        while self.usable(island) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            event = self._ready_events.setdefault(island, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), min(left, 1.0))
            except TimeoutError:
                pass
        return True

    def summary(self, island: str) -> str:
        """One short line on the island's group for listings ("" for an island without one)."""
        g = self.current.get(island)
        if g is None:
            return "forming" if island in self._forming or island in self._due else ""
        if g.failed:
            return f"gen {g.number}: failed ({', '.join(sorted(g.failed))})"
        if not g.ready:
            return f"gen {g.number}: forming (waiting for {', '.join(sorted(set(g.members) - g.joined))})"
        return f"gen {g.number}: {len(g.members)} hosts"

    def describe(self, island: str) -> str:
        """Why a multi-host slice of the island cannot run now (for errors)."""
        g = self.current.get(island)
        if g is None and (island in self._forming or island in self._due):
            return f"island {island}'s group is forming"
        if g is None:
            return f"island {island} has no multi-host group (fewer than two ready hosts)"
        if g.failed:
            # a member that had joined left a formed group (lost, or registered again); one that
            # had not could not join: the group never formed
            left = {h: e for h, e in g.failed.items() if h in g.joined}
            if left:
                return f"island {island}'s group generation {g.number} lost a member: " + "; ".join(
                    f"{h}: {e}" for h, e in sorted(left.items()))
            return f"island {island}'s group generation {g.number} failed to form: " + "; ".join(
                f"{h}: {e}" for h, e in sorted(g.failed.items()))
        waiting = sorted(set(g.members) - g.joined)
        return f"island {island}'s group is forming (generation {g.number}, waiting for {', '.join(waiting)})"

    # ---- membership events (the cluster's listeners) ----
    def want(self, island: str) -> None:
        """A slice spans hosts of `island`: from now on it keeps a group of its live hosts
        (islands whose slices each stay on one host never need one, and never pay for re-forms)."""
        if island not in self._wanted:
            self._wanted.add(island)
            self._schedule(island)

    def host_up(self, info: HostInfo) -> None:
        # a registration (a new worker process, or a worker whose stream broke) is in no group:
        # the worker leaves its group when it registers, so its generation must form again
        self._leave_all(info.name)
        self._member_gone(info, "it registered again")
        if info.island in self._wanted:
            self._schedule(info.island)

    def host_lost(self, info: HostInfo, reason: str) -> None:
        self._leave_all(info.name)
        self._member_gone(info, f"lost ({reason})")
        if info.island in self._wanted:
            self._schedule(info.island)

    def _member_gone(self, info: HostInfo, why: str) -> None:
        """A member of the island's current generation is no longer in it: the generation is not
        usable from now on (the next one forms), and placements kept from it are stale."""
        cur = self.current.get(info.island)
        if cur is not None and info.name in cur.members and info.name not in cur.failed:
            was_ready = cur.ready
            cur.failed[info.name] = why
            if was_ready:
                self._changed(info.island)

    def joined(self, host: str, generation: int, error: str) -> None:
        """A worker's GroupJoined."""
        for g in (*self.current.values(), *self._retiring):
            if g.number != generation:
                continue
            if error:
                g.failed[host] = error
                log.error("host %s could not join group generation %d of island %s: %s", host, generation,
                          g.island, error)
                self._schedule(g.island)  # try again (the failing member may be gone by then)
            else:
                g.joined.add(host)
                if g.ready and self.current.get(g.island) is g:
                    log.info("island %s: group generation %d ready (%s)", g.island, g.number, ", ".join(g.members))
                    self._changed(g.island)
        for old in self._retiring:
            if host in old.members and old.number < generation:
                old.left.add(host)
        self._stop_retired()

    # ---- re-forming ----
    def _schedule(self, island: str) -> None:
        if island in self._due:
            return
        loop = asyncio.get_running_loop()
        self._due[island] = loop.call_later(SETTLE_S, self._reform, island)

    def _reform(self, island: str) -> None:
        self._due.pop(island, None)
        if island in self._forming:  # a service is starting: it re-checks the members when up
            return
        members = self._members(island)
        cur = self.current.get(island)
        if cur is not None and cur.members == members and not cur.failed:
            return
        if cur is not None:
            self._retire(cur)
            del self.current[island]
            if cur.ready:  # its placements are stale now (slices.py keeps them per epoch)
                self._changed(island)
        if len(members) < 2:
            for name in (cur.members if cur is not None else ()):
                if name in members:  # the one left alone: its devices are its own again
                    self._send(name, cpb.ControllerToWorker(join=cpb.JoinGroup(generation=next(self._numbers),
                                                                               num_processes=1)))
            self._changed(island)
            return
        self._forming.add(island)
        task = asyncio.get_running_loop().create_task(self._form(island, members))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _members(self, island: str) -> tuple[str, ...]:
        members = tuple(sorted(h.name for h in self._hosts_of(island) if h.state == READY and h.link is not None))
        if len(members) >= 2 and any(self._hosts[m].kind != "cpu" for m in members):
            log.warning("island %s spans hosts with %s devices: multi-host groups are built for CPU "
                        "devices (gloo) only here", island, self._hosts[members[0]].kind)
            return ()
        return members

    async def _form(self, island: str, members: tuple[str, ...]) -> None:
        try:
            service, coordinator = await asyncio.to_thread(self._start, len(members))
        except OSError as e:
            log.error("island %s: cannot start a coordination service: %s", island, e)
            return
        finally:
            self._forming.discard(island)
        if self._members(island) != members:  # it changed while the service started: again
            stop_service(service)
            self._schedule(island)
            return
        number = next(self._numbers)
        g = Generation(island, number, members, coordinator, service)
        self.current[island] = g
        self._record()
        log.info("island %s: forming group generation %d of %s (coordinator %s)", island, number,
                 ", ".join(members), coordinator)
        for pid, name in enumerate(members):
            host = self._hosts[name]
            self._send(name, cpb.ControllerToWorker(join=cpb.JoinGroup(
                generation=number, coordinator=coordinator, process_id=pid, num_processes=len(members),
                gloo_host=paths.split_address(host.address)[0], members=list(members),
                member_addresses=[paths.split_address(self._hosts[m].address)[0] for m in members])))
        self._changed(island)

    def _start(self, n: int) -> tuple[subprocess.Popen[bytes], str]:
        # The port stays reserved (server/ports.py) until the service has bound it: closed before
        # the service started, any process of the host could take it first, and the group
        # failed to form.
        with reserve_port(self._bind_host) as port:
            return self._start_service(port.address, n), port.address

    def _retire(self, g: Generation) -> None:
        g.left |= {m for m in g.members if self._hosts.get(m) is None or self._hosts[m].state != READY}
        g.retired = time.monotonic()
        self._retiring.append(g)
        self._stop_retired()

    def _leave_all(self, host: str) -> None:
        for g in self._retiring:
            if host in g.members:
                g.left.add(host)
        self._stop_retired()

    def _stop_retired(self) -> None:
        now = time.monotonic()
        keep = []
        for g in self._retiring:
            if set(g.members) <= g.left or now - g.retired > RETIRE_AFTER_S:
                stop_service(g.service)
            else:
                keep.append(g)
        if len(keep) != len(self._retiring):
            self._retiring = keep
            self._record()

    def _changed(self, island: str) -> None:
        event = self._ready_events.pop(island, None)
        if event is not None:
            event.set()
        for cb in self.listeners:
            cb(island)

    def _record(self) -> None:
        """Keeps the pids of running services in the data directory: a controller that restarts
        stops its predecessor's once their members have left them (workers leave their group when
        they register again)."""
        pids = [g.service.pid for g in (*self.current.values(), *self._retiring)
                if g.service is not None and g.service.poll() is None]
        pids += [p for p in self._inherited if _is_service(p)]
        try:
            _write_private(self._record_path, json.dumps({"controller_pid": os.getpid(), "pids": pids}))
        except OSError as e:
            log.warning("cannot record the island services in %s: %s", self._record_path, e)

    def reap_orphans(self) -> int:
        """Stops the services an earlier controller left running (their members have registered
        again with this one, which made them leave). Returns how many it stopped."""
        pids, self._inherited = self._inherited, []
        stopped = 0
        for pid in pids:
            if _is_service(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGTERM)
                    stopped += 1
        if stopped:
            log.info("stopped %d island coordination service(s) of an earlier controller", stopped)
        self._record()
        return stopped

    def close(self) -> None:
        """The controller stops: services stay up for the members still in them (the next
        controller re-forms the groups and stops them once their members left)."""
        for handle in self._due.values():
            handle.cancel()
        self._due.clear()


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _is_service(pid: int) -> bool:
    try:
        return b"server.controller.coordsvc" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def coordinator_host(listen: str) -> str:
    """The address the island services bind and members dial: the controller's own listening
    address, or, where it listens on every interface, the address its hostname resolves to."""
    host = paths.split_address(listen)[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return host


def start_service_process(address: str, n: int) -> subprocess.Popen[bytes]:
    """Starts a coordination service for `n` members at `address`, detached (it outlives a
    controller restart), and waits until it listens."""
    record = str(paths.island_services_path())
    proc = subprocess.Popen([sys.executable, "-m", "server.controller.coordsvc", address, str(n), record],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=os.environ.copy())
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "ready" once bound (a fraction of a second: jaxlib only)
    if line.strip() != b"ready":
        stop_service(proc)
        raise OSError(f"the coordination service at {address} did not start")
    proc.stdout.close()
    return proc


def stop_service(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
