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
the (link, last seq) of every host it sent releases to; a check every ACK_CHECK_S tells the
session the highest count whose links all acknowledged.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from schemas.pathways.v1 import controller_pb2 as cpb

if TYPE_CHECKING:
    from .client_session import ClientSession
    from .host_info import HostInfo
    from .links import WorkerLink

ACK_CHECK_S = 0.2  # how often the sessions hear which of their releases arrived


class ReleaseAcks:
    def __init__(self, hosts: Mapping[str, HostInfo]) -> None:
        self._hosts = hosts
        # per session: (releases_out after a flush, the links and seqs they must acknowledge)
        self._marks: dict[ClientSession, deque[tuple[int, list[tuple[WorkerLink, int]]]]] = {}
        self.releasing: set[ClientSession] = set()  # sessions with releases in the current flush

    def released(self, session: ClientSession) -> None:
        """Some of `session`'s releases passed its barrier: they go out at the next flush."""
        if session.ack_releases:
            self.releasing.add(session)

    def flushed(self, hosts: Iterable[str]) -> None:
        """(the dispatcher, once a flush sent its messages) The releases of that flush went to `hosts`."""
        releasing, self.releasing = self.releasing, set()
        marks = []
        for name in hosts:
            info = self._hosts.get(name)
            if info is not None and info.link is not None:
                marks.append((info.link, info.link.next_seq - 1))
        for session in releasing:
            self._marks.setdefault(session, deque()).append((session.releases_out, marks))

    def check(self) -> None:
        """Tells each session how many of its releases arrived, where that changed."""
        for session, marks in list(self._marks.items()):
            done = session.releases_acked
            while marks and all(link.closed or link.acked >= seq for link, seq in marks[0][1]):
                done = marks.popleft()[0]
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
