"""Client sessions that outlive a controller restart.

Adds `client_sessions` (one row per open `pw` session: client id, buffer-id prefix, the hash of
its resume token, job id, name, when it opened). A controller that starts keeps the slices and
buffers of these sessions for a grace period, so that their clients can resume.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "client_sessions",
        sa.Column("client_id", sa.String(32), primary_key=True),
        sa.Column("id_prefix", sa.Integer(), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("opened_at", sa.DateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("client_sessions")
