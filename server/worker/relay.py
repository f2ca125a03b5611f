"""Controller messages that come through a relay (issue 31): the worker's two sides.

At thousands of hosts, one gang node means one `Enqueue` per member host, and each write to a
worker's stream costs the controller's event loop ~35 µs inside gRPC (bench/FINDINGS.md). So in
an island of many hosts the controller sends one `RelayBatch` to one host of each relay group (a
*relay*, server/controller/relays.py), carrying every member's message of that flush, and the
relay forwards each to its member over a `Relayed` stream (worker.proto) that it opens to the
member's Worker service: the controller's writes grow with the relays, not with the hosts.

A gang node's members come as one `RelayedGang` (controller.proto): one serialized body and each
member's numbers; the relay cuts it into each member's part (`gang_parts`: the body, its numbers
and its signature) and each member makes its own message (`relayed_message`), so that work, ~64
messages a relay, is the relays' and the members', in parallel, not the controller's.

**Signatures** (server/relaysig.py). Every part is signed by the controller for its member, under
a key of that member's host credential and registration that the relay does not have; a member
takes nothing whose signature does not match (`relayed_message`): it counts it (`Inbox.rejected`,
`WorkerStats.relayed_rejected`), logs one line per 10 s, and reports it at once
(`RelayFailed.rejected`), so that the controller sends it its messages directly from then on.

**Order.** Every message the controller sends a host carries `seq`, its place in that host's
registration (1, 2, 3, ...: `Registered` is 1), whether it goes on the host's own stream or
through a relay. The worker handles its messages strictly in `seq` order (`Inbox`): one that
comes early (a release on the host's own stream that overtook the relayed `Enqueue` before it)
waits for the ones before it. So each worker sees exactly the sequence of messages that direct
sends would give it, in the same order, whatever path each took: its tasks enter its executor
in the controller's order, and the island's gang order (each worker runs the tasks of its
island's gang nodes in the order the controller decided them, the same order on every member:
what keeps their collectives from interleaving into a deadlock) is the one direct sends give.

**Loss and duplicates.** A message is handled once: a `seq` already handled (or waiting) is
dropped. The controller keeps every relayed message until the worker says it handled it
(`WorkerToController.delivered`, on every message the worker sends up), and when the relay is
lost (its stream closes: handled as any closed stream) or reports that it could not forward
(`RelayFailed`), sends those messages again on the host's own stream: nothing is lost, and what
the relay did forward before it failed is dropped as a duplicate. A relayed message for an
earlier registration of the worker (`RelayedMessage.link` is not this registration's) is stale
and dropped: that registration's state is gone with it. A gap that stays open for `GAP_S`
(a relay that is alive to the controller but did not deliver, which it would otherwise not
notice) makes the worker report itself in a `RelayFailed`: the controller then sends it what it
has not acknowledged directly, and relays to it no more.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from pwctl import tls as tls_
from pwctl.transport import KEEPALIVE_OPTIONS
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from ..credentials import PEER_HEADER, peer_credential
from ..relaysig import (
    TAG_BYTES,
    Mac,
    body_digest,
    gang_numbers,
    keyed,
    matches,
    one_task_numbers,
    sign_gang,
    sign_message,
)

log = logging.getLogger(__name__)

RELAYED_METHOD = "/pathways.v1.Worker/Relayed"
REJECTED_LOG_EVERY_S = 10.0  # one warning about rejected relayed messages per this long
GAP_S = 5.0  # a message missing this long while later ones wait: asked for directly
# one connection per member, as separate hosts have (no sharing of one subchannel by address)
# keepalive: a member whose host vanished fails its stream within ~20 s (pwctl/transport.py)
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1), *KEEPALIVE_OPTIONS]


class Inbox:
    """A worker's controller messages put back in their `seq` order (no I/O).

    `accept` takes one message as it arrives (its own stream or a relay) and returns those now
    due, in order: none while an earlier one is missing, several once the gap is filled."""

    def __init__(self) -> None:
        self.link = 0  # Registered.link of the current registration (0: none, nothing relayed is taken)
        self._key = b""  # what relayed messages of it are signed with (server/relaysig.py); b"": none taken
        self.mac: Mac = None  # the key's keyed MAC state (None: no key)
        self.rejected = 0  # relayed messages dropped: their signature did not match
        self.next = 1
        self.pending: dict[int, cpb.ControllerToWorker] = {}
        self.duplicates = 0
        self.gap_since: float | None = None  # when the oldest waiting message came (none waiting: None)

    @property
    def key(self) -> bytes:
        return self._key

    @key.setter
    def key(self, key: bytes) -> None:
        self._key = key
        self.mac = keyed(key) if key else None

    def reset(self) -> None:
        """A new stream to the controller: a new registration, its messages numbered from 1."""
        self.link = 0
        self.key = b""
        self.next = 1
        self.pending.clear()
        self.gap_since = None

    def stalled(self, now: float, limit: float = GAP_S) -> bool:
        """Whether messages have waited for a missing one for `limit` seconds; the clock starts
        again (the next report is due `limit` later if the gap is still open)."""
        if self.gap_since is None or now - self.gap_since < limit:
            return False
        self.gap_since = now
        return True

    @property
    def delivered(self) -> int:
        """The highest seq handed out (every one up to it was)."""
        return self.next - 1

    def accept(self, msg: cpb.ControllerToWorker, now: float = 0.0) -> list[cpb.ControllerToWorker]:
        """`now` (monotonic): when it came, for `stalled`."""
        seq = msg.seq
        if seq == 0:
            return [msg]  # outside the order (an older controller)
        if seq < self.next or seq in self.pending:
            self.duplicates += 1
            return []
        if seq != self.next:
            if not self.pending:
                self.gap_since = now
            self.pending[seq] = msg
            return []
        out = [msg]
        self.next += 1
        while self.pending:
            nxt = self.pending.pop(self.next, None)
            if nxt is None:
                break
            out.append(nxt)
            self.next += 1
        if not self.pending:
            self.gap_since = None
        elif len(out) > 1:
            self.gap_since = now  # the gap moved on: a new one, timed from now
        return out


def _identity(b: bytes) -> bytes:
    return b


class _Member:
    """The relay's stream to one member: messages go out in the order they were given."""

    def __init__(self, forwarder: Forwarder, host: str, address: str) -> None:
        self.host, self.address = host, address
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.task = asyncio.create_task(self._run(forwarder))

    async def _run(self, fw: Forwarder) -> None:
        channel = tls_.aio_channel(self.address, CHANNEL_OPTIONS, fw.tls)
        try:
            call = channel.stream_unary(RELAYED_METHOD, request_serializer=_identity,
                                        response_deserializer=wpb.RelayedResponse.FromString)(
                metadata=fw.metadata())
            while True:
                data = await self.queue.get()
                await call.write(data)
                fw.forwarded += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the member's stream failed: the controller sends it its messages itself
            log.warning("relay to %s at %s failed: %s", self.host, self.address, str(e).splitlines()[0] if str(e) else
                        type(e).__name__)
            fw.member_failed(self)
        finally:
            with contextlib.suppress(Exception):
                await channel.close()


class Forwarder:
    """The relay side: hands each part of a `RelayBatch` to its member's `Relayed` stream (opened
    on first use, kept), or to `deliver_local` when the part is for this worker itself. A member
    whose stream fails is reported through `failed` (the worker sends `RelayFailed` up) and its
    stream is dropped: the controller then sends that member its messages directly."""

    def __init__(self, own: str, deliver_local: Callable[[wpb.RelayedMessage], None],
                 failed: Callable[[Sequence[str]], None], token: str | None = None,
                 tls: tls_.TlsConfig | None = None) -> None:
        self.tls = tls  # members' streams over TLS (pwctl/tls.py)
        self.own = own
        self.deliver_local = deliver_local
        self.failed = failed
        self.token = token
        self.key: bytes | None = None  # the peer credential's key, from the controller's Registered
        self._members: dict[str, _Member] = {}
        self.forwarded = 0

    def metadata(self) -> tuple[tuple[str, str], ...]:
        md: list[tuple[str, str]] = []
        if self.token:
            md.append(("authorization", f"Bearer {self.token}"))
        if self.key is not None:
            md.append((PEER_HEADER, peer_credential(self.key)))
        return tuple(md)

    def forward(self, batch: cpb.RelayBatch) -> None:
        parts: Iterable[wpb.RelayedMessage] = batch.messages
        if batch.gangs:
            parts = itertools.chain(parts, *(gang_parts(g) for g in batch.gangs))
        for part in parts:
            if part.host == self.own:
                self.deliver_local(part)
                continue
            m = self._members.get(part.host)
            if m is None or m.address != part.address:
                if m is not None:
                    m.task.cancel()
                m = self._members[part.host] = _Member(self, part.host, part.address)
            m.queue.put_nowait(part.SerializeToString())

    def member_failed(self, m: _Member) -> None:
        if self._members.get(m.host) is m:
            del self._members[m.host]
        self.failed([m.host])

    def close(self) -> None:
        for m in self._members.values():
            m.task.cancel()
        self._members.clear()


def gang_parts(gang: cpb.RelayedGang) -> Iterator[wpb.RelayedMessage]:
    """Each member's part of a `RelayedGang` (controller.proto): the shared body, the member's
    numbers (its seq, and its tasks' segment, seq and segment id) and its signature, as a
    `RelayedGangMember` that the member makes its message of (`relayed_message`) once it has
    checked the signature. The relay does not decode the body. A gang whose lists do not match
    its members gives nothing: its members then miss a message and ask the controller for it
    (`GAP_S`)."""
    n = len(gang.hosts)
    k, extra = divmod(len(gang.task_segments), n) if n else (0, 0)
    if not (len(gang.addresses) == len(gang.links) == len(gang.seqs) == len(gang.macs) == n and not extra
            and len(gang.task_seqs) == len(gang.segment_ids) == n * k):
        log.warning("a relayed gang message's member lists do not match (%d members); dropped", n)
        return
    body, segments, task_seqs, segment_ids = gang.body, gang.task_segments, gang.task_seqs, gang.segment_ids
    for i in range(n):
        a, b = i * k, (i + 1) * k
        yield wpb.RelayedMessage(
            host=gang.hosts[i], address=gang.addresses[i], link=gang.links[i], mac=gang.macs[i],
            gang=wpb.RelayedGangMember(body=body, seq=gang.seqs[i], task_segments=segments[a:b],
                                       task_seqs=task_seqs[a:b], segment_ids=segment_ids[a:b]))


_last_warning = -REJECTED_LOG_EVERY_S
_quiet = 0


def _warn_rejected(part: wpb.RelayedMessage, why: str) -> None:
    """One warning per `REJECTED_LOG_EVERY_S`; the rejections between are counted into the next."""
    global _last_warning, _quiet
    now = time.monotonic()
    if now - _last_warning < REJECTED_LOG_EVERY_S:
        _quiet += 1
        return
    _last_warning = now
    more, _quiet = _quiet, 0
    log.warning("a relayed message for %s was dropped: %s (forged or altered on the way)%s", part.host or "?", why,
                f"; {more} more since the last warning" if more else "")


def relayed_message(part: wpb.RelayedMessage, inbox: Inbox) -> cpb.ControllerToWorker | None:
    """The controller message a relayed part carries, or None when it is stale (for an earlier
    registration, or before this one's `Registered` was handled), its signature does not match
    the registration's key (relaysig.py; counted in `inbox.rejected`, logged rate-limited) or it
    does not decode. A gang member's part is checked over the body's digest and its numbers, then
    made its message: the body with its seq and its tasks' numbers."""
    if inbox.link == 0 or part.link != inbox.link:
        return None
    mac, tag = inbox.mac, part.mac
    gang = part.gang if part.HasField("gang") else None
    if gang is None:
        ok = mac is not None and len(tag) == TAG_BYTES and matches(tag, sign_message(mac, part.message))
    else:
        segments, task_seqs, segment_ids = gang.task_segments, gang.task_seqs, gang.segment_ids
        k = len(segments)
        if k == 1 and len(task_seqs) == 1 and len(segment_ids) == 1:  # the usual gang node
            numbers = one_task_numbers(gang.seq, 1, segments[0], task_seqs[0], segment_ids[0])
        elif len(task_seqs) == len(segment_ids) == k:
            numbers = gang_numbers(gang.seq, list(segments), list(task_seqs), list(segment_ids))
        else:
            numbers = b""
        ok = (mac is not None and bool(numbers) and len(tag) == TAG_BYTES
              and matches(tag, sign_gang(mac, body_digest(gang.body), numbers)))
    if not ok:
        inbox.rejected += 1
        _warn_rejected(part, "its signature does not match" if tag else "it is not signed")
        return None
    try:
        if gang is None:
            return cpb.ControllerToWorker.FromString(part.message)
        msg = cpb.ControllerToWorker.FromString(gang.body)
    except Exception:  # DecodeError: signed by the controller, so not expected; nothing to handle
        log.warning("a relayed message for %s does not decode; dropped", part.host)
        return None
    tasks = msg.enqueue.tasks
    if len(tasks) != k:
        log.warning("a relayed gang message for %s has %d tasks for %d tasks' numbers; dropped", part.host,
                    len(tasks), k)
        return None
    msg.seq = gang.seq
    if k == 1:
        task = tasks[0]
        task.segment, task.seq, task.segment_id = segments[0], task_seqs[0], segment_ids[0]
        return msg
    for task, segment, seq, segment_id in zip(tasks, segments, task_seqs, segment_ids, strict=True):
        task.segment = segment
        task.seq = seq
        task.segment_id = segment_id
    return msg
