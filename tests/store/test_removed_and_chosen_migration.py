"""Migration 0012 (removed models keep their history, one chosen plan version per model; issue 44), up and down on
SQLite and PostgreSQL, on a database that holds the previous version's data: its models come up live with their
plans, a downgrade is refused while a model is marked removed and otherwise loses nothing but the marks and choices;
on SQLite the models table keeps its CHECK constraint and AUTOINCREMENT through the round trip."""

from __future__ import annotations

import pytest
import sqlalchemy
from alembic import command
from sqlalchemy import text

from store import chosen, db, removal, repo
from tests.factories import stored_model


def _models_sql(s) -> str:
    with db.make_engine(s.sqlalchemy_url).connect() as conn:
        return str(conn.execute(text("SELECT sql FROM sqlite_master WHERE name = 'models'")).scalar())


def _check_up_and_down(s, prefix: str) -> None:
    with db.session_scope(s) as session:  # written at head, then taken down to 0011 with the rest of the schema
        model = stored_model(session, f"{prefix}kept")
        plan = repo.save_plan(session, model_id=model.id, name=f"{prefix}p", body={"default": "FP8"}, user="ann")
        job = repo.create_job(session, kind="score", params={}, queue="cpu", user="ann", model_id=model.id,
                              plan_id=plan.id)
    command.downgrade(db.alembic_config(s), "0011")
    with db.make_engine(s.sqlalchemy_url).connect() as conn:
        with pytest.raises(sqlalchemy.exc.DBAPIError):
            conn.execute(text("SELECT removed_at FROM models"))
        conn.rollback()
        assert conn.execute(text("SELECT name FROM models WHERE id = :i"), {"i": model.id}).scalar() == f"{prefix}kept"
    db.upgrade(s)
    db.check_schema_current(s)
    with db.session_scope(s) as session:
        back = repo.get_model(session, model.id)
        assert back.removed_at is None and back.removed_by is None and not back.removed
        assert model.id in {m.id for m in repo.list_models(session)}  # a model from before 0012 is live
        assert repo.get_job(session, job.id).plan_id == plan.id and chosen.chosen_for_model(session, model.id) is None
        _, choice = chosen.choose(session, plan_id=plan.id, by="ann", why="lowest KL at 8 bits")
        assert (choice.label, choice.chosen_by, choice.why) == (f"{prefix}p v1", "ann", "lowest KL at 8 bits")
        removal.mark_removed(session, model.id, "ann")
    with pytest.raises(RuntimeError, match=rf"model\(s\) are marked removed \(.*{prefix}kept.*purge them"):
        command.downgrade(db.alembic_config(s), "0011")
    with db.session_scope(s) as session:  # refused: nothing changed
        assert repo.get_model(session, model.id).removed_by == "ann"
        assert chosen.chosen_for_model(session, model.id) is not None
        revived = repo.add_model(session, name="other-name", sha256=model.sha256, source_kind="folder",
                                 source_name="again", path=model.path, summary={}, user="bob")
        assert revived.id == model.id and not revived.removed  # the same content again: back, with its results
    command.downgrade(db.alembic_config(s), "0011")
    with db.make_engine(s.sqlalchemy_url).connect() as conn:
        with pytest.raises(sqlalchemy.exc.DBAPIError):
            conn.execute(text("SELECT count(*) FROM chosen_plans"))
        conn.rollback()
        assert conn.execute(text("SELECT count(*) FROM plans WHERE id = :i"), {"i": plan.id}).scalar() == 1
        assert conn.execute(text("SELECT plan_id FROM jobs WHERE id = :i"), {"i": job.id}).scalar() == plan.id
    db.upgrade(s)
    db.check_schema_current(s)
    with db.session_scope(s) as session:
        assert repo.get_model(session, model.id).name == f"{prefix}kept"
        assert chosen.chosen_for_model(session, model.id) is None  # the choices went with the downgrade


def test_0012_up_and_down_on_sqlite_keeps_the_models_tables_constraints(qp_env):
    from store.settings import get_settings

    s = get_settings()
    s.ensure_dirs()
    db.upgrade(s)
    before = _models_sql(s)
    assert "AUTOINCREMENT" in before and "ck_models_source_kind" in before
    _check_up_and_down(s, "")
    after = _models_sql(s)
    assert "AUTOINCREMENT" in after and "ck_models_source_kind" in after and "removed_at" in after


def test_0012_up_and_down_on_postgres(qp_env, pg_database, monkeypatch):
    from tests.conftest import clear_settings_cache

    monkeypatch.setenv("QUANTPLAN_DATABASE_URL", pg_database)
    clear_settings_cache()
    from store.settings import get_settings

    s = get_settings()
    db.upgrade(s)  # the session's database is shared: only our rows, and the schema at head after
    try:
        _check_up_and_down(s, "pg-0012-")
    finally:
        db.upgrade(s)
    db.check_schema_current(s)
