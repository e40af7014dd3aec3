"""The job runner on its own (bodies faked: the runner's state machine is what is under test)."""

from __future__ import annotations

import pytest

from quantcore.errors import Cancelled, CheckpointError
from store import repo
from store.db import StoreError, session_scope
from worker.runner import JobCancelled, Outcome, run_job


def _job(settings, kind="calibrate"):
    with session_scope(settings) as s:
        return repo.create_job(s, kind=kind, params={"device": "cpu"}, queue="cpu", user="t")


def _get(settings, job_id):
    with session_scope(settings) as s:
        return repo.get_job(s, job_id)


def test_success_stores_result_and_status_together(qp_settings):
    job = _job(qp_settings)
    seen = []

    def body(ctx):
        ctx.progress(0.5, "half way")
        seen.append(_get(qp_settings, job.id).status)
        return Outcome(result={"answer": 42}, write=lambda s: None, message="ok")

    assert run_job(job.id, body, settings=qp_settings) == "succeeded"
    done = _get(qp_settings, job.id)
    assert seen == ["running"]
    assert (done.status, done.progress, done.result, done.message) == ("succeeded", 1.0, {"answer": 42}, "ok")
    assert done.worker_host and done.device == "cpu" and done.started_at and done.finished_at


def test_a_progress_listener_hears_each_write_and_its_failure_never_fails_the_job(qp_settings, monkeypatch):
    """run_job(on_progress=...): a CLI --local run prints what the job writes; a listener that fails (its reader
    went away: BrokenPipeError) is dropped and the job still succeeds."""
    monkeypatch.setattr("worker.runner.PROGRESS_INTERVAL_S", 0.0)
    heard: list[tuple[float, str]] = []

    def body(ctx):
        ctx.progress(0.25, "a quarter")
        ctx.progress(0.5, "half way")
        return Outcome(result={"answer": 42})

    assert run_job(_job(qp_settings).id, body, settings=qp_settings,
                   on_progress=lambda f, m: heard.append((f, m))) == "succeeded"
    assert heard == [(0.25, "a quarter"), (0.5, "half way")]

    def gone(fraction, message):
        heard.append((fraction, message))
        raise BrokenPipeError(32, "Broken pipe")

    heard.clear()
    job = _job(qp_settings)
    assert run_job(job.id, body, settings=qp_settings, on_progress=gone) == "succeeded"
    assert heard == [(0.25, "a quarter")] and _get(qp_settings, job.id).result == {"answer": 42}


def test_last_phase_fills_the_rest_of_the_bar_from_where_the_job_is(qp_settings, monkeypatch):
    """ctx.rest(): a score's or sweep's own count maps onto what is left of the bar. With the reference log-probs
    from the cache (0.1) a quarter of the units is 0.325, not the 0.475 a fixed 0.3 + 0.7 × f start would say."""
    import worker.runner as runner

    monkeypatch.setattr(runner, "PROGRESS_INTERVAL_S", 0.0)
    job, seen = _job(qp_settings), []

    def body(ctx):
        ctx.progress(0.1, "reference log-probs from the cache")
        step = ctx.rest()
        for f in (0.0, 0.25, 1.0):
            step(f, f"{f:g} of the units")
            seen.append(_get(qp_settings, job.id).progress)
        return Outcome()

    assert run_job(job.id, body, settings=qp_settings) == "succeeded"
    assert seen == pytest.approx([0.1, 0.325, 1.0])


def test_a_job_past_its_time_limit_fails_as_timed_out_where_it_next_checks(qp_settings):
    """The job's own limit: reporting progress or asking whether to stop past it raises, the job fails with the
    limit's name in its error, and what it had not written stays unwritten."""
    import time

    from worker.runner import JobTimedOut

    limited = qp_settings.model_copy(update={"job_soft_time_limit_s": 1})
    for check in ("progress", "should_cancel"):
        job, seen = _job(qp_settings), []

        def body(ctx, check=check, seen=seen):
            while True:  # a loop that would never end on its own
                ctx.progress(0.5, "working") if check == "progress" else ctx.should_cancel()
                seen.append(1)
                time.sleep(0.05)

        started = time.monotonic()
        assert run_job(job.id, body, settings=limited) == "failed"
        done = _get(qp_settings, job.id)
        assert done.error == "timed out after 1 s (QUANTPLAN_JOB_SOFT_TIME_LIMIT_S)" and "JobTimedOut" in done.traceback
        assert 1.0 <= time.monotonic() - started < 5 and len(seen) > 5
    unlimited = qp_settings.model_copy(update={"job_soft_time_limit_s": 0})
    job = _job(qp_settings)
    assert run_job(job.id, lambda ctx: (ctx.should_cancel(), Outcome())[1], settings=unlimited) == "succeeded"
    assert issubclass(JobTimedOut, Exception) and not issubclass(JobTimedOut, RuntimeError)  # no kernel try catches it


def test_a_running_job_keeps_its_heartbeat_while_it_reports_nothing(qp_settings):
    """A long step with no progress (hashing a large upload, loading a big checkpoint) is not taken for a dead
    worker: the job's heartbeat is written from a thread. Past its time limit it stops, so a job stuck where it never
    checks the limit is failed by the stale-job sweep after all."""
    import time

    quick = qp_settings.model_copy(update={"heartbeat_stale_s": 1})  # a beat every 0.25 s
    job, swept = _job(qp_settings), []

    def silent(ctx):
        time.sleep(1.6)
        with session_scope(qp_settings) as s:
            swept.append(repo.sweep_stale_jobs(s, stale_after_s=1))
        return Outcome()

    assert run_job(job.id, silent, settings=quick) == "succeeded" and swept == [[]]
    stuck = _job(qp_settings)
    limited = quick.model_copy(update={"job_soft_time_limit_s": 1})

    def stuck_body(ctx):
        time.sleep(2.6)  # never reports, never checks: past its limit at 1 s, stale from about 1.25 s
        with session_scope(qp_settings) as s:
            swept.append(repo.sweep_stale_jobs(s, stale_after_s=1))
        return Outcome()

    run_job(stuck.id, stuck_body, settings=limited)
    assert swept[-1] == [stuck.id]


def test_ctrl_c_on_a_local_run_ends_the_job_as_cancelled_and_still_stops_the_run(qp_settings):
    job = _job(qp_settings)

    def body(ctx):
        ctx.progress(0.3, "working")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_job(job.id, body, settings=qp_settings)
    done = _get(qp_settings, job.id)
    assert (done.status, done.message) == ("cancelled", "interrupted (Ctrl-C) before it finished")


def test_bad_input_fails_without_a_traceback_in_the_log_and_a_bug_with_one(qp_settings, caplog):
    """A person's mistake (a damaged archive: a QuantcoreError) is logged as its message at INFO, no traceback on
    a CLI's stderr; anything else is logged with its traceback. Both keep the traceback in the job's row."""
    import logging

    def damaged(ctx):
        raise CheckpointError("cannot extract junk.zip: the archive is damaged")

    def bug(ctx):
        raise RuntimeError("index out of range")

    caplog.set_level(logging.INFO, logger="worker.runner")
    mistake, crash = _job(qp_settings), _job(qp_settings)
    assert run_job(mistake.id, damaged, settings=qp_settings) == "failed"
    assert run_job(crash.id, bug, settings=qp_settings) == "failed"
    (said,) = [r for r in caplog.records if f"job {mistake.id} failed" in r.getMessage()]
    assert said.levelno == logging.INFO and said.exc_info is None and "archive is damaged" in said.getMessage()
    (raised,) = [r for r in caplog.records if f"job {crash.id} failed" in r.getMessage()]
    assert raised.levelno == logging.ERROR and raised.exc_info is not None
    for job, error in ((mistake, "cannot extract junk.zip: the archive is damaged"),
                       (crash, "RuntimeError: index out of range")):
        done = _get(qp_settings, job.id)
        assert done.error == error and "Traceback" in done.traceback


def test_failure_in_write_rolls_back_and_marks_failed(qp_settings):
    job = _job(qp_settings)

    def write(s):
        repo.save_plan(s, model_id=999, name="x", body={}, user=None)  # FK violation → whole write refused

    assert run_job(job.id, lambda ctx: Outcome(write=write), settings=qp_settings) == "failed"
    done = _get(qp_settings, job.id)
    assert done.status == "failed" and "refused" in done.error and done.traceback
    with session_scope(qp_settings) as s:
        assert repo.list_plans(s) == []


def test_readable_error_for_bad_input(qp_settings):
    job = _job(qp_settings, "register")

    def body(ctx):
        raise CheckpointError("model.bin is a pickle checkpoint; quantplan never unpickles uploads")

    assert run_job(job.id, body, settings=qp_settings) == "failed"
    assert _get(qp_settings, job.id).error == "model.bin is a pickle checkpoint; quantplan never unpickles uploads"


@pytest.mark.parametrize("exc", [JobCancelled, Cancelled])
def test_cancel_between_batches(qp_settings, exc):
    job = _job(qp_settings)
    batches = []

    def body(ctx):
        for i in range(100):
            if ctx.should_cancel():
                raise exc()
            batches.append(i)
            if i == 2:
                with session_scope(qp_settings) as s:
                    repo.request_cancel(s, job.id)
        return Outcome()

    assert run_job(job.id, body, settings=qp_settings) == "cancelled"
    assert batches == [0, 1, 2]
    done = _get(qp_settings, job.id)  # the message adds to the status rather than repeat it
    assert (done.status, done.message) == ("cancelled", "by request, while it ran")


def test_cancelled_before_start_never_runs(qp_settings):
    job = _job(qp_settings)
    with session_scope(qp_settings) as s:
        repo.request_cancel(s, job.id)
    ran = []
    assert run_job(job.id, lambda ctx: ran.append(1) or Outcome(), settings=qp_settings) == "skipped"
    assert ran == [] and _get(qp_settings, job.id).message == "by request, before it started"


def test_worker_refuses_outdated_schema(qp_env):
    from store.db import SchemaOutdated
    from store.settings import get_settings

    s = get_settings()
    s.ensure_dirs()
    with pytest.raises((SchemaOutdated, StoreError), match="quantplan migrate"):
        run_job(1, lambda ctx: Outcome(), settings=s)


def test_sweep_leftovers_removes_only_abandoned_intake_folders(qp_settings):
    import os
    import time
    from pathlib import Path

    from worker.runner import STAGING_IDLE_S, UPLOAD_IDLE_S, sweep_leftovers

    def folder(path: Path, age_s: float) -> Path:
        (path / "sub").mkdir(parents=True)
        f = path / "sub" / "part.safetensors"
        f.write_bytes(b"x")
        old = time.time() - age_s
        for p in (f, path / "sub", path):
            os.utime(p, (old, old))
        return path

    models = Path(qp_settings.models_dir)
    uploads = Path(str(qp_settings.artifact_dir)) / "uploads"
    dead_staging = folder(models / ".staging-dead", STAGING_IDLE_S + 60)
    live_staging = folder(models / ".staging-live", STAGING_IDLE_S + 60)
    (live_staging / "sub" / "part.safetensors").write_bytes(b"still copying")  # written just now
    registered = folder(models / ("a" * 64), 10 * STAGING_IDLE_S)  # a finished model: never touched
    old_upload = folder(uploads / "old", UPLOAD_IDLE_S + 60)
    queued_upload = folder(uploads / "queued", UPLOAD_IDLE_S + 60)
    new_upload = folder(uploads / "new", 60)
    with session_scope(qp_settings) as s:
        repo.create_job(s, kind="register", params={"cleanup_dir": str(queued_upload)}, queue="cpu", user="t")

    removed = sweep_leftovers(qp_settings)
    assert sorted(removed) == sorted([dead_staging, old_upload])
    for kept in (live_staging, registered, queued_upload, new_upload):
        assert kept.is_dir(), kept
    assert not dead_staging.exists() and not old_upload.exists()
    assert sweep_leftovers(qp_settings) == []


def test_worker_presence(qp_settings):
    import datetime as dt
    import time

    from jobs import workers
    from store import models as m
    from worker import presence

    assert workers.live_workers(qp_settings) == []
    note = workers.no_worker_note("gpu", qp_settings)
    assert "No worker consuming queue 'gpu'" in note and "quantplan worker --queues gpu" in note
    assert workers.no_worker_note("local", qp_settings) is None  # --local jobs need no worker

    rec = presence.announce("w1@host", ["cpu", "gpu"], qp_settings)  # no CUDA here: described by its CPU
    assert rec.queues == ["cpu", "gpu"] and rec.device == "cpu" and rec.device_class == "cpu"
    assert workers.no_worker_note("gpu", qp_settings) is None and workers.no_worker_note("cpu", qp_settings) is None
    assert workers.no_worker_note("gpu.sm90", qp_settings) is not None

    old = m.utcnow() - dt.timedelta(seconds=workers.LIVE_WITHIN_S + 5)
    with session_scope(qp_settings) as s:  # it stopped reporting
        s.query(m.Worker).update({m.Worker.seen_at: old})
    assert workers.live_workers(qp_settings) == [] and workers.no_worker_note("cpu", qp_settings)
    with session_scope(qp_settings) as s:
        assert repo.worker_seen(s, "w1@host") and not repo.worker_seen(s, "nobody@host")
        assert [w.name for w in repo.list_workers(s)] == ["w1@host"]
    assert [w.name for w in workers.live_workers(qp_settings)] == ["w1@host"]

    stop = presence.start_heartbeat("w2@host", ["cpu"], qp_settings, interval_s=0.05)  # unknown: recorded
    try:
        deadline = time.monotonic() + 10
        while "w2@host" not in [w.name for w in workers.live_workers(qp_settings)]:
            assert time.monotonic() < deadline, "the heartbeat never recorded the worker"
            time.sleep(0.05)
    finally:
        stop.set()
    presence.forget("w1@host", qp_settings)
    assert [w.name for w in workers.live_workers(qp_settings)] == ["w2@host"]


@pytest.mark.parametrize("fails", [False, True])
def test_every_job_ends_with_the_cache_under_its_limit(qp_settings, fails):
    """The end of a job that used the files jobs keep beside the models (succeeded or failed) trims them to
    cache_max_gib, the least recently used first: here what an earlier job kept, not what this one wrote."""
    import os

    from store import cache

    folder = qp_settings.model_reference_dir("f" * 64)
    old = cache.kv_path(folder, "old")
    old.parent.mkdir(parents=True)
    old.write_bytes(b"x" * 600)
    os.utime(old, (1, 1))
    qp_settings.cache_max_gib = 1000 / 2**30
    job = _job(qp_settings)

    def body(ctx):
        cache.awq_path(folder, "new").write_bytes(b"y" * 600)
        ctx.cache_used = True
        if fails:
            raise ValueError("no luck")
        return Outcome()

    assert run_job(job.id, body, settings=qp_settings) == ("failed" if fails else "succeeded")
    assert not old.exists() and cache.awq_path(folder, "new").exists()
    cache.kv_path(folder, "older").write_bytes(b"z" * 600)
    assert run_job(_job(qp_settings).id, lambda ctx: Outcome(), settings=qp_settings) == "succeeded"
    assert cache.kept_files(folder)[cache.KV] == (1, 600)  # a job that used no kept file leaves the cache alone

    def keeps(ctx):
        ctx.cache_used = True
        return Outcome()

    qp_settings.cache_max_gib = 0  # no limit: nothing goes
    assert run_job(_job(qp_settings).id, keeps, settings=qp_settings) == "succeeded"
    assert cache.kept_files(folder)[cache.AWQ] == (1, 600) and cache.kept_files(folder)[cache.KV] == (1, 600)


def test_a_count_in_a_progress_message_is_written_with_the_time_left_at_its_measured_rate(qp_settings, monkeypatch):
    """The runner times each step's count (jobs.progress.Pace) and writes the time left with the message; an ended
    job keeps its final message, not the last estimate."""
    from jobs.progress import Pace

    monkeypatch.setattr("worker.runner.PROGRESS_INTERVAL_S", 0.0)
    clock = [0.0]
    job, written = _job(qp_settings, kind="score"), []

    def body(ctx):
        ctx._pace = Pace(clock=lambda: clock[0])  # the step's clock, not the wall's: the test is about the rate
        for done in (4, 8, 16):
            clock[0] = done * 0.5  # 2 sequences a second
            ctx.progress(0.1 + 0.9 * done / 32, f"scoring: {done} of 32 sequences")
            written.append(_get(qp_settings, job.id).message)
        return Outcome(message="FP8_DYNAMIC: KL 0.02")

    assert run_job(job.id, body, settings=qp_settings) == "succeeded"
    assert written == ["scoring: 4 of 32 sequences", "scoring: 8 of 32 sequences · about 12 s left",
                       "scoring: 16 of 32 sequences · about 8 s left"]
    assert _get(qp_settings, job.id).message == "FP8_DYNAMIC: KL 0.02"
