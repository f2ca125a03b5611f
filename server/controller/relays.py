"""Relay groups: a flush's messages for many hosts of an island leave as one write per relay.

Why (issue 31, bench/FINDINGS.md): one gang node over a 512-host island is 512 `Enqueue`s, and
each write to a worker's stream costs the event loop ~35 µs inside grpc.aio (most of it the
kernel's `sendmsg`): ~18 ms for the writes alone, against a 5 ms target for admission and
dispatch. Here an island of at least `min_hosts` ready hosts is cut into groups of about
`group_size` hosts (consecutive in name order, the sizes balanced); when two or more hosts of a
group have messages in one flush, the controller sends their messages in one `RelayBatch` to the
group's *relay* (its first eligible host by name), which forwards each to its host
(server/worker/relay.py). Smaller islands, and a group with one host to write to, keep direct
sends: no extra hop where there is nothing to save.

Order and failures: each message carries its host's `seq` (links.py), and the worker handles its
messages in that order whichever way each came, so relaying changes no worker's sequence of
messages, and with it no island's gang order (server/worker/relay.py argues it). Relayed
messages stay on their host's link until the host acknowledges them. A relay that is lost (its
stream closed or it stopped beating: it is marked lost like any host) or re-registers, or that
reports it could not reach a host (`RelayFailed`), has the unacknowledged messages of the hosts
it carried sent again directly; the workers drop the copies of those the relay did deliver. A
host a relay could not reach gets direct sends until it registers again.

A gang node's members (hundreds of hosts, one task each, the same but for its segment, seq and
segment id) reach this module as `outbox.GangEnqueue`s, not messages: a group's members that
share their templates leave as one `RelayedGang` (controller.proto): one serialized body and
the members' numbers and signatures, which the relay cuts into each member's part and each
member makes its message of (server/worker/relay.py `gang_parts`, `relayed_message`). Per member
the controller only numbers it, keeps it (as its GangEnqueue: a message is made of it only if it
must be sent again directly), lists its numbers and signs them.

Signatures (server/relaysig.py): every relayed part carries the controller's signature for its
host, under a key only that host and the controller hold (from its host credential and this
registration's link id, `WorkerLink.relay_key`): a plain part over its message bytes, a gang
member over the body's digest (hashed once per body and flush) and its numbers, ~0.5 µs a
member (one BLAKE2s block from the link's keyed state). A host drops a part whose signature
fails and reports how many (`RelayFailed.rejected`): counted here (`rejected`), logged
(rate-limited), and that host gets its messages directly from then on, so a relay that alters
or forges cannot stall it.

A relay a member reports (a relayed message missing past the member's `GAP_S`, or one whose
signature failed) is *demoted*: it relays for nobody until it registers again, its group gets the
next eligible host as its relay, and what it carried and nobody acknowledged is sent again
directly. So a relay that drops, delays or alters messages costs its group one incident, not
one per member in turn (signatures stop alterations, not delays or drops). The member cannot
prove which relay failed it; every relay that carried its messages is demoted. A member that
reports falsely costs its group relays (direct sends: the small island's path), never a message.

Only hosts that acknowledged their registration (`WorkerToController.delivered` >= 1: they know
its `link` id, which relayed messages must carry) are relayed to or relay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from ..relaysig import Mac, body_digest, gang_macs, sign_message
from .cluster import READY, HostInfo
from .outbox import GangEnqueue, Message, materialized

log = logging.getLogger(__name__)

DEFAULT_MIN_HOSTS = 32  # islands smaller than this keep direct sends (their latency)
DEFAULT_GROUP_SIZE = 64  # hosts per relay group (one relay each): 8 relays for 512 hosts
REJECTED_LOG_EVERY_S = 10.0  # one warning about rejected relayed messages per this long


def groups_of(names: Sequence[str], group_size: int) -> list[tuple[str, ...]]:
    """`names` cut into consecutive groups of at most `group_size`, as even as can be."""
    n = len(names)
    if n == 0:
        return []
    k = -(-n // max(1, group_size))
    base, extra = divmod(n, k)
    out, i = [], 0
    for j in range(k):
        size = base + (1 if j < extra else 0)
        out.append(tuple(names[i:i + size]))
        i += size
    return out


def _eligible(info: HostInfo) -> bool:
    """Whether `info` may be relayed to (and, unless demoted, relay)."""
    link = info.link
    return info.state == READY and link is not None and not link.closed and link.acked >= 1 and link.relayable


def _may_relay(info: HostInfo) -> bool:
    return _eligible(info) and info.link.may_relay  # type: ignore[union-attr]  # checked by _eligible


class Relays:
    """The dispatcher's outbox (dispatch.WorkerOutbox): direct sends, or one batch per relay."""

    def __init__(self, hosts: Mapping[str, HostInfo], host_names: Callable[[str], Sequence[str]],
                 min_hosts: int = DEFAULT_MIN_HOSTS, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        self.hosts = hosts
        self.host_names = host_names
        self.min_hosts = min_hosts  # 0: never relay
        self.group_size = group_size
        self._groups: dict[str, dict[str, tuple[str, ...]]] = {}  # island -> host -> its group
        self._via: dict[str, set[str]] = {}  # relay -> hosts it was given messages for
        # what went where (tests and the benchmark read them): batches to relays, messages in
        # them, and writes to streams (a batch is one)
        self.batches = 0
        self.relayed = 0
        self.writes = 0
        self.rejected = 0  # relayed messages their hosts rejected: their signature did not match
        self._rejected_logged = -REJECTED_LOG_EVERY_S  # when (monotonic) the last warning was
        self._rejected_quiet = 0  # rejections since then, not in a warning yet

    # ---- membership ----
    def _group_map(self, island: str) -> dict[str, tuple[str, ...]]:
        groups = self._groups.get(island)
        if groups is None:
            hosts = self.hosts
            names = [n for n in self.host_names(island) if (h := hosts.get(n)) is not None and h.state == READY]
            groups = {}
            if self.min_hosts > 0 and len(names) >= self.min_hosts:
                for g in groups_of(names, self.group_size):
                    for n in g:
                        groups[n] = g
            self._groups[island] = groups
        return groups

    def host_up(self, info: HostInfo) -> None:
        self._groups.pop(info.island, None)
        self._relay_gone(info.name)  # an earlier registration of it may have been relaying

    def host_lost(self, info: HostInfo, reason: str) -> None:
        self._groups.pop(info.island, None)
        self._relay_gone(info.name)

    def _relay_gone(self, relay: str) -> None:
        hosts = self._via.pop(relay, None)
        if not hosts:
            return
        resent = 0
        for name in hosts:
            info = self.hosts.get(name)
            if info is not None and info.link is not None:
                resent += info.link.resend_retained()
        if resent:
            log.info("relay %s gone: %d message(s) for %d host(s) sent again directly", relay, resent, len(hosts))

    def failed(self, relay: str, names: Sequence[str], rejected: int = 0) -> None:
        """`relay` could not forward to these hosts: they get their messages directly from now on.
        `rejected`: relayed messages for `relay` itself (the host that reports) that failed their
        signature check there (server/relaysig.py): counted and logged, one line per
        `REJECTED_LOG_EVERY_S`."""
        if rejected > 0:
            self._rejected(relay, rejected)
        for name in names:
            info = self.hosts.get(name)
            if info is None or info.link is None:
                continue
            info.link.relayable = False
            n = info.link.resend_retained()
            if name == relay:  # the host itself: a relayed message never came, or was altered
                log.warning("host %s misses a relayed message: %d message(s) sent again directly", name, n)
                self._demote(name)
            else:
                log.warning("relay %s could not reach host %s: %d message(s) sent again directly", relay, name, n)

    def _demote(self, member: str) -> None:
        """The relays that carried `member`'s messages relay no more (the module docstring); what
        they carried for any host and nobody acknowledged goes again directly."""
        for relay in [r for r, hosts in self._via.items() if member in hosts]:
            info = self.hosts.get(relay)
            if info is not None and info.link is not None and info.link.may_relay:
                info.link.may_relay = False
                log.warning("relay %s demoted: host %s reported a relayed message missing or altered; its group "
                            "gets another relay", relay, member)
            self._relay_gone(relay)

    def _rejected(self, host: str, n: int) -> None:
        self.rejected += n
        self._rejected_quiet += n
        now = time.monotonic()
        if now - self._rejected_logged < REJECTED_LOG_EVERY_S:
            return
        self._rejected_logged = now
        carriers = sorted(r for r, hosts in self._via.items() if host in hosts) or ["?"]
        log.warning("host %s rejected %d relayed message(s) whose signature did not match (altered or forged "
                    "on the way; its relay: %s); %d rejected in all; it gets its messages directly", host,
                    self._rejected_quiet, ", ".join(carriers), self.rejected)
        self._rejected_quiet = 0

    # ---- sending ----
    def send(self, host: str, msg: cpb.ControllerToWorker) -> None:
        """One message on host `host`'s own stream (dropped when it has none: it is lost)."""
        info = self.hosts.get(host)
        if info is not None and info.link is not None:
            info.link.send(msg)
            self.writes += 1

    def send_all(self, msgs: Mapping[str, list[Message]]) -> None:
        """A flush's messages by host, each host's in order (see the module docstring).

        One pass over the hosts: a relayable host whose one message is a gang member's Enqueue
        (outbox.GangEnqueue) is numbered and kept (retained) as it is met, its relay not known yet
        (the relay's own is then kept too: it is acknowledged as any, and a copy sent again is
        dropped by the worker); a group that turns out to have one host to write to sends it
        directly, numbered as it was."""
        if not msgs:
            return
        hosts = self.hosts
        pending: dict[int, _Pending] = {}  # id(relay group) -> what its hosts have in this flush
        last: tuple[str, ...] | None = None
        p: _Pending | None = None
        island, groups = None, None  # the last host's island and its group map (hosts come by island)
        relaying = self.min_hosts > 0
        for name, ms in msgs.items():
            info = hosts.get(name)
            if info is None or (link := info.link) is None:
                continue
            group = None
            if relaying:
                if info.island != island:
                    island, groups = info.island, self._group_map(info.island)
                group = groups.get(name)  # type: ignore[union-attr]  # set with island
            if group is None or not (info.state == READY and not link.closed and link.acked >= 1
                                     and link.relayable):  # not _eligible(info)
                for m in ms:
                    link.send(materialized(m))
                self.writes += len(ms)
                continue
            if group is not last:  # hosts come group by group: a group (64 names) is hashed once
                last = group
                p = pending.get(id(group))
                if p is None:
                    p = pending[id(group)] = _Pending(group)
            assert p is not None  # set with `last`
            if len(ms) == 1 and type(g := ms[0]) is GangEnqueue:
                # the usual case of a gang node: its body is shared, only the numbers are the member's
                key = id(g[0][0]) if len(g) == 1 else g.key()
                gang = p.gangs.get(key)
                if gang is None:
                    gang = p.gangs[key] = _Gang(g)
                seq = link.next_seq
                link.next_seq = seq + 1
                link.retained.append((seq, g))
                gang.members.append((name, info.address, link.link_id, seq, link.relay_mac))
                gang.tasks.extend(g)
            else:
                p.others.append(info)
        # a gang's body, serialized and hashed (for its members' signatures) once per flush
        bodies: dict[int | tuple[int, ...], tuple[bytes, bytes]] = {}
        for p in pending.values():
            relay = None
            if len(p.others) + sum(len(gang.members) for gang in p.gangs.values()) >= 2:  # hosts to write to
                relay = next((h for n in p.group if (h := hosts.get(n)) is not None and _may_relay(h)), None)
            if relay is None:
                for gang in p.gangs.values():
                    for name, _, _, seq, _ in gang.members:
                        link = hosts[name].link
                        assert link is not None and link.retained[-1][0] == seq
                        _, g = link.retained.pop()  # numbered above; not relayed after all
                        assert type(g) is GangEnqueue
                        link.put(g.message(seq))
                        self.writes += 1
                for info in p.others:
                    for m in msgs[info.name]:
                        info.link.send(materialized(m))  # type: ignore[union-attr]  # checked above
                    self.writes += len(msgs[info.name])
                continue
            self._batch(relay, p, msgs, bodies)

    def _batch(self, relay: HostInfo, p: _Pending, msgs: Mapping[str, list[Message]],
               bodies: dict[int | tuple[int, ...], tuple[bytes, bytes]]) -> None:
        batch = cpb.ControllerToWorker()
        parts = batch.relay.messages  # added in place: a list of parts would be copied in
        via = self._via.setdefault(relay.name, set())
        for info in p.others:
            link = info.link
            assert link is not None
            own = info is relay
            for m in msgs[info.name]:
                m = link.stamp(materialized(m))
                if not own:  # the relay's own part is lost only with the relay's registration
                    link.retain(m)
                data = m.SerializeToString()
                parts.add(host=info.name, address=info.address, link=link.link_id, message=data,
                          mac=sign_message(link.relay_mac, data))
            if not own:
                via.add(info.name)
        for key, gang in p.gangs.items():
            known = bodies.get(key)
            if known is None:  # the first member's message: each member's numbers replace its own
                body = gang.first.message().SerializeToString()
                known = bodies[key] = (body, body_digest(body))
            body, digest = known
            out = batch.relay.gangs.add(body=body)
            names, addresses, links, seqs, macs = zip(*gang.members, strict=True)
            via.update(names)
            out.hosts.extend(names)
            out.addresses.extend(addresses)
            out.links.extend(links)
            out.seqs.extend(seqs)
            _, segments, task_seqs, segment_ids = zip(*gang.tasks, strict=True)
            out.task_segments.extend(segments)
            out.task_seqs.extend(task_seqs)
            out.segment_ids.extend(segment_ids)
            out.macs.extend(gang_macs(digest, macs, seqs, segments, task_seqs, segment_ids))
            self.relayed += len(names)
        via.discard(relay.name)  # its own part goes with its registration
        assert relay.link is not None
        relay.link.send_unnumbered(batch)
        self.batches += 1
        self.relayed += len(parts)
        self.writes += 1


class _Gang:
    """The members of one relay batch whose Enqueues share their templates (outbox.py)."""

    __slots__ = ("first", "members", "tasks")

    def __init__(self, first: GangEnqueue) -> None:
        self.first = first
        # (host, address, link id, seq, its link's keyed MAC state: relaysig.py)
        self.members: list[tuple[str, str, int, int, Mac]] = []
        self.tasks: list[tuple[wpb.Task, int, int, int]] = []  # each member's GangEnqueue items, in turn


class _Pending:
    """A relay group's hosts with messages in one flush: gang members by their templates, the
    others by host."""

    __slots__ = ("gangs", "group", "others")

    def __init__(self, group: tuple[str, ...]) -> None:
        self.group = group
        self.gangs: dict[int | tuple[int, ...], _Gang] = {}  # by GangEnqueue.key (one template: its id)
        self.others: list[HostInfo] = []
