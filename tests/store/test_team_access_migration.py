"""Migration 0011 (roles on users, the audit log; issue 44), up and down on SQLite and PostgreSQL, on a database
that holds the previous version's data: the people already named keep their names and what they asked, with no
role until they sign in; a downgrade drops roles and the audit log and loses nothing else."""

from __future__ import annotations

import pytest
import sqlalchemy
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import text

from store import db


def _before(s) -> str:
    """The revision 0011 follows (read from the chain, which others may extend below it)."""
    return str(ScriptDirectory.from_config(db.alembic_config(s)).get_revision("0011").down_revision)


def _check_up_and_down(s, prefix: str) -> None:
    from quantplan.services import access
    from quantplan.services import notes as notes_svc
    from store import repo

    previous = _before(s)
    command.downgrade(db.alembic_config(s), previous)  # a no-op on a fresh SQLite file already there
    with db.session_scope(s) as session:  # the previous version's data, written as it wrote it
        job = repo.create_job(session, kind="bench", params={}, queue="cpu", user=f"{prefix}old")
    db.upgrade(s)
    db.check_schema_current(s)
    with db.make_engine(s.sqlalchemy_url).connect() as conn:
        role = conn.execute(text("SELECT role FROM users WHERE name = :n"), {"n": f"{prefix}old"}).scalar_one()
    assert role is None  # only ever named as who asked: no role until they sign in
    with db.session_scope(s) as session:
        assert repo.get_job(session, job.id).requested_by == f"{prefix}old"
    with access.acting(access.operator()):
        access.audit("test", f"{prefix}target", {"n": 1})
        notes_svc.add_note("job", job.id, "written at 0011", ["kept"])
    signed = access.sign_in(f"{prefix}old")
    assert signed.role in ("admin", "viewer")  # admin where nobody was yet (a fresh database), else the default
    command.downgrade(db.alembic_config(s), previous)
    with db.make_engine(s.sqlalchemy_url).connect() as conn:
        with pytest.raises(sqlalchemy.exc.DBAPIError):
            conn.execute(text("SELECT role FROM users"))
        conn.rollback()
        for table in ("audit", "notes"):
            with pytest.raises(sqlalchemy.exc.DBAPIError):
                conn.execute(text(f"SELECT count(*) FROM {table}"))
            conn.rollback()
        assert conn.execute(text("SELECT count(*) FROM users WHERE name = :n"), {"n": f"{prefix}old"}).scalar() == 1
        assert conn.execute(text("SELECT count(*) FROM jobs WHERE id = :j"), {"j": job.id}).scalar() == 1
    db.upgrade(s)
    db.check_schema_current(s)
    with db.session_scope(s) as session:
        assert repo.get_job(session, job.id).requested_by == f"{prefix}old"


def test_0011_up_and_down_on_sqlite_with_the_previous_versions_data(qp_env):
    from store.settings import get_settings

    s = get_settings()
    s.ensure_dirs()
    db.upgrade(s, _before(s))
    _check_up_and_down(s, "")


def test_0011_up_and_down_on_postgres(qp_env, pg_database, monkeypatch):
    from tests.conftest import clear_settings_cache

    monkeypatch.setenv("QUANTPLAN_DATABASE_URL", pg_database)
    clear_settings_cache()
    from store.settings import get_settings

    s = get_settings()
    db.upgrade(s)  # the session's database is shared: only our rows, and the schema at head after
    try:
        _check_up_and_down(s, "pg-0011-")
    finally:
        db.upgrade(s)
    db.check_schema_current(s)
