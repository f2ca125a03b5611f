"""Database engine, sessions, and the schema upgrade the controller runs at start."""

from __future__ import annotations

import logging
import os
import sys

from .connect import make_engine, redact, session_factory


class SchemaUpgradeFailed(RuntimeError):
    """The database could not be brought to the newest schema (the message says why)."""


def upgrade_schema(url: str) -> None:
    """Applies every pending migration (`migrate.upgrade_to_head`) in a forked child, so that
    Alembic is never loaded into this process; the upgrade costs what it would in-process (the
    child shares the modules already imported). Call it before starting any thread. Raises
    SchemaUpgradeFailed with the child's one-line reason."""
    if not hasattr(os, "fork"):  # no fork (not Linux or macOS): in this process, failing the same way
        reason = _upgrade(url)
        if reason:
            raise _failed(url, reason)
        return
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: upgrade, report, and leave without running the parent's exit handlers
        os.close(read_fd)
        code = 1
        try:
            reason = _upgrade(url)
            if reason:
                os.write(write_fd, reason.encode()[:2000])
            else:
                code = 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as fh:
        reason = fh.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise _failed(url, reason or f"the migration exited with code {code}")


def _upgrade(url: str) -> str:
    """Migrates to head in this process: "" when done, else why not, in one line."""
    try:
        from .migrate import upgrade_to_head

        upgrade_to_head(url)
    except BaseException as e:  # every failure is reported, in one line
        logging.getLogger(__name__).debug("schema upgrade failed", exc_info=True)
        return (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0]
    return ""


def _failed(url: str, reason: str) -> SchemaUpgradeFailed:
    return SchemaUpgradeFailed(f"cannot upgrade the database {redact(url)}: {reason}")


__all__ = ["SchemaUpgradeFailed", "make_engine", "redact", "session_factory", "upgrade_schema"]
