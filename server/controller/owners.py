"""Who may own a slice: `CreateSlice` with an owner (issue 29, finding 4).

A slice created with `owner="client:<id>"` or `"job:<id>"` goes when that client or job ends.
The owner came from a request field, so any caller could create slices as another tenant's job
(and have them released, or charged, with that job). Now a caller may name only an owner whose
session it holds: the owner of a session stream open on the *same connection* as the call. The
`pw` runtime opens its session and creates its slices over one channel, hence one connection
(gRPC reports it as the call's peer, `ipv4:127.0.0.1:54321`); another process has another
connection, whatever ids it knows. A request naming an owner it does not hold is refused
PERMISSION_DENIED and changes nothing; `owner=""` (a named slice, as `pwctl slice create` makes)
needs no session.

Limitation: behind a proxy that pools its upstream connections across clients (an L7 load
balancer), calls of several clients may share one connection; the session credential the
workers check (signed by the controller) is the stronger proof once callers send it here too.
"""

from __future__ import annotations

from collections import Counter

from .errors import PermissionDenied


class ConnectionOwners:
    """The owners of the session streams open on each connection (counted: a connection may
    carry several sessions of one owner)."""

    def __init__(self) -> None:
        self._held: Counter[tuple[str, str]] = Counter()

    def opened(self, peer: str, owner: str) -> None:
        self._held[(peer, owner)] += 1

    def closed(self, peer: str, owner: str) -> None:
        key = (peer, owner)
        self._held[key] -= 1
        if self._held[key] <= 0:
            del self._held[key]

    def check(self, peer: str, owner: str) -> None:
        """Raises PermissionDenied unless a session of `owner` is open on connection `peer`."""
        if owner and self._held.get((peer, owner), 0) <= 0:
            raise PermissionDenied(
                f"cannot create a slice owned by {owner!r}: a caller owns slices only as its own session "
                "or job (leave the owner empty for a named slice)")
