"""A model listing reads a small overview, not the per-layer summary

``models.overview`` holds the few numbers a listing shows of a model (its linears, KV cache per token,
sliding-window layers, experts, active parameters: store.records.ModelListing). A checkpoint's ``summary`` lists
every linear layer and can run to megabytes; listing every model read all of them. Rows from before this revision
stay NULL: the application writes each one's overview the first time it lists the model (reading that summary
once), so this revision needs no copy of the code that derives it.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("overview", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("overview")
