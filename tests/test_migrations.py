"""Alembic: every revision upgrades and downgrades on an empty database; models match the schema."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from server.db.engine import make_engine
from server.db.migrate import alembic_config, current_revision, head_revision, upgrade_to_head
from server.db.models import Base


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'migrate.db'}"


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _diffs(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "render_as_batch": True})
            return list(compare_metadata(ctx, Base.metadata))
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(db_url: str) -> None:
    head = head_revision()
    assert head
    assert upgrade_to_head(db_url) == head
    assert current_revision(db_url) == head
    assert {"islands", "hosts", "devices"} <= _tables(db_url)
    assert _diffs(db_url) == []

    command.downgrade(alembic_config(db_url), "base")
    assert current_revision(db_url) == ""
    assert _tables(db_url) == set()

    assert upgrade_to_head(db_url) == head
    assert _diffs(db_url) == []


def test_each_revision_downgrades_one_step(db_url: str) -> None:
    cfg = alembic_config(db_url)
    revisions = [r.revision for r in reversed(list(ScriptDirectory.from_config(cfg).walk_revisions()))]
    assert revisions[0].startswith("0001")
    for rev in revisions:  # up one at a time, then down one and up again
        command.upgrade(cfg, rev)
        assert current_revision(db_url) == rev
        command.downgrade(cfg, "-1")
        command.upgrade(cfg, rev)
        assert current_revision(db_url) == rev
    assert current_revision(db_url) == head_revision()
    assert _diffs(db_url) == []


def test_models_match_the_migrated_schema(db_url: str) -> None:
    upgrade_to_head(db_url)
    assert _tables(db_url) == set(Base.metadata.tables)


def test_the_controller_upgrades_in_a_child_without_loading_alembic(db_url: str, tmp_path: Path) -> None:
    """`upgrade_schema` (what the controller runs at start) migrates in a forked child: the
    database reaches head while this process never imports Alembic; a failure is one line."""
    code = textwrap.dedent(f"""
        import sys
        from server.db.engine import SchemaUpgradeFailed, upgrade_schema
        upgrade_schema({db_url!r})
        upgrade_schema({db_url!r})  # at head already: nothing to do
        assert not [m for m in sys.modules if m.split(".")[0] in ("alembic", "mako")], "alembic loaded"
        try:
            upgrade_schema("postgresql://nobody@127.0.0.1:1/none")
        except SchemaUpgradeFailed as e:
            print("FAILED:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert current_revision(db_url) == head_revision()
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("FAILED:")]
    assert line.startswith("FAILED: cannot upgrade the database postgresql://nobody@127.0.0.1:1/none: ")


def test_without_fork_the_upgrade_runs_in_process_and_fails_in_one_line(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where `os.fork` is missing (Windows), `upgrade_schema` migrates in the calling process,
    with the same one-line failure."""
    from server.db.engine import SchemaUpgradeFailed, upgrade_schema

    monkeypatch.delattr(os, "fork")
    upgrade_schema(db_url)
    assert current_revision(db_url) == head_revision()
    with pytest.raises(SchemaUpgradeFailed) as failed:
        upgrade_schema("postgresql://nobody:secret@127.0.0.1:1/none")
    message = str(failed.value)
    assert message.startswith("cannot upgrade the database postgresql://nobody:***@127.0.0.1:1/none: ")
    assert "\n" not in message and "secret" not in message
