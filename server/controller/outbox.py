"""One flush's messages for the workers, per host in order (the dispatcher's, dispatch.py).

A gang node over a large island is one task per member host, and the members' tasks differ
only in segment, seq and segment id (plans.Plan.group_of). So where a host's Enqueue of a flush
holds nothing but such tasks, it is kept as a `GangEnqueue`: the group's task (its *template*,
built once per run) and the member's three numbers, not a message. It becomes a message only
where one is needed: when it is sent on the host's own stream, when more goes into the host's
Enqueue, or when it must be sent again directly. Relayed, the members of a group that share
their templates share one serialized body (relays.py, controller.proto `RelayedGang`), and the
members make their messages of it (server/worker/relay.py `gang_parts`, `relayed_message`).
"""

from __future__ import annotations

from typing import Any, Protocol, Union

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb


class GangEnqueue(list[tuple[wpb.Task, int, int, int]]):
    """A host's Enqueue of one flush that holds only gang members' tasks: per task (the list's
    items), its group's template and this member's segment, seq and segment id (see the module
    docstring). A list itself: one is made per member host, hundreds per gang run, in C."""

    __slots__ = ()

    def key(self) -> int | tuple[int, ...]:
        """Which templates (by identity): members with the same key share a body (relays.py
        makes it inline for one task: that template's id)."""
        return id(self[0][0]) if len(self) == 1 else tuple(id(t[0]) for t in self)

    def message(self, seq: int = 0) -> cpb.ControllerToWorker:
        """The Enqueue as the host's message (numbered `seq`, or not yet)."""
        msg = cpb.ControllerToWorker(seq=seq)
        tasks = msg.enqueue.tasks
        for template, segment, task_seq, segment_id in self:
            add_member(tasks, template, segment, task_seq, segment_id)
        return msg


def add_member(tasks: Any, template: wpb.Task, segment: int, seq: int, segment_id: int) -> None:
    """Adds to `tasks` (an `Enqueue.tasks`) a gang member's task: its group's `template` with the
    member's segment, seq and segment id (built in place: an append would copy it)."""
    task = tasks.add()
    task.CopyFrom(template)
    task.segment = segment
    task.seq = seq
    task.segment_id = segment_id


Message = Union[cpb.ControllerToWorker, GangEnqueue]  # noqa: UP007  # an alias: evaluated at import


def materialized(msg: Message) -> cpb.ControllerToWorker:
    return msg.message() if type(msg) is GangEnqueue else msg  # type: ignore[return-value]


class Outbox:
    """Per-host ordered messages of one flush; consecutive enqueues/releases merge."""

    def __init__(self) -> None:
        self.msgs: dict[str, list[Message]] = {}

    def _last(self, host: str, kind: str) -> cpb.ControllerToWorker:
        q = self.msgs.setdefault(host, [])
        if q and type(q[-1]) is GangEnqueue:
            q[-1] = q[-1].message()  # more goes into this Enqueue: a message now
        if not q or q[-1].WhichOneof("msg") != kind:  # type: ignore[union-attr]  # materialized above
            q.append(cpb.ControllerToWorker())
            getattr(q[-1], kind).SetInParent()
        return q[-1]  # type: ignore[return-value]

    def enqueue(self, host: str) -> wpb.Enqueue:
        return self._last(host, "enqueue").enqueue

    def gang(self, host: str) -> GangEnqueue | None:
        """The host's gang-only Enqueue to add a member's task to (a new one when its last message
        is not an Enqueue), or None when its Enqueue of this flush is a message already (the task
        then goes into that: `enqueue`)."""
        q = self.msgs.setdefault(host, [])
        if q:
            last = q[-1]
            if type(last) is GangEnqueue:
                return last
            if last.WhichOneof("msg") == "enqueue":  # type: ignore[union-attr]
                return None
        g = GangEnqueue()
        q.append(g)
        return g

    def release(self, host: str, ids: list[int], owner: str = "") -> None:
        """`owner`'s buffers `ids` released on `host`: into the host's last message when that is
        an Enqueue (applied after its nodes) or a release of the same owner's, else a new one
        (none for no ids: a release naming an owner and no ids releases all the owner's)."""
        if not ids:
            return
        q = self.msgs.get(host)
        if q:
            if type(q[-1]) is GangEnqueue:
                q[-1] = q[-1].message()
            last: cpb.ControllerToWorker = q[-1]  # type: ignore[assignment]  # a message now
            kind = last.WhichOneof("msg")
            if kind == "enqueue" and (not last.enqueue.release_ids or last.enqueue.release_owner == owner):
                last.enqueue.release_owner = owner
                last.enqueue.release_ids.extend(ids)  # applied after that message's nodes
                return
            if kind == "release" and last.release.owner == owner:
                last.release.buffer_ids.extend(ids)
                return
        self.other(host, cpb.ControllerToWorker(release=wpb.ReleaseBuffers(buffer_ids=ids, owner=owner)))

    def other(self, host: str, msg: cpb.ControllerToWorker) -> None:
        self.msgs.setdefault(host, []).append(msg)


class WorkerOutbox(Protocol):
    """Where a flush's messages go: the worker links (the cluster), or a test's recorder."""

    def send(self, host: str, msg: cpb.ControllerToWorker) -> None:
        """Queues `msg` on host `host`'s stream, in order; drops it when the host has no link."""
        ...
