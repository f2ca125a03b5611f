"""Host credentials: the digest of the credential each host proves itself with.

Adds `hosts.credential_hash` (the SHA-256 hex digest of the random credential the controller
issued at the host's first registration; NULL for hosts recorded before this revision, whose
next registration adopts a new one). A registration under the name of a live host must carry
that host's credential (server/controller/hostcreds.py).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("credential_hash", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("credential_hash")
