"""The software a job ran with

``jobs`` gains ``environment`` (JSON): what the worker that started the job ran it with (quantplan's version and git
commit, python, torch, transformers, CUDA), written as it marks the job running, so a run's permalink page says
which code produced its results. Rows from before stay NULL ("not recorded"). Downgrading drops the column; the
jobs and everything else stay.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("environment", sa.JSON(), nullable=True))


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":  # in place (SQLite 3.35+): a batch copy of ``jobs`` would lose its constraints
        op.execute("ALTER TABLE jobs DROP COLUMN environment")
    else:
        op.drop_column("jobs", "environment")
