"""Host credentials: how a host proves, when it registers again, that it is the host that holds
its name (issue 29, finding 5: a registration under a live host's name replaced it).

The controller issues a random credential at a host's first registration (and whenever a new
process takes a name whose host was lost); the worker keeps it (in memory, and in its data
directory with mode 0600) and sends it with every later registration. The controller keeps only
its SHA-256 digest (the credential is 256 random bits: a plain digest cannot be reversed, and a
slow hash would buy nothing), in memory and in the `hosts` table.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets


def issue() -> tuple[str, str]:
    """A new credential and the digest to keep of it."""
    credential = secrets.token_urlsafe(32)
    return credential, digest(credential)


def digest(credential: str) -> str:
    return hashlib.sha256(credential.encode()).hexdigest()


def matches(credential: str, kept: str) -> bool:
    """True when `credential` is the one whose digest is `kept` (constant-time)."""
    return bool(credential) and hmac.compare_digest(digest(credential), kept)
