"""Alembic environment on store.models.Base.metadata.

The URL comes from quantplan's settings (QUANTPLAN_DATABASE_URL), passed in by
store.db.alembic_config(); render_as_batch lets SQLite ALTER tables (with foreign keys off
while it copies them).
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
        sqlite = connection.dialect.name == "sqlite"
        if sqlite:
            # A SQLite ALTER is a copy of the table into a new one and a DROP of the old: with foreign keys
            # on, that DROP would cascade into the rows that reference it. The pragma only takes effect
            # outside a transaction, so it is set (and the autobegun transaction ended) before the migration's.
            connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
            connection.commit()
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=True, compare_type=True)
        with context.begin_transaction():
            context.run_migrations()
            if sqlite:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if broken:  # fail loudly rather than leave broken references unnoticed
                    raise RuntimeError(f"migration left rows whose references are broken: {broken[:5]}")


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
