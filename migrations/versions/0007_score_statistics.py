"""Scores keep their uncertainty

``score_results`` gains the standard errors and headline figures of quantcore.evaluation.statistics that the pages
sort and compare by: ``kl_mean_err``, ``top1_agree_err``, ``ln_ppl_ratio`` (ln(PPL_q / PPL_ref)),
``ln_ppl_ratio_err`` and ``dp_mean``; the rest (the percentile sets, Δp's RMS, the per-sequence means a paired
comparison reads, the evaluation set's key) lives in the score's ``details`` JSON. ``sensitivity_results`` gains
``kl_mean_err``. Rows from before this revision stay NULL: they were scored without these figures, and the pages
show "—" for them (scoring the plan again fills them in).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

SCORE_COLUMNS = ("kl_mean_err", "top1_agree_err", "ln_ppl_ratio", "ln_ppl_ratio_err", "dp_mean")


def upgrade() -> None:
    with op.batch_alter_table("score_results") as batch:
        for name in SCORE_COLUMNS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
    with op.batch_alter_table("sensitivity_results") as batch:
        batch.add_column(sa.Column("kl_mean_err", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sensitivity_results") as batch:
        batch.drop_column("kl_mean_err")
    with op.batch_alter_table("score_results") as batch:
        for name in reversed(SCORE_COLUMNS):
            batch.drop_column(name)
