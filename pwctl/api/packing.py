"""What the session stream's sender sends: the items queued since its last message (messages,
and dropped futures' buffers as `Release`s) packed into one `ClientMessage`."""

from __future__ import annotations

from typing import NamedTuple

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb


class Release(NamedTuple):
    """A dropped future's buffer, queued as is: the sender thread turns runs of them into one
    release message per worker (a training step drops hundreds of futures at once)."""

    buffer_id: int
    address: str


def pack(batch: list[cpb.ClientMessage | Release],
         releases: list[wpb.ReleaseBuffers] | None = None) -> cpb.ClientMessage:
    """One message for a batch; adjacent releases of one worker's buffers become one release
    (a training step drops every parameter future of the step before: one message, not 85).
    `releases`, when given, gets the message's release messages, in order (sender.py keeps them
    until the controller says they arrived)."""
    msgs: list[cpb.ClientMessage] = []
    i = 0
    while i < len(batch):
        item = batch[i]
        if not isinstance(item, Release):
            msgs.append(item)
            i += 1
            continue
        ids = [item.buffer_id]
        i += 1
        while i < len(batch):
            nxt = batch[i]
            if not isinstance(nxt, Release) or nxt.address != item.address:
                break
            ids.append(nxt.buffer_id)
            i += 1
        msgs.append(cpb.ClientMessage(release=wpb.ReleaseBuffers(buffer_ids=ids, address=item.address)))
    if len(msgs) == 1:
        if releases is not None and msgs[0].HasField("release"):
            releases.append(msgs[0].release)
        return msgs[0]
    merged: list[cpb.ClientMessage] = []
    for msg in msgs:
        prev = merged[-1] if merged else None
        if (prev is not None and msg.HasField("release") and prev.HasField("release")
                and prev.release.address == msg.release.address and not (msg.release.owner or prev.release.owner)):
            prev.release.buffer_ids.extend(msg.release.buffer_ids)
        else:
            merged.append(msg)
    if releases is not None:
        releases.extend(m.release for m in merged if m.HasField("release"))
    if len(merged) == 1:
        return merged[0]
    return cpb.ClientMessage(batch=cpb.ClientBatch(messages=merged))
