"""A team's access: roles on users, the audit log

``users`` gains ``role`` (viewer / member / admin, checked by the application layer; NULL for a name that was only
ever recorded as who asked and never signed in) and ``last_seen_at``; the new ``audit`` table keeps who did what
destructive or access-changing action when (model removals, cache clears, server-path registrations, role changes),
naming its actor and target in words that outlive the rows they name; the new ``notes`` table keeps free text and
tags a person wrote on a job, a plan version or a model (by kind and id: a note outlives its target). Downgrading
drops them; the audit's rows, the notes and the roles go with them (the users' names stay).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("users") as batch:
        batch.add_column(sa.Column("role", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "audit",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("action", sa.String(length=40), nullable=False),
        sa.Column("target", sa.String(length=500), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit")),
    )
    op.create_index(op.f("ix_audit_at"), "audit", ["at"], unique=False)
    op.create_table(
        "notes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("author", sa.String(length=200), nullable=False),
        sa.Column("target_kind", sa.String(length=10), nullable=False),
        sa.Column("target_id", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.CheckConstraint("target_kind IN ('job', 'plan', 'model')", name=op.f("ck_notes_target_kind")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notes")),
    )
    op.create_index("ix_notes_target", "notes", ["target_kind", "target_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_notes_target", table_name="notes")
    op.drop_table("notes")
    op.drop_index(op.f("ix_audit_at"), table_name="audit")
    op.drop_table("audit")
    with op.batch_alter_table("users") as batch:
        batch.drop_column("last_seen_at")
        batch.drop_column("role")
