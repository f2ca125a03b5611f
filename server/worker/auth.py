"""Who may call a worker, and for what.

Two layers, on every address (loopback included: a machine's loopback is shared by all its users):

1. The cluster token (`authorization: Bearer <token>`) on every call but the standard health
   service, when the worker has one (`$PWCTL_TOKEN` or the data directory's token file; `--no-token`
   opts out on a private machine). Checked by `server.auth.TokenInterceptor` before any handler
   runs: a wrong token is UNAUTHENTICATED, never a later error.
2. Credentials the controller issues (server/credentials.py), checked per call whatever the token:
   uploads, fetches and waits need a session credential, which names the caller's owner and
   buffer-id prefix; peer transfers need the peer credential. The worker learns the key at
   registration. A call that comes before it waits for it: a restarted worker's clients learn its
   address from the controller as the controller registers it, so their first upload can overtake
   the worker's own Registered message, and a controller that restarts with its workers may take
   seconds on a loaded machine. The wait ends at the call's own deadline, and at
   `REGISTRATION_WAIT_S` at the latest; after it such calls are UNAVAILABLE (the client retries or
   reports it).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc import aio

from ..credentials import PEER_HEADER, SESSION_HEADER, Caller, check_peer, check_session

log = logging.getLogger(__name__)

REGISTRATION_WAIT_S = 30.0  # the longest a call that came before the worker's registration waits for it


def _metadata(context: aio.ServicerContext, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v.decode(errors="replace") if isinstance(v, bytes) else str(v)
    return ""


def _peer_name(context: aio.ServicerContext) -> str:
    try:
        return str(context.peer())
    except Exception:  # the peer's address is only for the log line
        return "?"


class WorkerAuth:
    """The worker's credential checks; `key` is set when the controller registers the worker."""

    def __init__(self) -> None:
        self.key: bytes | None = None
        self._registered = asyncio.Event()

    def set_key(self, key: bytes) -> None:
        """The key of the registration the controller just confirmed (called on the event loop)."""
        self.key = key
        self._registered.set()

    async def _registered_key(self, context: aio.ServicerContext) -> bytes:
        """The key; a call before registration waits for it until its deadline (at most
        REGISTRATION_WAIT_S), then is UNAVAILABLE."""
        remaining = context.time_remaining()
        wait_s = REGISTRATION_WAIT_S if remaining is None else min(max(remaining, 0.0), REGISTRATION_WAIT_S)
        try:
            async with asyncio.timeout(wait_s):
                await self._registered.wait()
        except TimeoutError:
            pass
        if self.key is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "this worker is not registered with its controller yet; try again")
        assert self.key is not None
        return self.key

    async def session(self, context: aio.ServicerContext, what: str) -> Caller:
        """The calling session; aborts the call (UNAUTHENTICATED) without a valid credential."""
        key = self.key if self.key is not None else await self._registered_key(context)
        value = _metadata(context, SESSION_HEADER)
        caller = check_session(key, value) if value else None
        if caller is None:
            log.warning("%s from %s refused: %s session credential", what, _peer_name(context),
                        "wrong" if value else "no")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{what} needs the session credential the controller issued "
                                f"(metadata {SESSION_HEADER})")
        assert caller is not None
        return caller

    def peer_secret_ok(self, secret: bytes) -> bool:
        """Whether `secret` (a TCP transfer link's hello, tcplink.py) is the peer credential."""
        key = self.key
        return key is not None and check_peer(key, secret.decode(errors="replace"))

    async def peer(self, context: aio.ServicerContext) -> None:
        """Returns when the caller is a worker of this cluster; aborts the call otherwise."""
        key = self.key if self.key is not None else await self._registered_key(context)
        value = _metadata(context, PEER_HEADER)
        if not value or not check_peer(key, value):
            log.warning("transfer from %s refused: %s peer credential", _peer_name(context),
                        "wrong" if value else "no")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"transfers are for the cluster's workers (metadata {PEER_HEADER})")
