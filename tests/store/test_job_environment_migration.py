"""Migration 0013 (``jobs.environment``, the software a job ran with; issue 44), up and down on SQLite and
PostgreSQL, on a database that holds the previous version's data: its jobs stay, "not recorded"; a job started
after it keeps its software; a downgrade drops the column and loses nothing else."""

from __future__ import annotations

import pytest
import sqlalchemy
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import text

from store import db


def _before(s) -> str:
    """The revision 0013 follows (read from the chain)."""
    return str(ScriptDirectory.from_config(db.alembic_config(s)).get_revision("0013").down_revision)


def _check_up_and_down(s, prefix: str) -> None:
    from store import history, repo

    previous = _before(s)
    command.downgrade(db.alembic_config(s), previous)
    with db.session_scope(s) as session:  # the previous version's data: a job that ran, as it wrote it
        old = repo.create_job(session, kind="bench", params={"device": "cpu"}, queue="cpu", user=f"{prefix}old")
        repo.mark_running(session, old.id, worker_host="h", device="cpu", torch_version="2.0")
        repo.finish_job(session, old.id, status="succeeded", result={"measured": 1})
    db.upgrade(s)
    db.check_schema_current(s)
    with db.session_scope(s) as session:
        assert history.job_environment(session, old.id) is None  # not recorded
        assert repo.get_job(session, old.id).result == {"measured": 1}
        new = repo.create_job(session, kind="bench", params={}, queue="cpu", user=f"{prefix}new")
        history.record_environment(session, new.id, {"quantplan": "0.1.0", "torch": "2.9.0", "cuda": None})
    with db.session_scope(s) as session:
        assert history.job_environment(session, new.id) == {"quantplan": "0.1.0", "torch": "2.9.0", "cuda": None}
    command.downgrade(db.alembic_config(s), previous)
    with db.make_engine(s.sqlalchemy_url).connect() as conn:
        with pytest.raises(sqlalchemy.exc.DBAPIError):
            conn.execute(text("SELECT environment FROM jobs"))
        conn.rollback()
        kept = conn.execute(text("SELECT id, status, requested_by FROM jobs WHERE id IN (:a, :b) ORDER BY id"),
                            {"a": old.id, "b": new.id}).all()
        assert [(r[0], r[1]) for r in kept] == [(old.id, "succeeded"), (new.id, "queued")]
        # the constraints of jobs stay (dropped in place, not by a copy of the table)
        with pytest.raises(sqlalchemy.exc.IntegrityError):
            conn.execute(text("UPDATE jobs SET status = 'lost' WHERE id = :a"), {"a": old.id})
        conn.rollback()
    db.upgrade(s)
    db.check_schema_current(s)
    with db.session_scope(s) as session:
        assert history.job_environment(session, new.id) is None  # the downgrade dropped what it held
        assert repo.get_job(session, old.id).requested_by == f"{prefix}old"


def test_0013_up_and_down_on_sqlite_with_the_previous_versions_data(qp_env):
    from store.settings import get_settings

    s = get_settings()
    s.ensure_dirs()
    db.upgrade(s, _before(s))
    _check_up_and_down(s, "")


def test_0013_up_and_down_on_postgres(qp_env, pg_database, monkeypatch):
    from tests.conftest import clear_settings_cache

    monkeypatch.setenv("QUANTPLAN_DATABASE_URL", pg_database)
    clear_settings_cache()
    from store.settings import get_settings

    s = get_settings()
    db.upgrade(s)  # the session's database is shared: only our rows, and the schema at head after
    try:
        _check_up_and_down(s, "pg-0013-")
    finally:
        db.upgrade(s)
    db.check_schema_current(s)
