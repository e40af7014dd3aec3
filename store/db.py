"""Engine, session scope, and the schema-is-current check.

The schema is created and changed only by Alembic (``quantplan migrate``). Every
entry point calls :func:`check_schema_current` and refuses to run on an outdated
database, with a message naming the command that fixes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from store.settings import Settings, get_settings

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


class StoreError(Exception):
    """A database problem, said in words a person can act on."""


class SchemaOutdated(StoreError):
    pass


def sqlite_file(url: str) -> Path | None:
    """The file of an SQLite URL (its path as written, percent-escapes undone); None for another database, an
    in-memory one, or a URI-style one (``?uri=true``) whose file SQLite resolves itself."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:") or u.query.get("uri"):
        return None
    return Path(u.database)


def make_engine(url: str, **kwargs) -> Engine:
    if url.startswith("sqlite"):
        if (path := sqlite_file(url)) is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # noqa: ANN001
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            # WAL: the app reads while a worker writes results, without 'database is locked'
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, **kwargs)


@lru_cache(maxsize=8)
def _engine_for(url: str) -> Engine:
    return make_engine(url)


def get_engine(settings: Settings | None = None) -> Engine:
    settings = settings or get_settings()
    return _engine_for(settings.sqlalchemy_url)


@lru_cache(maxsize=8)
def _factory_for(url: str) -> sessionmaker[Session]:
    return sessionmaker(bind=_engine_for(url), expire_on_commit=False)


@contextmanager
def session_scope(settings: Settings | None = None) -> Iterator[Session]:
    """A session that commits on success, rolls back on error, and turns driver errors into StoreError."""
    settings = settings or get_settings()
    session = _factory_for(settings.sqlalchemy_url)()
    try:
        yield session
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise StoreError(f"the database refused the change: {exc.orig}") from exc
    except DBAPIError as exc:
        session.rollback()
        raise StoreError(f"database error: {exc.orig}") from exc
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def alembic_config(settings: Settings | None = None):
    from alembic.config import Config

    settings = settings or get_settings()
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["sqlalchemy_url"] = settings.sqlalchemy_url
    return cfg


def upgrade(settings: Settings | None = None, revision: str = "head") -> None:
    """Apply migrations (``quantplan migrate``)."""
    from alembic import command

    settings = settings or get_settings()
    settings.ensure_dirs()
    command.upgrade(alembic_config(settings), revision)


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None  # migrations/ has a head revision
    return head


def current_revision(settings: Settings | None = None) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with get_engine(settings).connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def check_schema_current(settings: Settings | None = None) -> None:
    """Raise SchemaOutdated unless the database is at the newest migration."""
    settings = settings or get_settings()
    path = sqlite_file(settings.sqlalchemy_url)
    if path is not None and not path.exists():  # a check creates no database (nor its folder)
        raise SchemaOutdated(
            f"no database at {path}. Run `quantplan migrate` to create it, or set QUANTPLAN_HOME (or "
            "QUANTPLAN_DATABASE_URL) to where the product's data is."
        )
    try:
        current = current_revision(settings)
    except DBAPIError as exc:
        raise StoreError(
            f"cannot open the database at {settings.database_url!r}: {exc.orig}. "
            "Check QUANTPLAN_DATABASE_URL."
        ) from exc
    head = head_revision()
    if current != head:
        where = "an empty database" if current is None else f"revision {current}"
        raise SchemaOutdated(
            f"the database schema is out of date ({where}, newest is {head}). "
            "Run `quantplan migrate` to upgrade it."
        )
