"""The controller's end of one worker's WorkerConnect stream."""

from __future__ import annotations

import asyncio
import itertools
import random
import secrets
from collections import deque
from collections.abc import AsyncIterator, Callable

from schemas.pathways.v1 import controller_pb2 as cpb

from ..relaysig import KEY_BYTES, Mac, keyed
from .outbox import GangEnqueue

_CLOSE = object()

# Sees every message as a stream takes it to hand to gRPC: the dispatch probe's hook
# (dispatch_probe.py, only when the controller runs with PATHWAYS_DISPATCH_PROBE), else None.
on_handed: Callable[[cpb.ControllerToWorker], None] | None = None

# ids of registrations (Registered.link): unique within a controller, unlikely to repeat across
_link_ids = itertools.count(random.getrandbits(40) << 16 | 1)


class WorkerLink:
    """Outbound queue to one connected worker; messages keep their order.

    Every message sent for the worker is numbered (`ControllerToWorker.seq`, from 1 per link),
    whether it goes on this stream or through a relay (relays.py): the worker handles them in
    that order (server/worker/relay.py). Relayed messages are kept (`retained`) until the worker
    acknowledges them (`ack`), to be sent again directly if their relay fails (`resend_retained`).
    """

    def __init__(self, host: str, relay_key: bytes | None = None) -> None:
        self.host = host
        self.link_id = next(_link_ids)
        # signs what relays carry for this worker (server/relaysig.py): the servicer sets the key
        # derived from the host's credential; until then a random one nobody else knows
        self.relay_key = b""
        self.relay_mac: Mac = None
        self.set_relay_key(relay_key or secrets.token_bytes(KEY_BYTES))
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self.closed = False
        self.next_seq = 1
        self.acked = 0  # the highest seq the worker said it handled
        # (seq, message): a gang member's Enqueue as its GangEnqueue (outbox.py), made a message
        # only if it must be sent again
        self.retained: deque[tuple[int, cpb.ControllerToWorker | GangEnqueue]] = deque()
        self.relayable = True  # False once a relay could not reach this worker: direct sends only
        # False once a host whose messages it carried missed or rejected one: it relays for nobody
        # (server/controller/relays.py, `_demote`), until it registers again (a new link)
        self.may_relay = True

    def set_relay_key(self, key: bytes) -> None:
        self.relay_key = key
        self.relay_mac = keyed(key)  # the MAC's keyed state, copied for each signature

    def stamp(self, msg: cpb.ControllerToWorker) -> cpb.ControllerToWorker:
        """`msg` numbered as this link's next message (a copy when it is numbered already: the
        same message object broadcast to several workers)."""
        if msg.seq:
            copy = cpb.ControllerToWorker()
            copy.CopyFrom(msg)
            msg = copy
        msg.seq = self.next_seq
        self.next_seq += 1
        return msg

    def send(self, msg: cpb.ControllerToWorker) -> None:
        if not self.closed:
            self._queue.put_nowait(self.stamp(msg))

    def put(self, msg: cpb.ControllerToWorker) -> None:
        """A message numbered already (`next_seq` was taken for it): on this stream as it is."""
        if not self.closed:
            self._queue.put_nowait(msg)

    def send_unnumbered(self, msg: cpb.ControllerToWorker) -> None:
        """A message outside this worker's order (a RelayBatch: its parts carry their numbers)."""
        if not self.closed:
            self._queue.put_nowait(msg)

    def retain(self, msg: cpb.ControllerToWorker) -> None:
        """`msg` (stamped) left through a relay: kept until acknowledged."""
        self.retained.append((msg.seq, msg))

    def ack(self, delivered: int) -> None:
        if delivered > self.acked:
            self.acked = delivered
            retained = self.retained
            while retained and retained[0][0] <= delivered:
                retained.popleft()

    def resend_retained(self) -> int:
        """Sends the unacknowledged relayed messages on this stream (the worker drops those it
        had already); returns how many."""
        n = len(self.retained)
        if not self.closed:
            for seq, msg in self.retained:
                self._queue.put_nowait(msg.message(seq) if type(msg) is GangEnqueue else msg)
        self.retained.clear()
        return n

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(_CLOSE)

    async def messages(self) -> AsyncIterator[cpb.ControllerToWorker]:
        while True:
            msg = await self._queue.get()
            if msg is _CLOSE:
                return
            assert isinstance(msg, cpb.ControllerToWorker)
            if on_handed is not None:
                on_handed(msg)
            yield msg
