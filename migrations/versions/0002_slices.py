"""Virtual slices: the slice requests, their virtual -> physical device mapping, and remap history.

Adds `slices` (one row per slice: request, owner, status, reason, generation), `slice_devices`
(virtual index -> physical device id, one row per virtual device) and `slice_remaps` (when and why
a slice moved, old and new mapping as JSON lists). Mapping and history rows go with their slice.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "slices",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("devices", sa.Integer(), nullable=False),
        sa.Column("mesh", sa.JSON(), nullable=True),
        sa.Column("island", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("exclusive", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    op.create_table(
        "slice_devices",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("slice_id", sa.Integer(), sa.ForeignKey("slices.id", ondelete="CASCADE"), nullable=False),
        sa.Column("virtual_index", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), sa.ForeignKey("devices.id"), nullable=False),
        sa.UniqueConstraint("slice_id", "virtual_index"),
    )
    op.create_index("ix_slice_devices_slice_id", "slice_devices", ["slice_id"])
    op.create_index("ix_slice_devices_device_id", "slice_devices", ["device_id"])
    op.create_table(
        "slice_remaps",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("slice_id", sa.Integer(), sa.ForeignKey("slices.id", ondelete="CASCADE"), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("old_devices", sa.JSON(), nullable=False),
        sa.Column("new_devices", sa.JSON(), nullable=False),
    )
    op.create_index("ix_slice_remaps_slice_id", "slice_remaps", ["slice_id"])


def downgrade() -> None:
    op.drop_index("ix_slice_remaps_slice_id", table_name="slice_remaps")
    op.drop_table("slice_remaps")
    op.drop_index("ix_slice_devices_device_id", table_name="slice_devices")
    op.drop_index("ix_slice_devices_slice_id", table_name="slice_devices")
    op.drop_table("slice_devices")
    op.drop_table("slices")
