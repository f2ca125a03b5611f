"""Which of a client's releases reached their workers (controller.proto Hello.ack_releases,
SessionEvent.releases_done).

A client's release of a buffer waits in the controller behind the session's earlier runs
(client_session.py), then goes to the buffer's worker at the next flush, on that worker's stream.
A controller that dies meanwhile loses it: the client believes the buffer freed, and the session,
which resumes at the next controller, keeps it on the worker until it ends. So a client that asks
keeps each release until told it arrived, and sends those it was not told of again when it
resumes (pwctl/api/sender.py). A release has arrived once every worker it went to said it
handled the messages sent to it up to that flush (`WorkerToController.delivered`, links.py `acked`),
or that worker's stream ended (it registers again as a new link, and hears the owner's end, if
any, from `Cluster.missed`).

Per session: `releases_out` counts its release messages that passed its barrier (in the order
it sent them: the barrier keeps their order); each flush that sent some records that count with
the last seq of every host's link it sent releases to (the flushes of one MARK_S share one
record: a loop of calls flushes once or twice a call, and a record each cost the controller
~10 us a call); a check every ACK_CHECK_S tells the session the highest count whose links all
acknowledged.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from schemas.pathways.v1 import controller_pb2 as cpb

if TYPE_CHECKING:
    from .client_session import ClientSession
    from .host_info import HostInfo
    from .links import WorkerLink

ACK_CHECK_S = 0.2  # how often the sessions hear which of their releases arrived
MARK_S = 0.05  # the flushes within this long of a session's last record join it


class _Mark:
    """Releases up to `count` of a session arrived once each link in `seqs` handled its seq."""

    __slots__ = ("count", "seqs", "since")

    def __init__(self, count: int, seqs: dict[WorkerLink, int], since: float) -> None:
        self.count, self.seqs, self.since = count, seqs, since


class ReleaseAcks:
    def __init__(self, hosts: Mapping[str, HostInfo]) -> None:
        self._hosts = hosts
        self._marks: dict[ClientSession, deque[_Mark]] = {}  # per session, oldest first
        self.releasing: set[ClientSession] = set()  # sessions with releases in the current flush

    def released(self, session: ClientSession) -> None:
        """Some of `session`'s releases passed its barrier: they go out at the next flush."""
        if session.ack_releases:
            self.releasing.add(session)

    def flushed(self, hosts: Iterable[str]) -> None:
        """(the dispatcher, once a flush sent its messages) The releases of that flush went to `hosts`."""
        releasing, self.releasing = self.releasing, set()
        seqs = {}
        for name in hosts:
            info = self._hosts.get(name)
            if info is not None and info.link is not None:
                seqs[info.link] = info.link.next_seq - 1
        now = time.monotonic()
        for session in releasing:
            marks = self._marks.get(session)
            if marks is None:
                marks = self._marks[session] = deque()
            elif marks and now - marks[-1].since < MARK_S:  # joins the last (later seqs cover earlier)
                marks[-1].count = session.releases_out
                marks[-1].seqs.update(seqs)
                continue
            marks.append(_Mark(session.releases_out, dict(seqs), now))

    def check(self) -> None:
        """Tells each session how many of its releases arrived, where that changed."""
        for session, marks in list(self._marks.items()):
            done = session.releases_acked
            while marks and all(link.closed or link.acked >= seq for link, seq in marks[0].seqs.items()):
                done = marks.popleft().count
            if not marks:
                del self._marks[session]
            if done != session.releases_acked:
                session.releases_acked = done
                session.send(cpb.SessionEvent(releases_done=done))

    def forget(self, session: ClientSession) -> None:
        """The session ended: nothing more to tell it."""
        self._marks.pop(session, None)
        self.releasing.discard(session)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(ACK_CHECK_S)
            self.check()
