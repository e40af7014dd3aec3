"""Migration 0006 (kernel timings keep their spread): old kernel rows gain NULL spreads, read back as None and not
flagged unstable; new rows keep theirs; and back down again."""

from __future__ import annotations

from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from store import db

SPREAD_COLUMNS = {"repeats", "ms_p20", "ms_p80", "baseline_ms", "baseline_ms_p20", "baseline_ms_p80", "unstable"}


def test_upgrading_to_0006_keeps_old_kernel_rows_with_no_spread(qp_env):
    from quantcore.kernels.records import KernelRecord, is_unstable, reusable_records
    from store import repo
    from store.settings import get_settings

    s = get_settings()
    s.ensure_dirs()
    before = ScriptDirectory.from_config(db.alembic_config(s)).get_revision("0006").down_revision
    assert before == "0005"
    db.upgrade(s, str(before))
    with db.session_scope(s) as session:
        job = repo.create_job(session, kind="bench", params={}, queue="cpu", user="ann")
    engine = db.make_engine(s.sqlalchemy_url)
    with engine.begin() as conn:
        assert not SPREAD_COLUMNS & {c["name"] for c in inspect(conn).get_columns("kernel_results")}
        conn.execute(text(
            "INSERT INTO kernel_results (job_id, device, device_name, torch_version, m, n, k, path, ms, speedup, "
            "native, timing, created_at) VALUES (:job, 'cpu', 'Old CPU', '2.13', 16, 64, 32, 'int8_row', 0.5, 2.0, "
            "1, 'cold-caches-1', CURRENT_TIMESTAMP)"), {"job": job.id})
    db.upgrade(s)
    db.check_schema_current(s)
    with db.session_scope(s) as session:
        [old] = repo.kernel_results(session, device_name="Old CPU")
        assert old.ms == 0.5 and old.speedup == 2.0
        assert all(getattr(old, c) is None for c in SPREAD_COLUMNS)  # "—" on the page, not flagged
        assert not KernelRecord.from_dict(old.__dict__).unstable and not is_unstable(old.ms, old.ms_p20, old.ms_p80)
        assert reusable_records([old]) == [old]  # an old time is no unstable one: it is reused
        new = repo.create_job(session, kind="bench", params={}, queue="cpu", user="ann")
        repo.save_kernel_results(session, job_id=new.id, records=[{
            **{k: v for k, v in old.__dict__.items() if k != "job_id"}, "repeats": 5, "ms": 0.4, "ms_p20": 0.3,
            "ms_p80": 0.9, "baseline_ms": 0.8, "baseline_ms_p20": 0.79, "baseline_ms_p80": 0.82, "unstable": True}])
    with db.session_scope(s) as session:
        got = repo.kernel_results(session, device_name="Old CPU")[0]  # newest job first
        assert (got.repeats, got.ms_p20, got.ms_p80, got.unstable) == (5, 0.3, 0.9, True)
        assert (got.baseline_ms, got.baseline_ms_p20, got.baseline_ms_p80) == (0.8, 0.79, 0.82)
    from alembic import command

    command.downgrade(db.alembic_config(s), str(before))  # and back: the columns go, the rows stay
    with engine.connect() as conn:
        assert not SPREAD_COLUMNS & {c["name"] for c in inspect(conn).get_columns("kernel_results")}
        assert conn.execute(text("SELECT count(*) FROM kernel_results")).scalar() == 2
