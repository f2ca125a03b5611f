"""Signatures on relayed controller messages: a relay cannot forge, alter or replay what it
carries for its members (server/worker/relay.py, server/controller/relays.py).

A relay sees its members' messages, their `seq` numbers and their registrations' `link` ids, and
it may open a `Relayed` stream to any member (the peer credential every worker holds lets it).
Unsigned, it could hand a member an `Enqueue` or a `Drop` the controller never sent, change one,
or give it an old one again under its current numbers. So the controller signs each relayed part
for its receiver, and the receiver checks before the message goes anywhere (its `Inbox`):

- *The key* is the receiver's alone: `link_key(credential, link)`, from its host credential
  (server/controller/hostcreds.py; the worker keeps it, mode 0600, and sends it with its
  registration; the controller keeps only its digest on disk, and the derived key in memory, on
  the registration's `WorkerLink`) and this registration's `Registered.link`. No relay, peer or
  client learns either: a host's credential goes only between it and the controller, on its own
  WorkerConnect stream.
- *What is signed*: a plain part's `message` bytes, which carry its `seq`; a gang member's part
  (`RelayedGangMember`) as the shared body's SHA-256 (its first 31 bytes) and the member's
  numbers (its seq and each task's segment, seq and segment id), so that the controller hashes
  a gang's body once and signs each member in ~0.5 µs (one BLAKE2s block for a one-task member,
  from the link's keyed state, `WorkerLink.relay_mac`). A domain byte keeps the two forms apart.
- *Replay*: a signed `seq` is handled once (the Inbox drops a seq it has had); an earlier
  registration's message fails under the new registration's key; another host's fails under
  this host's key.

The MAC is keyed BLAKE2s with a 16-byte tag (RFC 7693's keyed mode, a PRF: as strong here as an
HMAC-SHA256 truncated to 128 bits, and several times cheaper per call in CPython, which matters
at 512 members a gang node). The key is HMAC-SHA256(credential, "pathways relay|<link>"), made
once per registration.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

KEY_BYTES = 32
TAG_BYTES = 16
DIGEST_BYTES = 31  # of a gang body's SHA-256: domain byte, digest and one task's numbers fill one block
_PLAIN = b"m"
_GANG = b"g"

Mac = Any  # hashlib's BLAKE2s object (its type is not public)


def link_key(credential: str, link: int) -> bytes:
    """The key of one registration (`link`) of the host holding `credential`."""
    return hmac.digest(credential.encode(), f"pathways relay|{link}".encode(), "sha256")


def keyed(key: bytes) -> Mac:
    """The MAC's state keyed with `key`, to be copied for each signature (the key is absorbed once)."""
    return hashlib.blake2s(key=key, digest_size=TAG_BYTES)


def sign_message(mac: Mac, message: bytes) -> bytes:
    """The signature of a plain relayed part (its serialized ControllerToWorker), under `keyed(key)`."""
    m = mac.copy()
    m.update(_PLAIN)
    m.update(message)
    return m.digest()


def body_digest(body: bytes) -> bytes:
    """What a gang member's signature covers of the shared body."""
    return hashlib.sha256(body).digest()[:DIGEST_BYTES]


_ONE_TASK = struct.Struct("<QIiQQ")  # seq, task count 1, segment, task seq, segment id


one_task_numbers = _ONE_TASK.pack  # (seq, 1, segment, task seq, segment id): a one-task member's numbers


def gang_numbers(seq: int, segments: list[int], task_seqs: list[int], segment_ids: list[int]) -> bytes:
    """A gang member's numbers as signed (its task lists are of one length: checked by the caller)."""
    k = len(segments)
    if k == 1:
        return _ONE_TASK.pack(seq, 1, segments[0], task_seqs[0], segment_ids[0])
    return struct.pack(f"<QI{k}i{k}Q{k}Q", seq, k, *segments, *task_seqs, *segment_ids)


def sign_gang(mac: Mac, digest: bytes, numbers: bytes) -> bytes:
    """The signature of a gang member's share: the body's digest and the member's numbers."""
    m = mac.copy()
    m.update(_GANG + digest + numbers)
    return m.digest()


def matches(tag: bytes, expected: bytes) -> bool:
    """Constant-time comparison of a received signature with the one computed."""
    return hmac.compare_digest(tag, expected)


def gang_macs(digest: bytes, macs: tuple[Mac, ...], seqs: tuple[int, ...], segments: tuple[int, ...],
              task_seqs: tuple[int, ...], segment_ids: tuple[int, ...]) -> list[bytes]:
    """Every member's signature of a RelayedGang (the controller's side, hundreds a gang node):
    member i's keyed state macs[i] over the body's `digest` and its numbers, as `gang_numbers`
    lays them out (the task lists hold k = len(segments) / len(macs) items per member, in order)."""
    prefix = _GANG + digest
    n = len(macs)
    out = []
    if n and len(segments) == n:  # one task each: the usual gang node; one block each
        pack = _ONE_TASK.pack
        for mac, seq, seg, tseq, sid in zip(macs, seqs, segments, task_seqs, segment_ids, strict=True):
            m = mac.copy()
            m.update(prefix + pack(seq, 1, seg, tseq, sid))
            out.append(m.digest())
        return out
    k = len(segments) // n if n else 0
    for i in range(n):
        a, b = i * k, (i + 1) * k
        out.append(sign_gang(macs[i], digest, gang_numbers(seqs[i], list(segments[a:b]), list(task_seqs[a:b]),
                                                            list(segment_ids[a:b]))))
    return out
