"""Removed models keep their history; one plan version "chosen" per model

``models`` gains ``removed_at`` and ``removed_by`` (a person's name, as ``audit.actor`` and ``notes.author`` keep
it): removing a model now marks its row and frees its files, and its plans, jobs, statistics, scores and notes stay
readable with a "removed" marker; only an admin's purge deletes the row (and, by the existing CASCADEs, its
results). The new ``chosen_plans`` table keeps, per model (``model_id`` unique: one chosen version at a time), the
plan version a person chose, who, when and why; the history of choices is in the audit log.

Downgrading drops the choices and the columns; it is refused while a model is marked removed (revision 0011 would
show it as a live model whose files are gone: purge it first). SQLite drops the columns in place (ALTER TABLE ...
DROP COLUMN, SQLite 3.35+): a batch copy of ``models`` would lose its CHECK constraint and AUTOINCREMENT.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("removed_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("removed_by", sa.String(length=200), nullable=True))
    op.create_table(
        "chosen_plans",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("plan_id", sa.Integer(), nullable=False),
        sa.Column("chosen_by", sa.String(length=200), nullable=False),
        sa.Column("chosen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("why", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_chosen_plans_model_id_models"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["plan_id"], ["plans.id"], name=op.f("fk_chosen_plans_plan_id_plans"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_chosen_plans")),
        sa.UniqueConstraint("model_id", name=op.f("uq_chosen_plans_model_id")),
    )


def downgrade() -> None:
    bind = op.get_bind()
    removed = bind.execute(sa.text("SELECT name FROM models WHERE removed_at IS NOT NULL ORDER BY id")).scalars().all()
    if removed:
        raise RuntimeError(f"{len(removed)} model(s) are marked removed ({', '.join(removed[:5])}); revision 0011 "
                           "would show them as live models whose files are gone: purge them "
                           "(quantplan models purge NAME, an admin) before downgrading")
    op.drop_table("chosen_plans")
    for column in ("removed_by", "removed_at"):
        if bind.dialect.name == "sqlite":
            op.execute(f"ALTER TABLE models DROP COLUMN {column}")
        else:
            op.drop_column("models", column)
