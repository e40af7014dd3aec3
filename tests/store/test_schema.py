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
    from pathlib import Path

    from store.settings import get_settings

    s = get_settings()
    s.ensure_dirs()
    sqlite = Path(s.sqlalchemy_url.split("///", 1)[-1])
    with pytest.raises(db.SchemaOutdated, match=r"no database at .*Run `quantplan migrate` to create it"):
        db.check_schema_current(s)
    assert not sqlite.exists()  # a check creates none
    sqlite.touch()  # an empty database
    with pytest.raises(db.SchemaOutdated, match="an empty database.*quantplan migrate"):
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


def _tiny_model(s, name: str):
    from tests.factories import stored_model

    return stored_model(s, name)


def _model_row_at_0002(s, name: str) -> int:
    """A model row written with the columns of revision 0002 (the ORM's model is always the newest one's)."""
    s.execute(text(
        "INSERT INTO models (name, sha256, source_kind, source_name, path, architecture, model_type, num_layers, "
        "num_params, dtype, total_bytes, summary, created_at) VALUES (:n, :sha, 'folder', :n, :p, 'LlamaForCausalLM',"
        " 'llama', 2, 1000, 'float32', 4000, '{}', CURRENT_TIMESTAMP)"), {"n": name, "sha": name * 4, "p": f"m/{name}"})
    return int(s.execute(text("SELECT id FROM models WHERE name = :n"), {"n": name}).scalar_one())


def _removed_ids_are_not_given_again(settings) -> None:
    from store import repo

    with db.session_scope(settings) as s:
        keep = _tiny_model(s, "keep")
        newest = _tiny_model(s, "newest")
        repo.save_plan(s, model_id=keep.id, name="p", body={"default": "FP8"}, user=None)
        plan = repo.save_plan(s, model_id=newest.id, name="p", body={"default": "FP8"}, user=None)
    with db.session_scope(settings) as s:
        repo.delete_model(s, newest.id)  # the newest model, and with it the newest plan
    with db.session_scope(settings) as s:
        again = _tiny_model(s, "again")
        plan_again = repo.save_plan(s, model_id=again.id, name="p", body={"default": "FP8"}, user=None)
    assert again.id > newest.id and plan_again.id > plan.id


def test_a_removed_model_or_plan_id_is_never_given_to_another(qp_settings):
    """A link to model N (or `plan show N`) never silently names a later model once N is removed."""
    _removed_ids_are_not_given_again(qp_settings)


def test_a_removed_id_is_never_given_again_on_postgres(qp_env, pg_database, monkeypatch):
    from tests.conftest import clear_settings_cache

    monkeypatch.setenv("QUANTPLAN_DATABASE_URL", pg_database)
    clear_settings_cache()
    from store.settings import get_settings

    s = get_settings()
    db.upgrade(s)
    with db.session_scope(s) as session:  # the session database is shared by the tests: start from no models
        for (model_id,) in session.execute(text("SELECT id FROM models")):
            from store import repo

            repo.delete_model(session, model_id)
    _removed_ids_are_not_given_again(s)


def test_upgrading_sqlite_to_0003_copies_the_tables_and_loses_no_row(qp_env):
    """0003 rebuilds `models` and `plans` (SQLite adds AUTOINCREMENT only to a new table): every row, and
    every row that refers to them, is still there, and the CHECK constraint still holds."""
    from store import repo
    from store.settings import get_settings

    s = get_settings()
    s.ensure_dirs()
    db.upgrade(s, "0002")
    with db.session_scope(s) as session:
        mod_id = _model_row_at_0002(session, "old")
        v1 = repo.save_plan(session, model_id=mod_id, name="p", body={"default": "FP8"}, user="ann")
        v2 = repo.save_plan(session, model_id=mod_id, name="p", body={"default": "BF16"}, user="ann")
        job = repo.create_job(session, kind="score", params={"x": 1}, queue="cpu", user="ann", model_id=mod_id,
                              plan_id=v2.id)
    counts = "SELECT (SELECT count(*) FROM models), (SELECT count(*) FROM plans), (SELECT count(*) FROM jobs)"
    with db.make_engine(s.sqlalchemy_url).connect() as conn:
        before = conn.execute(text(counts)).one()
        assert "AUTOINCREMENT" not in conn.execute(text("SELECT sql FROM sqlite_master WHERE name='models'")).scalar()
    db.upgrade(s)
    db.check_schema_current(s)
    assert _diff(s) == []
    with db.make_engine(s.sqlalchemy_url).connect() as conn:
        assert conn.execute(text(counts)).one() == before == (1, 2, 1)
        for table in ("models", "plans"):
            sql = conn.execute(text(f"SELECT sql FROM sqlite_master WHERE name='{table}'")).scalar()
            assert "AUTOINCREMENT" in sql
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1  # back on for every new connection
        assert conn.execute(text("PRAGMA foreign_key_check")).fetchall() == []
    with db.session_scope(s) as session:
        assert repo.get_job(session, job.id).plan_id == v2.id
        assert sorted(p.id for p in repo.list_plans(session, mod_id)) == [v1.id, v2.id]
        assert repo.get_plan(session, v2.id).parent_id == v1.id
    with pytest.raises(db.StoreError, match="refused"):
        with db.session_scope(s) as session:
            session.execute(text("UPDATE models SET source_kind = 'pickle'"))
    _removed_ids_are_not_given_again(s)
    from alembic import command

    command.downgrade(db.alembic_config(s), "0002")  # and back: the tables are copied again, without AUTOINCREMENT
    with db.make_engine(s.sqlalchemy_url).connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM plans")).scalar() == 4
        assert "AUTOINCREMENT" not in conn.execute(text("SELECT sql FROM sqlite_master WHERE name='plans'")).scalar()


def test_upgrading_to_0004_marks_the_kernel_timings_taken_with_cold_caches(qp_env):
    """CUDA timings were always taken with the L2 flushed: 0004 marks them with the TIMING of that time (the current
    one, which a benchmark reuses); CPU ones (caches left warm) stay unmarked and are measured again."""
    from quantcore.kernels.records import TIMING
    from store import repo
    from store.settings import get_settings

    s = get_settings()
    s.ensure_dirs()
    db.upgrade(s, "0003")
    with db.session_scope(s) as session:
        job = repo.create_job(session, kind="bench", params={}, queue="cpu", user="ann")
    with db.make_engine(s.sqlalchemy_url).begin() as conn:
        for device in ("cuda", "cpu"):
            conn.execute(text(
                "INSERT INTO kernel_results (job_id, device, device_name, torch_version, m, n, k, path, ms, native, "
                "created_at) VALUES (:job, :device, :name, '2.13.0', 1, 64, 64, 'baseline', 0.5, true, "
                "CURRENT_TIMESTAMP)"), {"job": job.id, "device": device, "name": f"a {device}"})
    db.upgrade(s)
    with db.session_scope(s) as session:
        assert [(r.device, r.timing) for r in repo.kernel_results(session, job_id=job.id)] == [
            ("cuda", "cold-caches-1"), ("cpu", None)]
    assert TIMING == "cold-caches-1"  # a new TIMING leaves these rows as 0004 wrote them: measured again


def test_the_sqlite_file_of_a_url_is_the_path_as_written() -> None:
    """A home folder with ':' or '#' is percent-escaped in the URL: the check looks for the file itself."""
    from pathlib import Path

    assert db.sqlite_file("sqlite:////tmp/a%3Ab/q.sqlite") == Path("/tmp/a:b/q.sqlite")
    assert db.sqlite_file("sqlite:///x.db?timeout=5") == Path("x.db")
    for none in ("sqlite://", "sqlite:///:memory:", "sqlite:///file:x.db?uri=true", "postgresql://u@127.0.0.1/test"):
        assert db.sqlite_file(none) is None, none


def test_a_home_with_odd_characters_migrates_and_passes_the_check(tmp_path):
    from store.settings import Settings

    home = tmp_path / "team:a#1"
    s = Settings(home=home)
    assert "%3A" in s.sqlalchemy_url
    with pytest.raises(db.SchemaOutdated, match="no database at"):
        db.check_schema_current(s)
    db.upgrade(s)
    db.check_schema_current(s)
    assert (home / "quantplan.sqlite").exists() and not any("%" in p.name for p in tmp_path.iterdir())
