"""No job stays "running" (or a --local one "queued") when nothing runs it, in one process: a task of a job that
is not queued is dropped, a live worker sweeps on a timer, a wait sweeps, a --local run ended by a signal ends its
job. (The same with real worker processes and brokers: tests/hardening/test_workers.py.)"""

from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import time

import pytest

from store import models as m
from store import repo
from store.db import session_scope
from worker.runner import JobInterrupted, Outcome, run_job, start_sweeping


def _job(settings, *, queue="cpu"):
    with session_scope(settings) as s:
        return repo.create_job(s, kind="bench", params={"device": "cpu"}, queue=queue, user="t")


def _get(settings, job_id):
    with session_scope(settings) as s:
        return repo.get_job(s, job_id)


def _running(settings, *, heartbeat_age_s: float = 0.0, host="other-host"):
    """A job another worker marked running, its last heartbeat ``heartbeat_age_s`` ago."""
    job = _job(settings)
    with session_scope(settings) as s:
        assert repo.mark_running(s, job.id, worker_host=host, device="cpu", torch_version="t")
        s.get(m.Job, job.id).heartbeat_at = m.utcnow() - dt.timedelta(seconds=heartbeat_age_s)
    return job


def _never(ctx):
    raise AssertionError(f"job {ctx.job_id} ran again")


@pytest.mark.parametrize("status", ["running", "succeeded", "failed", "cancelled"])
def test_a_task_of_a_job_that_is_not_queued_is_dropped_with_a_log_line_and_its_body_never_runs(qp_settings, status,
                                                                                               caplog):
    """A redelivered task (Redis after its visibility timeout, a requeue on worker loss) or one sent twice: a job
    that runs on another worker, finished, or was cancelled is left as it is, and the worker says why."""
    job = _running(qp_settings)
    if status != "running":
        with session_scope(qp_settings) as s:
            repo.finish_job(s, job.id, status=status, message="as it ended")
    before = _get(qp_settings, job.id)
    with caplog.at_level(logging.INFO, logger="worker.runner"):
        assert run_job(job.id, _never, settings=qp_settings) == "skipped"
    after = _get(qp_settings, job.id)
    assert (after.status, after.worker_host, after.started_at, after.finished_at) == (
        before.status, "other-host", before.started_at, before.finished_at)
    assert f"job {job.id} is {status}, not queued: its task is acknowledged and dropped, not run" in caplog.text


def test_a_redelivered_task_of_a_job_whose_worker_died_fails_it_now_and_never_runs_it(qp_settings):
    """The task comes back (Redis) while its job is still running on a worker that is gone: it is not run a second
    time; the job is failed there and then, as the sweep would, for the person to queue again."""
    job = _running(qp_settings, heartbeat_age_s=1000, host="gone-host")
    assert run_job(job.id, _never, settings=qp_settings) == "skipped"
    dead = _get(qp_settings, job.id)
    assert dead.status == "failed" and "the worker stopped reporting" in dead.error and "gone-host" in dead.error


def test_exactly_one_of_two_deliveries_of_a_queued_job_runs_it(qp_settings):
    job = _job(qp_settings)
    runs = []

    def body(ctx):
        runs.append(ctx.job_id)
        assert run_job(ctx.job_id, _never, settings=qp_settings) == "skipped"  # the second delivery, meanwhile
        return Outcome()

    assert run_job(job.id, body, settings=qp_settings) == "succeeded" and runs == [job.id]


def test_a_live_workers_timer_fails_a_stale_job_with_no_page_open_and_no_worker_starting(qp_settings):
    quick = qp_settings.model_copy(update={"heartbeat_stale_s": 1})  # a sweep every 0.25 s
    dead = _running(qp_settings, heartbeat_age_s=1000)
    alive = _running(qp_settings)
    stop = start_sweeping(quick)
    try:
        deadline = time.monotonic() + 60
        while _get(qp_settings, dead.id).status == "running" and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
    assert _get(qp_settings, dead.id).status == "failed"
    assert _get(qp_settings, alive.id).status == "running"  # its heartbeat is fresh (1 s stale: still within)


def test_a_wait_sweeps_so_a_job_whose_worker_died_ends_failed_rather_than_never(qp_settings):
    """`quantplan calibrate` without --local waits through jobs.client.wait_for: with no worker left to sweep, the
    wait itself fails the job once its heartbeat is stale, and returns it."""
    from jobs.client import wait_for

    quick = qp_settings.model_copy(update={"heartbeat_stale_s": 1})
    job = _running(qp_settings, heartbeat_age_s=0.5)
    done = wait_for(job.id, timeout_s=60, poll_s=0.1, settings=quick)
    assert done.status == "failed" and "the worker stopped reporting" in done.error


def test_a_local_job_whose_process_died_before_it_started_is_failed_not_left_queued(qp_settings):
    """A --local job is written, then run at once by the same process; one still queued past the stale limit lost
    its process (nothing else will ever take it). A queued job of a worker queue waits for a worker."""
    orphan, waiting = _job(qp_settings, queue="local"), _job(qp_settings)
    with session_scope(qp_settings) as s:
        for job in (orphan, waiting):
            s.get(m.Job, job.id).created_at = m.utcnow() - dt.timedelta(seconds=1000)
    with session_scope(qp_settings) as s:
        assert repo.sweep_stale_jobs(s, stale_after_s=120) == [orphan.id]
    failed = _get(qp_settings, orphan.id)
    assert failed.status == "failed" and "(--local) stopped before it started" in failed.error
    assert _get(qp_settings, waiting.id).status == "queued"


def test_a_queued_job_whose_message_a_dead_worker_took_is_put_back_on_the_queue(qp_settings):
    """kombu's SQLAlchemy transport never redelivers a message its taker did not acknowledge: a worker killed
    between taking a job's message and marking the job running left the job queued for ever. A live worker puts
    the message back once it has seen it taken, the job still queued, for the stale limit."""
    from jobs.broker import taken_messages
    from jobs.client import celery_client, submit_job
    from worker.runner import restore_lost_tasks

    quick = qp_settings.model_copy(update={"heartbeat_stale_s": 1})
    job = submit_job("bench", {"device": "cpu", "m": [1], "budget_s": 0.1}, settings=qp_settings)
    with session_scope(qp_settings) as s:
        s.get(m.Job, job.id).created_at = m.utcnow() - dt.timedelta(seconds=1000)
    dead = celery_client(qp_settings).connection_for_read()
    taker = dead.SimpleQueue("cpu", no_ack=False)
    message = taker.get(timeout=30)  # taken and never acknowledged: its taker "died" (left open: a close restores)
    assert message.headers["id"] == job.celery_task_id
    assert set(taken_messages(quick, [job.celery_task_id])) == {job.celery_task_id}
    assert restore_lost_tasks(quick) == []  # seen taken just now: a live taker may be about to start it
    deadline, restored = time.monotonic() + 60, []
    while not restored and time.monotonic() < deadline:
        restored = restore_lost_tasks(quick)
        time.sleep(0.1)
    assert restored == [job.id] and taken_messages(quick, [job.celery_task_id]) == {}
    with celery_client(qp_settings).connection_for_read() as conn:
        again = conn.SimpleQueue("cpu", no_ack=False).get(timeout=30)
        assert again.headers["id"] == job.celery_task_id
        again.ack()
    message.ack()
    dead.release()


@pytest.mark.parametrize("signum, how, code", [(signal.SIGTERM, "SIGTERM", 143), (signal.SIGHUP, "SIGHUP", 129),
                                               (signal.SIGINT, "Ctrl-C", 130)])
def test_a_local_run_ended_by_a_signal_cancels_its_job_and_restores_the_handlers(qp_settings, monkeypatch, signum,
                                                                                 how, code):
    from quantplan.cli import local
    from worker import bodies

    job = _job(qp_settings, queue="local")

    def body(ctx):
        ctx.progress(0.2, "working")
        os.kill(os.getpid(), signum)
        time.sleep(30)  # the handler raises in this thread long before
        raise AssertionError("the signal did not stop the job")

    monkeypatch.setattr(bodies, "body_for", lambda kind: body)
    before = signal.getsignal(signum)
    with pytest.raises(JobInterrupted) as exc:
        local.run_here(job, settings=qp_settings, on_progress=lambda f, msg: None)
    assert exc.value.how == how and 128 + exc.value.signum == code
    done = _get(qp_settings, job.id)
    assert (done.status, done.message) == ("cancelled", f"interrupted ({how}) before it finished")
    assert signal.getsignal(signum) == before
