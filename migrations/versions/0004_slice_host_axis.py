"""Slices over several hosts: the mesh axis that runs across hosts (`pwctl slice create --mesh 2x4
--host-axis 0`), kept so that a remap places the slice with the same shape over hosts.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("slices") as batch:
        batch.add_column(sa.Column("host_axis", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("slices") as batch:
        batch.drop_column("host_axis")
