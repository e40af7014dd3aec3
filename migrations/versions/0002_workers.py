"""workers: which queues each worker consumes, on which device, when it last reported

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('workers',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('host', sa.String(length=200), nullable=False),
    sa.Column('queues', sa.String(length=500), nullable=False),
    sa.Column('device', sa.String(length=200), nullable=False),
    sa.Column('device_name', sa.String(length=200), nullable=False),
    sa.Column('device_class', sa.String(length=50), nullable=False),
    sa.Column('torch_version', sa.String(length=50), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('seen_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_workers')),
    sa.UniqueConstraint('name', name=op.f('uq_workers_name'))
    )


def downgrade() -> None:
    op.drop_table('workers')
