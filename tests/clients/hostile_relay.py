"""A worker whose relay is hostile (tests/test_relay_signatures.py): `python -m server.worker`
in every respect, but as a relay it attacks the member named by $HOSTILE_RELAY_VICTIM.

Before each message it forwards to the victim it sends, on the victim's `Relayed` stream and
under the message's own numbers (host, link, seq) and signature, a forgery: a `Drop` of the
message's runs in place of an Enqueue (or the message with its seq changed, for anything
else); after it, it replays the victim's previous message. Unsigned relaying would hand the
forgery to the victim's executor and drop the genuine message as a duplicate. Every other
member's messages it forwards faithfully. With $HOSTILE_RELAY_GANGS_ONLY=1 it attacks only the
victim's gang parts (a gang node's Enqueue: `RelayedGang`). It counts its forgeries in $HOSTILE_RELAY_COUNT (a
file), so that the test knows it attacked.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb
from server.worker import relay

VICTIM = os.environ["HOSTILE_RELAY_VICTIM"]
GANGS_ONLY = os.environ.get("HOSTILE_RELAY_GANGS_ONLY") == "1"  # forge only gang members' parts
COUNT = Path(os.environ["HOSTILE_RELAY_COUNT"])
_forged = 0
_previous: list[bytes] = []


def _plain(part: wpb.RelayedMessage) -> cpb.ControllerToWorker:
    """The controller message a part carries, whichever form the relay got it in."""
    if part.message:
        return cpb.ControllerToWorker.FromString(part.message)
    g = part.gang  # a gang member's share (the body and its numbers)
    msg = cpb.ControllerToWorker.FromString(g.body)
    msg.seq = g.seq
    for j, task in enumerate(msg.enqueue.tasks):
        task.segment, task.seq, task.segment_id = g.task_segments[j], g.task_seqs[j], g.segment_ids[j]
    return msg


def _forgery(part: wpb.RelayedMessage) -> bytes:
    genuine = _plain(part)
    if genuine.WhichOneof("msg") == "enqueue":
        runs = sorted({t.run_id for t in genuine.enqueue.tasks})
        forged = cpb.ControllerToWorker(seq=genuine.seq, drop=cpb.Drop(run_ids=runs, reason="forged by the relay"))
    else:
        forged = cpb.ControllerToWorker()
        forged.CopyFrom(genuine)
        forged.seq = genuine.seq + 1  # altered: taken for the next one
    out = wpb.RelayedMessage(host=part.host, address=part.address, link=part.link,
                             message=forged.SerializeToString())
    if "mac" in wpb.RelayedMessage.DESCRIPTOR.fields_by_name:  # (a release without signatures has none)
        out.mac = part.mac  # the genuine part's signature, on the altered message
    return out.SerializeToString()


_honest_forward = relay.Forwarder.forward


def _hostile_forward(self: relay.Forwarder, batch: cpb.RelayBatch) -> None:
    global _forged
    plain = [] if GANGS_ONLY else list(batch.messages)
    attacked = [*plain, *(p for g in batch.gangs for p in relay.gang_parts(g))]
    for part in attacked:
        if part.host != VICTIM or part.host == self.own:
            continue
        member = self._members.get(part.host)
        if member is None or member.address != part.address:
            member = self._members[part.host] = relay._Member(self, part.host, part.address)
        member.queue.put_nowait(_forgery(part))
        _forged += 1
        member.queue.put_nowait(part.SerializeToString())
        if _previous:
            member.queue.put_nowait(_previous[-1])  # a replay of the victim's previous message
        _previous[:] = [part.SerializeToString()]
        COUNT.write_text(str(_forged))
    rest = cpb.RelayBatch()
    rest.messages.extend(p for p in batch.messages if p.host != VICTIM or p.host == self.own or GANGS_ONLY)
    for g in batch.gangs:
        if VICTIM in g.hosts and self.own != VICTIM:
            # the victim's share went above; the others' go as the honest relay sends them
            for p in relay.gang_parts(g):
                if p.host != VICTIM:
                    rest.messages.append(p)
        else:
            rest.gangs.append(g)
    _honest_forward(self, rest)


relay.Forwarder.forward = _hostile_forward  # type: ignore[method-assign]

if __name__ == "__main__":
    from server.worker.__main__ import main

    main()
