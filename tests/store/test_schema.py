"""The schema comes from Alembic only, and the models agree with the migrations on both databases."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from store import db
from store.models import Base


def _diff(settings) -> list:
    with db.make_engine(settings.sqlalchemy_url).connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return compare_metadata(ctx, Base.metadata)


def test_migrations_match_models_sqlite(qp_settings):
    assert _diff(qp_settings) == []


def test_migrations_match_models_postgres(qp_env, pg_database, monkeypatch):
    from tests.conftest import clear_settings_cache

    monkeypatch.setenv("QUANTPLAN_DATABASE_URL", pg_database)
    clear_settings_cache()
    from store.settings import get_settings

    s = get_settings()
    db.upgrade(s)
    db.check_schema_current(s)
    assert _diff(s) == []


def test_outdated_schema_is_refused_with_the_fixing_command(qp_env):
    from store.settings import get_settings

    s = get_settings()
    s.ensure_dirs()
    with pytest.raises(db.SchemaOutdated, match="quantplan migrate"):
        db.check_schema_current(s)
    db.upgrade(s, "0001")
    with pytest.raises(db.SchemaOutdated, match="quantplan migrate"):  # 0002 (workers) is missing
        db.check_schema_current(s)
    db.upgrade(s)
    db.check_schema_current(s)


def test_status_check_constraint_rejects_unknown_status(qp_settings):
    from store import repo

    with db.session_scope(qp_settings) as s:
        job = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="u")
    with pytest.raises(db.StoreError, match="refused"):
        with db.session_scope(qp_settings) as s:
            s.execute(text("UPDATE jobs SET status = 'exploded' WHERE id = :id"), {"id": job.id})
