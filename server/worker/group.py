"""The worker's membership in its island's `jax.distributed` group (islands spanning hosts).

An island of several hosts runs one SPMD computation over all their devices: every member
worker's JAX backend belongs to one multi-process group, whose coordination service the
controller starts per *generation* (server/controller/groups.py). Measured facts behind this
design are in docs/multihost.md; the ones that decide it:

- the service runs outside every member, with ``recoverable=True``: a member's death then never
  aborts the others (their pending collectives fail after the collective timeout, which
  ``server/worker/__main__.py`` sets), while a member hosting the service would take the group
  down with it;
- a group cannot be rejoined: every membership change is a new generation with a new service.
  A member leaves in-process (``client.shutdown()``, then ``clear_backends()``) and connects to
  the next one; arrays made before stay readable and move onto the new devices when used;
- gloo advertises ``gethostname()`` by default, which on real clusters (and on the test hosts)
  does not resolve to the address peers can reach: the backend factory installed here gives it
  the address the worker registered with (`JoinGroup.gloo_host`).

Device numbers of a group segment (`SegmentDef.group_generation` set) are group-wide: process
* `GROUP_STRIDE` + local index. `local_device_number` turns them into this worker's numbering:
its own devices keep their local index, a peer's become `REMOTE` + the group-wide number, so the
executor's per-device bookkeeping never mistakes a peer's device for one of its own.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

GROUP_STRIDE = 65536
REMOTE = 1 << 30
INIT_TIMEOUT_S = 20  # every member connects within this, else the join fails (the controller re-forms)
HEARTBEAT_TIMEOUT_S = 10
SHUTDOWN_TIMEOUT_S = 5

_gloo_host: str | None = None
_installed = False
_lock = threading.Lock()


def install_backend_factory() -> None:
    """Makes the CPU backend use gloo over the group's client with the address set here, once,
    before anything creates the backend (server/worker/__main__.py calls it first thing)."""
    global _installed
    with _lock:
        if _installed:
            return
        from jax._src import distributed, xla_bridge
        from jax._src.lib import _jax

        def factory() -> Any:
            client = distributed.global_state.client
            if client is None:
                return xla_bridge.make_cpu_client()
            collectives = _jax.make_gloo_tcp_collectives(client, hostname=_gloo_host)
            return xla_bridge.make_cpu_client(collectives=collectives)

        xla_bridge.register_backend_factory("cpu", factory, priority=0, fail_quietly=False)
        _installed = True


class IslandGroup:
    """This worker's place in its island's group: generation, process id, the devices of every
    member by process. Generation 0 is no group (a single-host island)."""

    def __init__(self) -> None:
        self.generation = 0
        self.process_id = 0
        self.num_processes = 1
        self.members: list[str] = []
        self.member_addresses: list[str] = []  # their gloo addresses, by process id
        self._by_process: dict[int, list[Any]] = {}
        self.announced = 0  # the generation announced last (see announce)
        self.announced_process = 0

    @property
    def active(self) -> bool:
        return self.num_processes > 1

    def announce(self, generation: int, process_id: int) -> None:
        """The controller told this worker to join `generation` (the launch thread joins later, in
        order): segments of that generation arriving meanwhile are read in its numbering."""
        self.announced, self.announced_process = generation, process_id

    def join(self, generation: int, coordinator: str, process_id: int, num_processes: int,
             gloo_host: str, members: list[str], member_addresses: list[str] | None = None) -> list[Any]:
        """Leaves the current group (if any) and joins generation `generation` (a group of one:
        none). Blocks until every member connected (at most INIT_TIMEOUT_S). Must run while no
        computation is launched (the executor's launch thread calls it, drained). Returns this
        worker's devices under the new backend, by local index."""
        global _gloo_host
        import jax
        from jax._src import api, distributed
        from jax._src.lib import _jax

        state = distributed.global_state
        old = state.client
        if old is not None:
            try:
                old.shutdown()  # recoverable service: returns at once even with a peer gone
            except Exception as e:  # the service may be gone already: nothing to leave
                log.info("leaving group generation %d: %s", self.generation, e)
        state.client = None
        state.process_id, state.num_processes, state.coordinator_address = 0, 1, None
        api.clear_backends()
        self._by_process = {}
        self.generation, self.process_id, self.num_processes, self.members = 0, 0, 1, []
        if num_processes > 1:
            _gloo_host = gloo_host or None
            client = _jax.get_distributed_runtime_client(
                coordinator, process_id, init_timeout=INIT_TIMEOUT_S, heartbeat_timeout=HEARTBEAT_TIMEOUT_S,
                shutdown_timeout=SHUTDOWN_TIMEOUT_S, use_compression=True, shutdown_on_destruction=False)
            client.connect()
            state.client = client
            state.process_id, state.num_processes, state.coordinator_address = process_id, num_processes, coordinator
        devices = jax.local_devices()
        if num_processes > 1:
            for d in jax.devices():
                self._by_process.setdefault(d.process_index, []).append(d)
            for devs in self._by_process.values():
                devs.sort(key=lambda d: d.id)
            if sorted(self._by_process) != list(range(num_processes)):
                raise RuntimeError(f"the group has processes {sorted(self._by_process)}, expected {num_processes}")
        self.generation, self.process_id, self.num_processes = generation, process_id, num_processes
        self.members = list(members)
        self.member_addresses = list(member_addresses or [])
        return list(devices)

    def explain(self, error: str) -> str:
        """A collective's failure, with the member it lost contact with named where the error
        shows its address (gloo: "Read error [10.0.0.3]:port", "Connection reset by peer")."""
        for name, address in zip(self.members, self.member_addresses, strict=False):
            if address and address != self.member_addresses[self.process_id] and f"[{address}]" in error:
                return (f"lost contact with host {name} ({address}) of island group generation "
                        f"{self.generation}: {error}")
        if "Timed out" in error or "timed out" in error:
            peers = ", ".join(m for k, m in enumerate(self.members) if k != self.process_id)
            return f"a peer of island group generation {self.generation} ({peers}) did not take part in time: {error}"
        return error

    def local_device_number(self, number: int) -> int:
        """A group-wide device number of a group segment in this worker's numbering (module doc)."""
        process, local = divmod(number, GROUP_STRIDE)
        return local if process == self.announced_process else REMOTE + number

    def device(self, number: int, local: list[Any]) -> Any:
        """The JAX device behind a number in this worker's numbering."""
        if number < REMOTE:
            return local[number]
        process, index = divmod(number - REMOTE, GROUP_STRIDE)
        devs = self._by_process.get(process)
        if devs is None or index >= len(devs):
            raise ValueError(f"device {index} of group process {process} is not in generation {self.generation}")
        return devs[index]
