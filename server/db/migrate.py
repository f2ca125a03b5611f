"""Alembic migrations: the schema upgrade and its revisions.

The controller never imports this module itself (Alembic brings Mako and Pygments, ~12 MiB
that a long-running server would keep for nothing): `engine.upgrade_schema` runs the upgrade
in a forked child. Tests and tools use it directly.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import make_url

import migrations

from .. import paths
from .connect import make_engine

MIGRATIONS_DIR = Path(migrations.__file__).parent


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


@contextmanager
def _upgrade_lock(url: str) -> Iterator[None]:
    """One process migrates at a time (two servers started together on one file)."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:":
        lock_path = Path(u.database).with_suffix(".migrate.lock")
    else:
        lock_path = paths.data_dir() / "migrate.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def upgrade_to_head(url: str) -> str:
    """Applies every pending migration; returns the revision the database is at."""
    with _upgrade_lock(url):
        command.upgrade(alembic_config(url), "head")
    return current_revision(url)


def current_revision(url: str) -> str:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision() or ""
    finally:
        engine.dispose()


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    return head or ""
