"""Jobs and programs: submitted driver scripts and the programs every client or job registered.

Adds `jobs` (one row per `pwctl submit`: request, state, pid, exit code, reason, times, the slices
it used as a JSON list) and `programs` (one row per program id and owner: name, node count, slices,
registration time, run and failure counters, last run). Counters are written in batches by the
controller, not per run.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("entrypoint", sa.String(256), nullable=False),
        sa.Column("args", sa.JSON(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("slices", sa.JSON(), nullable=False),
        sa.Column("submitted_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_jobs_state", "jobs", ["state"])
    op.create_table(
        "programs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("program_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("nodes", sa.Integer(), nullable=False),
        sa.Column("slices", sa.JSON(), nullable=False),
        sa.Column("registered_at", sa.DateTime(), nullable=False),
        sa.Column("runs", sa.Integer(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("last_run_at", sa.DateTime(), nullable=True),
        sa.UniqueConstraint("program_id", "owner"),
    )
    op.create_index("ix_programs_program_id", "programs", ["program_id"])
    op.create_index("ix_programs_owner", "programs", ["owner"])


def downgrade() -> None:
    op.drop_index("ix_programs_owner", table_name="programs")
    op.drop_index("ix_programs_program_id", table_name="programs")
    op.drop_table("programs")
    op.drop_index("ix_jobs_state", table_name="jobs")
    op.drop_table("jobs")
