"""sweep_shards: a sensitivity sweep split into shard jobs, each a job row of its own, merged into the parent's

A sharded sweep's parent job row holds the merged result; each shard is a ``sensitivity`` job row that one worker
runs (worker.bodies.sweep_shards). A new table: nothing existing changes, and downgrading drops it (shard rows stay
as ordinary sensitivity jobs without their merged view).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sweep_shards",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("shards", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=200), nullable=True),
        sa.ForeignKeyConstraint(["parent_id"], ["jobs.id"], name=op.f("fk_sweep_shards_parent_id_jobs"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_sweep_shards_job_id_jobs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweep_shards")),
        sa.UniqueConstraint("job_id", name=op.f("uq_sweep_shards_job_id")),
        sa.UniqueConstraint("parent_id", "shard", name="uq_sweep_shards_parent_shard"),
    )
    op.create_index(op.f("ix_sweep_shards_parent_id"), "sweep_shards", ["parent_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_sweep_shards_parent_id"), table_name="sweep_shards")
    op.drop_table("sweep_shards")
