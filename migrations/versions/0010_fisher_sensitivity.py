"""fisher_sensitivity: a sensitivity sweep may be the fast (Fisher) estimate, which measures no top-1 agreement

``sensitivity_results.top1_agree`` becomes nullable: a sweep made with ``method: fisher`` (its job's params and
result say so) estimates each unit's KL and measures its local SQNR, but not the top-1 agreement, which stays NULL.
Exact sweeps keep filling it. A downgrade is refused while such rows exist (the old schema cannot hold them, and a
downgrade loses nothing): delete those sweeps' jobs first.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sensitivity_results") as batch:
        batch.alter_column("top1_agree", existing_type=sa.Float(), nullable=True)


def downgrade() -> None:
    estimated = op.get_bind().execute(
        sa.text("SELECT COUNT(*) FROM sensitivity_results WHERE top1_agree IS NULL")).scalar()
    if estimated:
        raise RuntimeError(f"{estimated} sensitivity row(s) are Fisher estimates without a top-1 agreement, which "
                           "revision 0009 cannot hold; delete those sweeps (method fisher) before downgrading")
    with op.batch_alter_table("sensitivity_results") as batch:
        batch.alter_column("top1_agree", existing_type=sa.Float(), nullable=False)
