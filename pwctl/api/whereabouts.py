"""Where a session's slices run, kept up to date between the session's events: which workers are
lost or may have moved, and reading a slice again from the controller before a call on it.

The session's events (`HostLost`, `SliceChanged`) say where slices are, but they come in order
behind everything else on the stream: a call made between a worker's return at a new address and
the reader taking its `SliceChanged` uploaded to, and waited at, the old address, and failed
('input 0 is held by the worker at OLD, which is not ready'). So a call on a slice whose worker is
suspect (its host declared lost, or the client's upload stream to it ended: the first sign, often
before the session says anything) first reads the slice from the controller, on a connection of
its own (`catch_up`). The controller stays the authority on placement; the client only asks it
sooner. A call with no such sign (a worker it never uploaded to, an old process frozen with its
connections open) is refused by the controller for its plan and sent again (replan.py).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb

from ..client import Client
from ..errors import ConnectionFailed, PathwaysError

if TYPE_CHECKING:
    from .runtime import Runtime

LOST_CHECK_S = 5.0  # how long `lost_host` waits for the controller's answer
CATCH_UP_S = 2.0  # how long `catch_up` waits for it (a call waits meanwhile)
# after the controller did not answer a lookup, none is tried for this long: the calls meanwhile go
# on as if it had said nothing, rather than each wait for the lookup's timeout (`_ask`)
QUIET_S = 5.0
# a slice read ahead of the session's events (`catch_up`) counts as such until the session delivers
# that generation, or for this long at most (its events lag by far less; a session resumed at a new
# controller may never send that one)
AHEAD_S = 30.0

T = TypeVar("T")


class Whereabouts:
    """The runtime's view of lost and suspect workers, and its lookups at the controller. It sets
    `rt.on_lost_worker` (read on every call: `execute` calls `catch_up` only when it is set)."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        # worker address -> why (HostLost): its host was declared lost, and not known ready again
        # since; a call to it asks the controller first (`still_lost`) rather than wait for a frozen
        # worker's silence. An address leaves it once its host is known ready again (`still_lost`, or
        # a slice placed there: `slice_changed`).
        self.lost: dict[str, str] = {}
        # worker addresses whose upload stream ended (WorkerClient `on_ended`: killed, restarted,
        # link broken) with no word from the controller since: it may have moved, and the session
        # may not have told yet (its HostLost and SliceChanged behind other events, or held)
        self.ended: set[str] = set()
        # slice name -> (the generation `catch_up` read, newer than the session has delivered, until
        # when it counts): the session's events until that generation's are older than what is
        # known (`host_lost`)
        self._ahead: dict[str, tuple[int, float]] = {}
        # lookups on a connection of their own (`_ask`), opened at the first and kept; and until
        # when none is tried (the controller did not answer the last one)
        self._side: Client | None = None
        self._side_lock = threading.Lock()
        self._quiet_until = 0.0
        self._closed = False

    def _ask(self, lookup: Callable[[Client], T]) -> T | None:
        """`lookup` on the runtime's own connection to the controller (not behind the session's
        events, however many are unread; opened at the first lookup and kept). None when the
        controller did not answer: then, for QUIET_S, no lookup is tried and None comes at once
        (a call does not wait for each one's timeout while the controller cannot be reached)."""
        if time.monotonic() < self._quiet_until:
            return None
        with self._side_lock:
            if self._closed:
                return None
            if self._side is None:
                client = self._rt.client
                self._side = Client(server=client.address, token=client.token, timeout=LOST_CHECK_S,
                                    tls=client.tls, own_connection=True)
            side = self._side
        try:
            return lookup(side)
        except ConnectionFailed:
            self._quiet_until = time.monotonic() + QUIET_S
            return None

    def close(self) -> None:
        with self._side_lock:
            self._closed = True
            if self._side is not None:
                self._side.close()

    def lost_host(self, address: str) -> str:
        """Whether the controller declared the host of the worker at `address` lost: why ("host
        NAME was lost"), or "" (not lost, or the controller did not answer within LOST_CHECK_S)."""
        try:
            lost = self._ask(lambda c: c.hosts(state=pb.HOST_STATE_LOST)) or []
        except PathwaysError:
            return ""
        return next((f"host {h.name} was lost" for h in lost if h.address == address), "")

    def still_lost(self, address: str) -> str:
        """For a worker in `lost`: why, while the controller still has its host lost, or no host at
        that address at all (its host registered again at another one: nothing there answers, a
        frozen old worker keeps its connections open); "" once a host is there again (registered
        again at it, or the controller did not answer: the call is made as usual), and it leaves
        `lost`."""
        try:
            hosts = self._ask(lambda c: c.hosts())
        except PathwaysError:
            hosts = None
        if hosts is not None:
            at = [h for h in hosts if h.address == address]
            lost = next((h for h in at if h.state == pb.HOST_STATE_LOST), None)
            if lost is not None:
                return (f"the worker at {address} does not answer: its host {lost.name} was lost "
                        "(the controller declared it)")
            if not at and address in self.lost:
                return self.lost[address]
        self.lost.pop(address, None)
        return ""

    def catch_up(self, names: set[str]) -> None:
        """Before a call on slices `names` while a worker is in `lost` (the session told of its
        host's loss) or `ended` (its upload stream ended): a slice on such a worker is read again
        from the controller, as it may have moved on (its host back at a new address, or remapped)
        before the session's reader took the `SliceChanged`. Read within CATCH_UP_S; should the
        controller not answer, the call goes on as it would have. A slice still on the lost host
        keeps its address, and that worker counts as lost: the call's waits there fail at once,
        naming its host (futures.py `_poll`), and the controller refuses the run."""
        suspect = self.lost.keys() | self.ended
        for name in names:
            vs = self._rt.slices.get(name)
            if vs is not None and any(a in suspect for a in (vs.address, *vs.peers)):
                self.read(name)

    def read(self, name: str) -> None:
        """Reads slice `name` again from the controller, ahead of the session's events (`catch_up`,
        and a run the controller refused for its plan: replan.py), within CATCH_UP_S; left as it
        was when the controller does not answer, or says it is gone."""
        vs = self._rt.slices.get(name)
        if vs is None:
            return
        try:
            info = self._ask(functools.partial(Client.get_slice, name=name, timeout=CATCH_UP_S))
        except PathwaysError:  # gone (NotFound), or refused: the call says why
            return
        if info is None or not info.devices:
            return
        if info.state == cpb.SLICE_STATE_DEGRADED:
            for address in (vs.address, *vs.peers):
                if address in self.ended:
                    self.ended.discard(address)
                    self.lost.setdefault(address, f"slice {name!r} is degraded: {info.reason}")
        elif info.generation > vs.info.generation:
            self._ahead[name] = (info.generation, time.monotonic() + AHEAD_S)
        self.slice_changed(vs, info)

    def streamed(self, vs: Any, info: cpb.Slice) -> None:
        """The session's `SliceChanged` for slice `vs`."""
        if self._ahead.get(vs.name, (-1, 0.0))[0] <= info.generation:
            self._ahead.pop(vs.name, None)
        self.slice_changed(vs, info)

    def slice_changed(self, vs: Any, info: cpb.Slice) -> None:
        """Slice `vs` is now as `info` says (its event, or read again by `catch_up`). Placed (not
        degraded), it is on ready hosts: none of its workers is lost any more (a host back at
        its old address leaves `lost`, else each call would read the slice again). An older state
        than the one known is left: `catch_up` read ahead of the session's events, whose backlog
        may still hold the slice degraded on the lost host (a remap or a restore bumps
        `generation`; a degraded slice keeps it)."""
        if info.created_at == vs.info.created_at and info.generation < vs.info.generation:
            return
        vs._update(info)
        if info.state != cpb.SLICE_STATE_DEGRADED:
            for address in (vs.address, *vs.peers):
                self.lost.pop(address, None)
                self.ended.discard(address)
        self.check()

    def check(self) -> None:
        """Sets `rt.on_lost_worker` (on a host's loss, an upload stream's end, a slice's change: not
        on the usual path)."""
        self._rt.on_lost_worker = any(a in self.lost or a in self.ended for vs in list(self._rt.slices.values())
                                      for a in (vs.address, *vs.peers))

    def worker_ended(self, address: str) -> None:
        """The upload stream to the worker at `address` ended (WorkerClient `on_ended`, on its
        reader thread): the next call on a slice there reads the slice again first (`catch_up`)."""
        self.ended.add(address)
        self.check()

    def host_lost(self, lost: cpb.HostLost) -> str:
        """The session's `HostLost`: why its worker's calls fail from now on (recorded in `lost`),
        or "" for news older than what `catch_up` read: a slice on that address was read placed
        there in a generation the session has not delivered yet, so the loss came before that
        placement (the host is back at the same address; its calls must go on)."""
        now = time.monotonic()
        for name, (_, until) in list(self._ahead.items()):
            vs = self._rt.slices.get(name)
            if until < now or vs is None:
                self._ahead.pop(name, None)
            elif lost.address in (vs.address, *vs.peers):
                return ""
        why = (f"the worker at {lost.address} does not answer: its host {lost.name} was lost "
               "(the controller declared it)")
        self.lost[lost.address] = why
        self.check()
        return why
