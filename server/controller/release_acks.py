"""Which of a client's releases reached their workers (controller.proto Hello.ack_releases,
SessionEvent.releases_done).

A client's release of a buffer waits in the controller behind the session's earlier runs
(client_session.py), then goes to the buffer's worker at the next flush, on that worker's stream.
A controller that dies meanwhile loses it: the client believes the buffer freed, and the session,
which resumes at the next controller, keeps it on the worker until it ends. So a client that asks
keeps each release until told it arrived, and sends those it was not told of again when it
resumes (pwctl/api/sender.py). A release has arrived once the worker it went to said it handled
the messages sent to it up to then (`WorkerToController.delivered`, links.py `acked`), or that
worker's stream ended (it registers again as a new link, and hears the owner's end, if any, from
`Cluster.missed`).

Per session: `releases_out` counts its release messages that passed its barrier (in the order
it sent them: the barrier keeps their order), each flushed at once. Every ACK_CHECK_S a check
records, for the sessions that released since the last one, that count with the last seq so far
of the links of the workers they released on (their releases are among the messages up to
there), and tells each session the highest count whose links all acknowledged. Nothing is done
per flush (a loop of calls flushes once or twice a call): the check pays for all of it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from schemas.pathways.v1 import controller_pb2 as cpb

if TYPE_CHECKING:
    from .client_session import ClientSession
    from .host_info import HostInfo
    from .links import WorkerLink

ACK_CHECK_S = 0.2  # how often the sessions hear which of their releases arrived


class ReleaseAcks:
    def __init__(self, host_by_address: Callable[[str], HostInfo | None]) -> None:
        self._host_by_address = host_by_address
        # per session: (releases_out at a check, the links and seqs they must acknowledge), oldest first
        self._marks: dict[ClientSession, deque[tuple[int, dict[WorkerLink, int]]]] = {}
        # the sessions that released since the last check, and the workers they released on
        self._releasing: dict[ClientSession, set[str]] = {}

    def released(self, session: ClientSession, address: str) -> None:
        """Some of `session`'s releases passed its barrier, for the worker at `address`: they go
        out at this flush."""
        if session.ack_releases:
            self._releasing.setdefault(session, set()).add(address)

    def check(self) -> None:
        """Records what the sessions released since the last check, then tells each session how
        many of its releases arrived, where that changed."""
        releasing, self._releasing = self._releasing, {}
        for session, addresses in releasing.items():
            seqs = {}
            for address in addresses:
                info = self._host_by_address(address)
                if info is not None and info.link is not None:
                    seqs[info.link] = info.link.next_seq - 1
            self._marks.setdefault(session, deque()).append((session.releases_out, seqs))
        for session, marks in list(self._marks.items()):
            done = session.releases_acked
            while marks and all(link.closed or link.acked >= seq for link, seq in marks[0][1].items()):
                done = marks.popleft()[0]
            if not marks:
                del self._marks[session]
            if done != session.releases_acked:
                session.releases_acked = done
                session.send(cpb.SessionEvent(releases_done=done))

    def forget(self, session: ClientSession) -> None:
        """The session ended: nothing more to tell it."""
        self._marks.pop(session, None)
        self._releasing.pop(session, None)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(ACK_CHECK_S)
            self.check()
