"""conversations.retention_ttl_s and retention_priority: a conversation's retention settings
(app/session_settings.py), which go with its turns' budget to the engine's retention policy
(memory/retention.py). Null: the server's default.

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("conversations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("retention_ttl_s", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("retention_priority", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("conversations", schema=None) as batch_op:
        batch_op.drop_column("retention_priority")
        batch_op.drop_column("retention_ttl_s")
