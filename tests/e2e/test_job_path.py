"""The spine, end to end with a real worker process and real weights:
register the demo model → calibrate → statistics in the database.

(a) SQLite + kombu's SQLAlchemy broker (the embedded default); (b) PostgreSQL + Redis."""

from __future__ import annotations

import pytest

from jobs.client import submit_job, wait_for
from store import repo
from store.db import session_scope

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OUTLIER_LAYER = "model.layers.11.mlp.down_proj"


def _spine(settings) -> None:
    from jobs import workers

    # the worker process recorded itself: its queue and device, seen just now
    live = workers.live_workers(settings)
    assert len(live) == 1 and live[0].queues == ["cpu"] and live[0].device == "cpu"
    assert workers.no_worker_note("cpu", settings) is None
    assert "quantplan worker --queues gpu" in workers.no_worker_note("gpu", settings)

    reg = submit_job("register", {"demo": True}, settings=settings)
    reg = wait_for(reg.id, timeout_s=300, settings=settings)
    assert reg.status == "succeeded", reg.error
    model_id = reg.result["model_id"]

    cal = submit_job("calibrate", {"samples": 4, "seq_len": 128, "device": "cpu"}, model_id=model_id,
                     settings=settings)
    progress_seen = set()
    cal = wait_for(cal.id, timeout_s=300, settings=settings, poll_s=0.2,
                   on_update=lambda j: progress_seen.add(round(j.progress, 2)))
    assert cal.status == "succeeded", cal.error
    assert cal.worker_host and cal.device == "cpu" and cal.torch_version
    assert len(progress_seen) > 2  # progress was reported while it ran

    with session_scope(settings) as s:
        rows = {r["name"]: r for r in repo.stats_overview(s, cal.id)}
        model = repo.get_model(s, model_id)
    assert len(rows) == len(model.linears) == 30 * 7 + 1  # every linear, lm_head included
    assert rows[OUTLIER_LAYER]["outlier_ratio"] > 1000
    assert rows[OUTLIER_LAYER]["n_tokens"] == 4 * 128


def test_spine_sqlite_sqlalchemy_broker(qp_settings, worker):
    assert qp_settings.broker_url.startswith("sqla+sqlite:")
    _spine(qp_settings)
    # the worker's own INFO lines reach its stderr, under the module's name (store.logs, configured once)
    log = worker.text()
    assert "INFO worker.runner: job 1 (register) running on cpu" in log
    assert "INFO worker.runner: job 2 (calibrate) succeeded in " in log
    assert log.count("job 2 (calibrate) succeeded in ") == 1  # once: not again through Celery's root handler


def test_spine_postgres_redis(team_settings, tmp_path):
    from tests.factories import start_worker

    proc = start_worker(tmp_path)
    try:
        _spine(team_settings)
    finally:
        proc.stop()


def test_cancel_a_running_calibration(qp_settings, worker):
    reg = wait_for(submit_job("register", {"demo": True}, settings=qp_settings).id, timeout_s=300,
                   settings=qp_settings)
    assert reg.status == "succeeded", reg.error
    cal = submit_job("calibrate", {"samples": 400, "seq_len": 256, "batch_size": 1, "device": "cpu"},
                     model_id=reg.result["model_id"], settings=qp_settings)
    # wait until it is past model loading and into batches, then cancel
    import time

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        with session_scope(qp_settings) as s:
            running = repo.get_job(s, cal.id)
        if running.status == "running" and running.progress > 0.05:
            break
        time.sleep(0.2)
    assert running.status == "running", running
    with session_scope(qp_settings) as s:
        repo.request_cancel(s, cal.id)
    done = wait_for(cal.id, timeout_s=120, settings=qp_settings)
    assert done.status == "cancelled", done
    assert done.progress < 0.5  # it stopped early, between batches
    with session_scope(qp_settings) as s:
        assert repo.stats_overview(s, cal.id) == []


LONG_BENCH = {"device": "cpu", "m": [1, 16, 128, 2048], "budget_s": 600.0}  # minutes of CPU timings


def _a_short_job_succeeds(settings) -> None:
    """The worker takes the next job (a baseline GEMM at M = 1)."""
    job = submit_job("bench", {"device": "cpu", "m": [1], "budget_s": 0.2, "paths": ["baseline"]}, settings=settings)
    done = wait_for(job.id, timeout_s=120, settings=settings)
    assert done.status == "succeeded", done.error


def test_a_job_past_the_time_limit_fails_as_timed_out_on_the_real_worker(qp_settings, monkeypatch, tmp_path):
    """The worker runs Celery's solo pool, which never enforces Celery's own time limits: the job's own limit
    (QUANTPLAN_JOB_SOFT_TIME_LIMIT_S, checked where it reports progress) fails it, and the worker takes the next."""
    from tests.factories import start_worker

    monkeypatch.setenv("QUANTPLAN_JOB_SOFT_TIME_LIMIT_S", "3")
    proc = start_worker(tmp_path)
    try:
        long = submit_job("bench", LONG_BENCH, settings=qp_settings)
        done = wait_for(long.id, timeout_s=120, settings=qp_settings)
        assert done.status == "failed" and done.error == "timed out after 3 s (QUANTPLAN_JOB_SOFT_TIME_LIMIT_S)", done
        assert (done.finished_at - done.started_at).total_seconds() < 30
        with session_scope(qp_settings) as s:
            assert repo.kernel_results(s, job_id=long.id) == []  # nothing half-written
        _a_short_job_succeeds(qp_settings)
    finally:
        proc.stop()


def test_a_job_whose_worker_is_killed_stops_beating_and_is_failed_by_the_sweep(qp_settings, monkeypatch, tmp_path):
    """A worker killed mid-job (SIGKILL: no clean-up runs) leaves its job running; the job's heartbeat, written
    every QUANTPLAN_HEARTBEAT_STALE_S / 4 while it lived, stops; the sweep then fails it with a message that says
    to queue it again, and a new worker takes new jobs."""
    import time

    from tests.factories import start_worker
    from worker.runner import sweep

    monkeypatch.setenv("QUANTPLAN_HEARTBEAT_STALE_S", "2")  # a beat every 0.5 s
    proc = start_worker(tmp_path)
    try:
        long = submit_job("bench", LONG_BENCH, settings=qp_settings)
        beats, deadline = set(), time.monotonic() + 120
        while len(beats) < 3 and time.monotonic() < deadline:
            with session_scope(qp_settings) as s:
                job = repo.get_job(s, long.id)
            if job.status == "running":
                beats.add(job.heartbeat_at)
            time.sleep(0.2)
        assert len(beats) >= 3, "the running job's heartbeat did not advance"
        proc.p.kill()
        proc.p.wait(timeout=30)
        time.sleep(3)
        stale = qp_settings.model_copy(update={"heartbeat_stale_s": 2})
        assert sweep(stale) == [long.id]
        with session_scope(qp_settings) as s:
            dead = repo.get_job(s, long.id)
        assert dead.status == "failed" and "the worker stopped reporting" in dead.error
        assert "Queue the job again" in dead.error
    finally:
        proc.stop()
    (tmp_path / "again").mkdir()  # the new worker's log beside the first one's
    proc = start_worker(tmp_path / "again")
    try:
        _a_short_job_succeeds(qp_settings)
    finally:
        proc.stop()


def test_bad_upload_fails_with_a_clear_message_and_leaves_nothing(qp_settings, worker, tmp_path):
    import io
    import zipfile

    from quantplan.services import models as models_svc

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("../evil/config.json", "{}")
    job = models_svc.register_upload("evil.zip", buf.getvalue())
    done = wait_for(job.id, timeout_s=120, settings=qp_settings)
    assert done.status == "failed" and ".." in done.error
    uploads = qp_settings.artifact_dir / "uploads"
    assert not any(uploads.iterdir())
    models_dir = qp_settings.models_dir
    assert not models_dir.exists() or not any(models_dir.iterdir())
    with session_scope(qp_settings) as s:
        assert repo.list_models(s) == []
