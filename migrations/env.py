"""Alembic environment on store.models.Base.metadata.

The URL comes from quantplan's settings (QUANTPLAN_DATABASE_URL), passed in by
store.db.alembic_config(); render_as_batch lets SQLite ALTER tables.
"""

from alembic import context
from sqlalchemy import pool

from store.db import make_engine
from store.models import Base
from store.settings import get_settings

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return config.attributes.get("sqlalchemy_url") or get_settings().sqlalchemy_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=True, compare_type=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
