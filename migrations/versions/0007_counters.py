"""Named counters that survive a restart.

Adds `counters` (name, value). Its first use is `slice_auto_seq`, the highest N of the
automatic slice names "slice-N" ever given, so that a restarted controller never gives a
deleted slice's name to a new slice. Databases from before this revision start it from their
slices' names, as the controller did.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "counters",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.Integer(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("counters")
