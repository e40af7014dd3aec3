"""Migration 0007 (scores keep their uncertainty): old scores and sweeps gain NULL figures, read back as None."""

from __future__ import annotations

from alembic.script import ScriptDirectory
from sqlalchemy import text

from store import db


def test_upgrading_to_0007_keeps_old_scores_with_no_error(qp_env):
    from store import repo
    from store.settings import get_settings
    from tests.factories import stored_model

    s = get_settings()
    s.ensure_dirs()
    before = ScriptDirectory.from_config(db.alembic_config(s)).get_revision("0007").down_revision
    db.upgrade(s)  # the rows written by today's code, then the schema taken down to 0006 under them
    with db.session_scope(s) as session:
        mod = stored_model(session, "old")
        job = repo.create_job(session, kind="score", params={}, queue="cpu", user="ann", model_id=mod.id)
        sweep = repo.create_job(session, kind="sensitivity", params={}, queue="cpu", user="ann", model_id=mod.id)
    from alembic import command

    command.downgrade(db.alembic_config(s), str(before))
    with db.make_engine(s.sqlalchemy_url).begin() as conn:
        conn.execute(text(
            "INSERT INTO score_results (job_id, model_id, plan_label, plan_body, dataset, tokens, kl_mean, kl_p50, "
            "kl_p90, kl_p99, kl_max, top1_agree, ppl_ref, ppl, details, created_at) VALUES (:job, :model, 'FP8', "
            "'{}', 'builtin:lee.cor', 508, 0.0367, 0.01, 0.05, 0.3, 2.0, 0.96, 10.0, 10.4, '{}', CURRENT_TIMESTAMP)"),
            {"job": job.id, "model": mod.id})
        conn.execute(text(
            "INSERT INTO sensitivity_results (job_id, model_id, scheme, unit, layers, kl_mean, top1_agree) "
            "VALUES (:job, :model, 'FP8', 'lm_head', '[\"lm_head\"]', 0.01, 0.99)"), {"job": sweep.id, "model": mod.id})
    db.upgrade(s)
    db.check_schema_current(s)
    with db.session_scope(s) as session:
        old = repo.get_score(session, job.id)
        assert old.kl_mean == 0.0367
        assert old.kl_mean_err is None and old.ln_ppl_ratio is None and old.dp_mean is None
        assert old.figure("kl_p999") is None and old.figure("kl_by_sequence") is None
        assert all(v is None for v in old.statistics().values())
        [row] = repo.list_sensitivity(session, sweep.id)
        assert row.kl_mean == 0.01 and row.kl_mean_err is None
        # a new score stores its figures: the columns and the rest in details
        new = repo.create_job(session, kind="score", params={}, queue="cpu", user="ann", model_id=mod.id)
        report = {"tokens": 508, "kl_mean": 0.0414, "kl_p50": 0.01, "kl_p90": 0.05, "kl_p99": 0.3, "kl_max": 2.0,
                  "top1_agree": 0.95, "ppl_ref": 10.0, "ppl": 10.5, "kl_mean_err": 0.002, "top1_agree_err": 0.01,
                  "ln_ppl_ratio": 0.048, "ln_ppl_ratio_err": 0.004, "dp_mean": None, "kl_p999": 1.5,
                  "kl_by_sequence": [0.04, 0.0428]}
        repo.save_score(session, job_id=new.id, model_id=mod.id, plan_id=None, plan_label="FP8 v2", plan_body={},
                        dataset="builtin:lee.cor", report=report)
    with db.session_scope(s) as session:
        got = repo.get_score(session, new.id)
        assert (got.kl_mean_err, got.top1_agree_err, got.ln_ppl_ratio, got.ln_ppl_ratio_err) == (
            0.002, 0.01, 0.048, 0.004)
        assert got.figure("kl_p999") == 1.5 and got.figure("kl_by_sequence") == [0.04, 0.0428]
        assert "kl_mean_err" not in got.details  # a column, not a copy in the JSON
    from alembic import command

    command.downgrade(db.alembic_config(s), str(before))  # and back: the columns go, the rows stay
    with db.make_engine(s.sqlalchemy_url).connect() as conn:
        cols = [r[1] for r in conn.execute(text("PRAGMA table_info(score_results)"))]
        assert "kl_mean_err" not in cols and conn.execute(text("SELECT count(*) FROM score_results")).scalar() == 2
