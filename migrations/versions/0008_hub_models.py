"""Models registered by Hugging Face Hub id

``models.source_kind`` may be ``hub``: a model downloaded from the Hub (or a mirror) by its id, whose
``source_name`` records the commit its revision resolved to (``hf://ORG/NAME@<40-hex commit>``), so a later
registration of the same id and revision finds it without downloading again.

PostgreSQL changes the CHECK constraint in place. SQLite cannot: the table is copied into a new one, written out
here as revision 0007 left it (reflection would drop the CHECK constraint; AUTOINCREMENT kept, as 0003 set it),
with foreign keys off during the copy (migrations/env.py) and AUTOINCREMENT's counter carried over. Downgrading is
refused while a hub model is stored.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
OLD_KINDS = ("folder", "archive", "gguf", "demo")
NEW_KINDS = (*OLD_KINDS, "hub")


def _check(kinds: tuple[str, ...]) -> str:
    return "source_kind IN (" + ", ".join(f"'{k}'" for k in kinds) + ")"


def _models_at_0007(kinds: tuple[str, ...]) -> sa.Table:
    """The models table as revision 0007 left it, with ``kinds`` allowed."""
    md = sa.MetaData(naming_convention=NAMING)
    sa.Table("users", md, sa.Column("id", sa.Integer(), primary_key=True))
    return sa.Table(
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
        sa.Column("overview", sa.JSON(), nullable=True),
        sa.CheckConstraint(_check(kinds), name="source_kind"),
        sa.UniqueConstraint("name"),
        sa.UniqueConstraint("sha256"),
    )


def _allow(kinds: tuple[str, ...]) -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        # the copy starts AUTOINCREMENT's counter at the largest id left: keep the old one, so the id of a model
        # removed before this revision is still never given to another
        seq = bind.execute(sa.text("SELECT seq FROM sqlite_sequence WHERE name = 'models'")).scalar()
        with op.batch_alter_table("models", recreate="always", copy_from=_models_at_0007(kinds),
                                  table_kwargs={"sqlite_autoincrement": True}):
            pass
        if seq is not None:
            bind.execute(sa.text("DELETE FROM sqlite_sequence WHERE name = 'models'"))
            bind.execute(sa.text("INSERT INTO sqlite_sequence (name, seq) VALUES ('models', :seq)"), {"seq": seq})
        return
    op.drop_constraint(op.f("ck_models_source_kind"), "models", type_="check")
    op.create_check_constraint(op.f("ck_models_source_kind"), "models", _check(kinds))


def upgrade() -> None:
    _allow(NEW_KINDS)


def downgrade() -> None:
    hub = op.get_bind().execute(sa.text("SELECT count(*) FROM models WHERE source_kind = 'hub'")).scalar()
    if hub:
        raise RuntimeError(f"{hub} model(s) registered by hub id are stored; revision 0007 cannot hold them: "
                           "remove them (quantplan models remove) before downgrading")
    _allow(OLD_KINDS)
