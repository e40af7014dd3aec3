"""Kernel timings keep their spread

``kernel_results`` gains what a case's timed calls spread over, as ``triton.testing.do_bench(quantiles=(0.5, 0.2,
0.8))`` reports them: ``repeats`` (how many timed calls; ``ms`` stays their median), ``ms_p20`` and ``ms_p80``; the
baseline timed interleaved with a path (baseline, path, baseline, path, ...), whose median its ``speedup`` is
over: ``baseline_ms``, ``baseline_ms_p20``, ``baseline_ms_p80``; and ``unstable``, set where the p20-p80 band of
either is wider than quantcore.kernels.records.UNSTABLE_SPREAD of its median. Rows from before this revision stay
NULL: the pages show "—" for their spread and do not flag them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

FLOAT_COLUMNS = ("ms_p20", "ms_p80", "baseline_ms", "baseline_ms_p20", "baseline_ms_p80")


def upgrade() -> None:
    with op.batch_alter_table("kernel_results") as batch:
        batch.add_column(sa.Column("repeats", sa.Integer(), nullable=True))
        for name in FLOAT_COLUMNS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
        batch.add_column(sa.Column("unstable", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("kernel_results") as batch:
        for name in ("unstable", *reversed(FLOAT_COLUMNS), "repeats"):
            batch.drop_column(name)
