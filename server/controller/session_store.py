"""The durable half of client sessions: what lets a `pw` session resume after a controller restart.

A session's row (`client_sessions`) holds its client id, buffer-id prefix and the SHA-256 of a
resume token that only the client holds (sent once, in its Welcome). The row is written before
the Welcome goes out and deleted when the session ends. A controller that starts reads the rows
a crashed or stopped predecessor left: those sessions are *resumable* for a grace period — their
slices, their buffers on the workers and their id prefixes are kept — and a Hello that names one
with its token resumes it. What the grace period leaves unclaimed is released as a session that
ended would be.

Not kept: registered programs and their functions (the client registers them again when it
resumes), runs in flight (see `pwctl/api/runtime.py`: the client learns from the workers which
of them finished).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from concurrent.futures import Future
from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from ..db.models import ClientSessionRow
from ..db.writer import Write

# How long a controller that starts keeps the sessions of its predecessor for their clients to
# resume (`--session-grace`); the `pw` client retries for as long (PWCTL_RECONNECT_S).
DEFAULT_GRACE_S = 60.0


def new_token() -> str:
    return secrets.token_urlsafe(24)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Resumable:
    """A session that a client may resume."""

    client_id: str
    id_prefix: int
    token_hash: str
    job_id: str = ""
    name: str = ""

    @property
    def owner(self) -> str:
        return f"job:{self.job_id}" if self.job_id else f"client:{self.client_id}"

    def accepts(self, token: str) -> bool:
        return bool(token) and hmac.compare_digest(self.token_hash, token_hash(token))


class SessionStore:
    """Reads the rows once at start; every write goes through the database writer."""

    def __init__(self, db: sessionmaker[Session], write: Write) -> None:
        self._db = db
        self._write = write

    def load(self) -> dict[str, Resumable]:
        with self._db() as s:
            rows = s.scalars(select(ClientSessionRow)).all()
            return {r.client_id: Resumable(r.client_id, r.id_prefix, r.token_hash, r.job_id, r.name) for r in rows}

    def opened(self, rec: Resumable) -> Future[None]:
        def save(s: Session) -> None:
            s.merge(ClientSessionRow(client_id=rec.client_id, id_prefix=rec.id_prefix, token_hash=rec.token_hash,
                                     job_id=rec.job_id, name=rec.name[:128]))

        return self._write(save)

    def closed(self, client_ids: list[str]) -> Future[None]:
        def drop(s: Session) -> None:
            s.execute(delete(ClientSessionRow).where(ClientSessionRow.client_id.in_(client_ids)))

        return self._write(drop)
