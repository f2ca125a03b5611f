"""Credentials the controller issues for calls to workers.

A worker cannot ask the controller who is calling it on every Fetch (a round trip per call on the
hot path), so the controller signs what the worker must know, with a key it hands every worker at
registration (`Registered.session_key`, over the token-authenticated WorkerConnect stream):

- a client's *session credential* (`Welcome.worker_credential`, sent to workers as metadata
  `x-pathways-session`) binds its owner ("client:<id>" / "job:<id>") and its buffer-id prefix.
  A worker serves a caller only the buffers of that owner and only ids under that prefix, so a
  session can neither read nor feed another session's buffers, whatever ids it sends;
- a *peer credential* (metadata `x-pathways-peer`) lets workers push transfers to each other;
  a client cannot present one, so it cannot inject or fail buffers through `Transfer`;
- a *job secret* (`$PWCTL_JOB_SECRET`, which the controller puts in the environment of the
  driver it starts) binds a session's `Hello.job_id`: only the job's driver can act as the job
  (own its slices and buffers as "job:<id>"). Signed with a key of its own (`job.key`), which
  workers never see.

Both are HMAC-SHA256 under the key; the key is a random secret in the controller's data
directory (mode 0600) so that credentials survive a controller restart. Limitation: any process
that registers as a worker receives the key, so registration must stay a privileged act (the
cluster token, or the controller's host credentials).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

SESSION_HEADER = "x-pathways-session"
PEER_HEADER = "x-pathways-peer"
KEY_FILE = "worker.key"
PREFIX_SHIFT = 40  # buffer and run ids are (prefix << PREFIX_SHIFT) | counter
KEY_BYTES = 32
JOB_KEY_FILE = "job.key"
JOB_SECRET_ENV = "PWCTL_JOB_SECRET"


@dataclass(frozen=True)
class Caller:
    """A client authenticated by its session credential."""

    owner: str
    prefix: int

    def owns_id(self, buffer_id: int) -> bool:
        return buffer_id >> PREFIX_SHIFT == self.prefix


def _read_key(path: Path) -> bytes | None:
    try:
        key = bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return key if len(key) == KEY_BYTES else None


def load_or_create_key(path: Path) -> bytes:
    """The controller's worker key at `path`, created (KEY_BYTES random bytes, mode 0600) on first
    use, or when the file holds no key. Written under a temporary name and moved into place, so
    a concurrent reader never sees it half written; of two processes creating it at once, the
    first to link it wins and both use its key."""
    key = _read_key(path)
    if key is not None:
        return key
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(KEY_BYTES) + "\n")
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            if _read_key(path) is None:  # not a key (damaged): replace it
                os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    key = _read_key(path)
    if key is None:
        raise OSError(f"cannot read the worker key {path}")
    return key


def _mac(key: bytes, text: str) -> str:
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def session_credential(key: bytes, owner: str, prefix: int) -> str:
    """`<prefix>|<owner>|<mac>`: what a session presents to workers."""
    return f"{prefix}|{owner}|{_mac(key, f'session|{prefix}|{owner}')}"


def check_session(key: bytes, value: str) -> Caller | None:
    """The caller a session credential names, or None when it is malformed or not signed by `key`."""
    prefix_text, _, rest = value.partition("|")
    owner, _, mac = rest.rpartition("|")
    if not prefix_text.isdigit() or not owner or len(prefix_text) > 20:
        return None
    if not hmac.compare_digest(mac.encode(), _mac(key, f"session|{prefix_text}|{owner}").encode()):
        return None
    return Caller(owner=owner, prefix=int(prefix_text))


def peer_credential(key: bytes) -> str:
    return _mac(key, "peer")


def check_peer(key: bytes, value: str) -> bool:
    return hmac.compare_digest(value.encode(), peer_credential(key).encode())


def job_secret(key: bytes, job_id: str) -> str:
    """The secret the driver of job `job_id` presents in its Hello (`$PWCTL_JOB_SECRET`)."""
    return _mac(key, f"job|{job_id}")


def check_job_secret(key: bytes, job_id: str, secret: str) -> bool:
    """Whether `secret` is job `job_id`'s secret under `key`."""
    return bool(secret) and hmac.compare_digest(secret.encode(), job_secret(key, job_id).encode())
