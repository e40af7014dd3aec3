"""SQLite: ids of models and plans are never reused (AUTOINCREMENT)

Without AUTOINCREMENT, SQLite gives a new row max(id) + 1, so after the newest model (or plan)
is removed the next one registered takes its id: an old ``?model=N`` link, a job's plan or a
``quantplan plan show N`` then names something else. PostgreSQL's sequences never go back, so
this is a no-op there.

SQLite cannot add AUTOINCREMENT to a table: each table is copied into a new one. The tables are
written out here as revision 0002 left them (reflection would drop the CHECK constraint), and the
copy runs with foreign keys off (see migrations/env.py): dropping the old ``models`` table with them
on would cascade into every plan, statistic and score.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _tables_at_0002() -> dict[str, sa.Table]:
    md = sa.MetaData(naming_convention=NAMING)
    sa.Table("users", md, sa.Column("id", sa.Integer(), primary_key=True))
    models = sa.Table(
        "models",
        md,
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("source_kind", sa.String(length=20), nullable=False),
        sa.Column("source_name", sa.String(length=500), nullable=False),
        sa.Column("path", sa.String(length=1000), nullable=False),
        sa.Column("architecture", sa.String(length=200), nullable=False),
        sa.Column("model_type", sa.String(length=100), nullable=False),
        sa.Column("num_layers", sa.Integer(), nullable=False),
        sa.Column("num_params", sa.BigInteger(), nullable=False),
        sa.Column("dtype", sa.String(length=40), nullable=False),
        sa.Column("hidden_size", sa.Integer(), nullable=True),
        sa.Column("vocab_size", sa.Integer(), nullable=True),
        sa.Column("total_bytes", sa.BigInteger(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.Integer(), sa.ForeignKey("users.id"), nullable=True),
        sa.CheckConstraint("source_kind IN ('folder', 'archive', 'gguf', 'demo')", name="source_kind"),
        sa.UniqueConstraint("name"),
        sa.UniqueConstraint("sha256"),
    )
    plans = sa.Table(
        "plans",
        md,
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("model_id", sa.Integer(), sa.ForeignKey("models.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("parent_id", sa.Integer(), sa.ForeignKey("plans.id"), nullable=True),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.Integer(), sa.ForeignKey("users.id"), nullable=True),
        sa.UniqueConstraint("model_id", "name", "version", name="uq_plans_model_name_version"),
    )
    return {"models": models, "plans": plans}


def _recreate(autoincrement: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    for name, table in _tables_at_0002().items():
        with op.batch_alter_table(
            name, recreate="always", copy_from=table, table_kwargs={"sqlite_autoincrement": autoincrement}
        ):
            pass


def upgrade() -> None:
    _recreate(True)


def downgrade() -> None:
    _recreate(False)
