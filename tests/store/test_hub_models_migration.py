"""Migration 0008 (models registered by hub id): source_kind 'hub' is allowed after it, refused before it, the
models kept across the SQLite table copy (ids never reused still), and a downgrade refused while a hub model is
stored."""

from __future__ import annotations

import pytest
import sqlalchemy.exc
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import text

from store import db

INSERT = ("INSERT INTO models (name, sha256, source_kind, source_name, path, architecture, model_type, num_layers, "
          "num_params, dtype, total_bytes, summary, created_at) VALUES (:name, :sha, :kind, :src, 'models/x', "
          "'LlamaForCausalLM', 'llama', 2, 1000, 'float32', 4000, '{}', CURRENT_TIMESTAMP)")


def _insert(s, name: str, kind: str, sha: str) -> None:
    with db.make_engine(s.sqlalchemy_url).begin() as conn:
        conn.execute(text(INSERT), {"name": name, "sha": sha, "kind": kind, "src": f"hf://org/{name}@" + "a" * 40})


def test_0008_allows_hub_models_keeps_the_rest_and_refuses_a_lossy_downgrade(qp_env):
    from store.settings import get_settings

    s = get_settings()
    s.ensure_dirs()
    before = ScriptDirectory.from_config(db.alembic_config(s)).get_revision("0008").down_revision
    assert before == "0007"
    db.upgrade(s, str(before))
    _insert(s, "old", "folder", "1" * 64)
    with pytest.raises(sqlalchemy.exc.IntegrityError):  # 0007 knows no hub models
        _insert(s, "early", "hub", "2" * 64)
    db.upgrade(s)
    db.check_schema_current(s)
    _insert(s, "from-hub", "hub", "3" * 64)
    with pytest.raises(sqlalchemy.exc.IntegrityError):  # the constraint is still there, with hub added
        _insert(s, "odd", "ftp", "4" * 64)
    with db.make_engine(s.sqlalchemy_url).connect() as conn:
        rows = conn.execute(text("SELECT id, name, source_kind FROM models ORDER BY id")).all()
    assert [(r.name, r.source_kind) for r in rows] == [("old", "folder"), ("from-hub", "hub")]
    with pytest.raises(RuntimeError, match="registered by hub id"):
        command.downgrade(db.alembic_config(s), str(before))
    with db.make_engine(s.sqlalchemy_url).begin() as conn:
        conn.execute(text("DELETE FROM models WHERE source_kind = 'hub'"))
    command.downgrade(db.alembic_config(s), str(before))
    with pytest.raises(sqlalchemy.exc.IntegrityError):
        _insert(s, "again", "hub", "5" * 64)
    _insert(s, "after", "folder", "6" * 64)
    with db.make_engine(s.sqlalchemy_url).connect() as conn:
        ids = dict(conn.execute(text("SELECT name, id FROM models")).all())
    assert ids["after"] > rows[-1].id  # AUTOINCREMENT survived both copies: the removed hub model's id is not reused


def test_0008_on_postgres_changes_the_constraint_in_place_both_ways(qp_env, pg_database, monkeypatch):
    from tests.conftest import clear_settings_cache

    monkeypatch.setenv("QUANTPLAN_DATABASE_URL", pg_database)
    clear_settings_cache()
    from store.settings import get_settings

    s = get_settings()
    db.upgrade(s)
    with db.make_engine(s.sqlalchemy_url).begin() as conn:  # the session database is shared: only our rows go
        conn.execute(text("DELETE FROM models WHERE name IN ('pg-hub', 'pg-odd', 'pg-again')"))
    try:
        _insert(s, "pg-hub", "hub", "7" * 64)
        with pytest.raises(sqlalchemy.exc.IntegrityError):
            _insert(s, "pg-odd", "ftp", "8" * 64)
        with pytest.raises(RuntimeError, match="registered by hub id"):
            command.downgrade(db.alembic_config(s), "0007")
        with db.make_engine(s.sqlalchemy_url).begin() as conn:
            conn.execute(text("DELETE FROM models WHERE source_kind = 'hub'"))
        command.downgrade(db.alembic_config(s), "0007")
        with pytest.raises(sqlalchemy.exc.IntegrityError):
            _insert(s, "pg-again", "hub", "9" * 64)
    finally:
        db.upgrade(s)
        with db.make_engine(s.sqlalchemy_url).begin() as conn:
            conn.execute(text("DELETE FROM models WHERE name IN ('pg-hub', 'pg-odd', 'pg-again')"))
    db.check_schema_current(s)
