"""Migration 0010 (a sweep may be a Fisher estimate): old sweeps keep their top-1 agreement, an estimate stores none,
and a downgrade that would lose such rows is refused (issue 43)."""

from __future__ import annotations

import pytest
from alembic import command
from sqlalchemy import text

from store import db


def test_0010_lets_a_sweep_store_no_top1_and_refuses_a_downgrade_that_would_lose_it(qp_env):
    from store import repo
    from store.settings import get_settings
    from tests.factories import stored_model

    s = get_settings()
    s.ensure_dirs()
    db.upgrade(s)  # the rows written by today's code, then the schema taken down to 0009 under them
    with db.session_scope(s) as session:
        mod = stored_model(session, "old")
        old = repo.create_job(session, kind="sensitivity", params={}, queue="cpu", user="ann", model_id=mod.id)
        fast = repo.create_job(session, kind="sensitivity", params={"method": "fisher"}, queue="cpu", user="ann",
                               model_id=mod.id)
    command.downgrade(db.alembic_config(s), "0009")
    with db.make_engine(s.sqlalchemy_url).begin() as conn:
        conn.execute(text(
            "INSERT INTO sensitivity_results (job_id, model_id, scheme, unit, layers, kl_mean, top1_agree) "
            "VALUES (:job, :model, 'FP8', 'lm_head', '[\"lm_head\"]', 0.01, 0.99)"), {"job": old.id, "model": mod.id})
    db.upgrade(s)
    db.check_schema_current(s)
    with db.session_scope(s) as session:
        repo.save_sensitivity(session, job_id=fast.id, model_id=mod.id, scheme="FP8",
                              rows=[{"layer": "lm_head", "kl_mean": 0.012, "top1_agree": None, "sqnr_db": 30.0}])
    with db.session_scope(s) as session:
        [kept] = repo.list_sensitivity(session, old.id)
        [estimated] = repo.list_sensitivity(session, fast.id)
        assert kept.top1_agree == 0.99 and estimated.top1_agree is None and estimated.kl_mean == 0.012
    with pytest.raises(RuntimeError, match="1 sensitivity row"):
        command.downgrade(db.alembic_config(s), "0009")
    with db.session_scope(s) as session:  # nothing was lost
        assert len(repo.list_sensitivity(session, fast.id)) == 1
        session.execute(text("DELETE FROM sensitivity_results WHERE job_id = :job"), {"job": fast.id})
    command.downgrade(db.alembic_config(s), "0009")
    with db.make_engine(s.sqlalchemy_url).begin() as conn:
        with pytest.raises(Exception, match="(?i)not null"):
            conn.execute(text(
                "INSERT INTO sensitivity_results (job_id, model_id, scheme, unit, layers, kl_mean, top1_agree) "
                "VALUES (:job, :model, 'FP8', 'x', '[\"x\"]', 0.01, NULL)"), {"job": old.id, "model": mod.id})
