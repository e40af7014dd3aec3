"""Kernel timings say how they were timed

``kernel_results.timing`` holds quantcore.kernels.records.TIMING of the run that measured a row. A benchmark job
reuses a stored row only when it was timed the way quantplan times now. CUDA rows from before this revision
were already timed with the L2 flushed before each call: they are marked so. CPU rows stay NULL (their caches
were left warm between calls, which flattered small weights): they are measured again the next time their
device is asked, and stay in the history.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("kernel_results") as batch:
        batch.add_column(sa.Column("timing", sa.String(length=40), nullable=True))
    op.execute(
        "UPDATE kernel_results SET timing = 'cold-caches-1' WHERE device = 'cuda'"
    )  # quantcore.kernels.records.TIMING


def downgrade() -> None:
    with op.batch_alter_table("kernel_results") as batch:
        batch.drop_column("timing")
