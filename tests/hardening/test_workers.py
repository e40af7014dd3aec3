"""Faults survived, with real worker processes and real brokers: no job stays "running" when nothing runs it.

A worker SIGKILLed mid-job while another lives, or killed and restarted at once: the job is failed by a live
worker's own sweep within the stale limit plus one sweep interval of its last heartbeat, with no page open and no
CLI waiting, and queued again it succeeds. A CLI waiting for a job whose worker died ends; a --local run ended by
SIGTERM cancels its job; a task delivered again for a job that runs or ran is dropped, never run twice. Every wait
here is for a state (a job's row, a line in a log) under a generous deadline, never a fixed sleep. Figures:
docs/results/hardening.md, section "workers".
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from store import repo
from store.db import session_scope
from store.records import JobRecord
from tests.conftest import REDIS_DB
from tests.factories import Proc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STALE_S = 6  # QUANTPLAN_HEARTBEAT_STALE_S of these tests: a heartbeat and a sweep every 1.5 s
INTERVAL_S = repo.beat_interval_s(STALE_S)
SLACK_S = 6.0  # a loaded 2-core machine: a sweep thread's turn, a SQLite lock, on top of stale + interval
# about 15 s of CPU timings (SmolLM2-135M's shapes at M = 2048), long enough to kill it mid-job; a job that stores
# nothing before it ends, so queued again it runs again
LONG_BENCH = {"device": "cpu", "m": [2048], "budget_s": 1.5}


# ---------------------------------------------------------------- helpers


def start_workers(tmp_path: Path, *names: str) -> list[Proc]:
    """Celery workers as `quantplan worker` starts them (solo pool, queue cpu), each with its own node name and log,
    returned once each says it is ready. One after another: two workers connecting at the same instant to a fresh
    embedded broker race to create kombu's queue row, and on a busy machine the loser exits with "UNIQUE constraint
    failed: kombu_queue.name" (kombu's SQLAlchemy transport, not quantplan; a worker started later is fine)."""
    procs: list[Proc] = []
    try:
        for name in names:
            cmd = [sys.executable, "-m", "celery", "-A", "worker.celery_app:celery_app", "worker", "-P", "solo",
                   "--concurrency", "1", "-Q", "cpu", "-n", f"{name}@%h", "--loglevel", "INFO"]
            procs.append(Proc(cmd, dict(os.environ), tmp_path / f"{name}.log"))
            procs[-1].wait_for(" ready.", timeout=240)
    except Exception:
        stop_all(procs)
        raise
    return procs


_STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}")


def runs_of(text: str, job_id: int) -> int:
    """How many times a worker log says it marked job ``job_id`` running (worker.runner's "job N (kind) running
    on"); a line printed by two handlers (quantplan's and Celery's, same time stamp) counts once."""
    needle = re.compile(rf"\bjob {job_id} \(\w+\) running on ")
    return len({m.group(0) for line in text.splitlines() if needle.search(line) and (m := _STAMP.search(line))})


def stop_all(procs: list[Proc]) -> None:
    for proc in procs:
        proc.stop()


def job_now(settings, job_id: int) -> JobRecord:
    """The job's row as stored: read only, never swept (no page, no CLI waits here)."""
    with session_scope(settings) as s:
        return repo.get_job(s, job_id)


def wait_until(settings, job_id: int, ok: Callable[[JobRecord], bool], within_s: float, what: str) -> JobRecord:
    deadline = time.monotonic() + within_s
    while True:
        job = job_now(settings, job_id)
        if ok(job):
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} not {what} within {within_s:.0f} s: {job}")
        time.sleep(0.2)


def wait_for_line(procs: list[Proc], needle: str, within_s: float) -> Proc:
    """The process whose log says ``needle`` first."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for proc in procs:
            if needle in proc.text():
                return proc
        time.sleep(0.2)
    raise AssertionError(f"no {needle!r} in any worker log within {within_s:.0f} s:\n"
                         + "\n".join(p.text()[-3000:] for p in procs))


def running_mid_job(settings, job_id: int) -> JobRecord:
    """Wait until the job runs and its heartbeat has advanced once (its worker is in the body)."""
    first = wait_until(settings, job_id, lambda j: j.status == "running", 240, "running")
    return wait_until(settings, job_id, lambda j: j.status != "running" or j.heartbeat_at != first.heartbeat_at,
                      120, "beating")


def assert_failed_by_the_sweep(settings, job_id: int, within_s: float = 120) -> JobRecord:
    """The killed worker's job ends failed by a sweep, no sooner than the stale limit after its last heartbeat and
    no later than the limit plus one sweep interval (and some slack for a busy machine)."""
    dead = wait_until(settings, job_id, lambda j: j.status != "running", within_s, "swept")
    assert dead.status == "failed" and "the worker stopped reporting" in dead.error, dead
    assert "Queue the job again" in dead.error
    silent = (dead.finished_at - dead.heartbeat_at).total_seconds()
    assert STALE_S <= silent <= STALE_S + INTERVAL_S + SLACK_S, silent
    print(f"\njob {job_id}: failed {silent:.1f} s after its last heartbeat (limit {STALE_S} + {INTERVAL_S:g} s)")
    return dead


def retried_succeeds(settings, job_id: int, survivor: Proc) -> JobRecord:
    from quantplan.services import jobs as jobs_svc

    again = jobs_svc.retry_job(job_id)
    done = wait_until(settings, again.id, lambda j: j.finished, 300, "finished")
    assert done.status == "succeeded", done
    assert f"[{again.celery_task_id}] received" in survivor.text()
    return done


@pytest.fixture
def stale_env(qp_env, monkeypatch):
    """Every process of the test (workers, CLI) fails a job after STALE_S s without a heartbeat."""
    from tests.conftest import clear_settings_cache

    monkeypatch.setenv("QUANTPLAN_HEARTBEAT_STALE_S", str(STALE_S))
    clear_settings_cache()
    return qp_env


@pytest.fixture
def sqlite_deployment(stale_env):
    from store.db import upgrade
    from store.settings import get_settings

    s = get_settings()
    upgrade(s)
    assert s.broker_url.startswith("sqla+sqlite:") and s.heartbeat_stale_s == STALE_S
    return s


@pytest.fixture
def redis_deployment(stale_env, pg_database, redis_url, monkeypatch) -> Iterator:
    """PostgreSQL + Redis (this test's own Redis database number); skipped when either does not answer."""
    import redis

    from store.db import upgrade
    from store.settings import get_settings
    from tests.conftest import clear_settings_cache

    url = redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB - 1}"  # not the e2e tests' number: each test flushes its own
    client = redis.Redis.from_url(url)
    client.flushdb()
    for key, value in (("DATABASE_URL", pg_database), ("BROKER_URL", url), ("RESULT_BACKEND", url)):
        monkeypatch.setenv(f"QUANTPLAN_{key}", value)
    clear_settings_cache()
    s = get_settings()
    upgrade(s)
    yield s, client
    client.flushdb()


# ---------------------------------------------------------------- a worker killed mid-job


def _kill_one_of_two(settings, tmp_path: Path, redis_client=None) -> None:
    from jobs.client import submit_job

    workers = start_workers(tmp_path, "first", "second")
    try:
        job = submit_job("bench", LONG_BENCH, settings=settings)
        running_mid_job(settings, job.id)
        victim = wait_for_line(workers, f"[{job.celery_task_id}] received", 60)
        survivor = next(w for w in workers if w is not victim)
        victim.p.kill()  # SIGKILL: no clean-up of any kind runs
        victim.p.wait(timeout=60)
        assert_failed_by_the_sweep(settings, job.id)
        if redis_client is not None:
            # the killed worker's message came back once the job was failed (visibility timeout = stale limit +
            # one interval), and the survivor dropped it: it left the unacked hash and did not run the job again
            wait_for_line([survivor], f"job {job.id} is ", 120)
            assert "its task is acknowledged and dropped, not run" in survivor.text()
            deadline = time.monotonic() + 60
            while redis_client.hlen("unacked") and time.monotonic() < deadline:
                time.sleep(0.2)
            assert redis_client.hlen("unacked") == 0
            assert job_now(settings, job.id).status == "failed"
        retried_succeeds(settings, job.id, survivor)
    finally:
        stop_all(workers)


def test_one_of_two_workers_killed_mid_job_sqlite_broker_fails_its_job_in_time_and_the_retry_succeeds(
        sqlite_deployment, tmp_path):
    _kill_one_of_two(sqlite_deployment, tmp_path)


def test_one_of_two_workers_killed_mid_job_redis_postgres_fails_its_job_in_time_drops_its_redelivery(
        redis_deployment, tmp_path):
    settings, client = redis_deployment
    _kill_one_of_two(settings, tmp_path, client)


def test_a_worker_killed_and_restarted_at_once_leaves_no_job_running(stale_env, monkeypatch, tmp_path):
    """The restarted worker's start-up sweep comes before the job is stale; its timer fails the job later (the old
    code swept only at start-up and on the Jobs page). A longer stale limit than the other tests' so the restart is
    sure to be ready before it."""
    from jobs.client import submit_job
    from store.db import upgrade
    from store.settings import get_settings
    from tests.conftest import clear_settings_cache

    stale = 20
    monkeypatch.setenv("QUANTPLAN_HEARTBEAT_STALE_S", str(stale))
    clear_settings_cache()
    settings = get_settings()
    upgrade(settings)
    (first,) = start_workers(tmp_path, "only")
    try:
        job = submit_job("bench", LONG_BENCH, settings=settings)
        running_mid_job(settings, job.id)
        first.p.kill()
        first.p.wait(timeout=60)
    finally:
        first.stop()
    (tmp_path / "again").mkdir()
    (again,) = start_workers(tmp_path / "again", "only")
    try:
        dead = wait_until(settings, job.id, lambda j: j.status != "running", 180, "swept")
        assert dead.status == "failed" and "the worker stopped reporting" in dead.error
        silent = (dead.finished_at - dead.heartbeat_at).total_seconds()
        assert stale <= silent <= stale + repo.beat_interval_s(stale) + SLACK_S, silent
        print(f"\njob {job.id}: failed {silent:.1f} s after its last heartbeat (limit {stale} + "
              f"{repo.beat_interval_s(stale):g} s)")
        retried_succeeds(settings, job.id, again)
    finally:
        again.stop()


# ---------------------------------------------------------------- the CLI


def _cli(*argv: str, log: Path) -> Proc:
    return Proc([sys.executable, "-m", "quantplan", *argv], dict(os.environ), log)


def test_a_cli_waiting_for_a_job_whose_worker_was_killed_ends_with_the_job_failed(sqlite_deployment, tmp_path):
    """`quantplan bench` without --local waits; its worker is killed and no other is left: the wait's own sweep
    fails the job once its heartbeat is stale, and the command ends (exit 1, the reason on stderr)."""
    (worker,) = start_workers(tmp_path, "only")
    cli = _cli("bench", "--m", "2048", "--budget", "1.5", log=tmp_path / "cli.log")
    try:
        wait_for_line([worker], "] received", 240)
        with session_scope(sqlite_deployment) as s:
            (job,) = repo.list_jobs(s, kind="bench")
        running_mid_job(sqlite_deployment, job.id)
        worker.p.kill()
        worker.p.wait(timeout=60)
        code = cli.p.wait(timeout=STALE_S + INTERVAL_S + 120)
        assert code == 1, cli.text()
        assert f"job #{job.id} failed: the worker stopped reporting" in cli.text()
        assert job_now(sqlite_deployment, job.id).status == "failed"
    finally:
        worker.stop()
        cli.p.kill()
        cli.stop()


def test_a_cli_wait_stops_at_its_timeout_and_says_the_job_goes_on(sqlite_deployment, capsys):
    from tests.factories import run_cli

    code, _, err = run_cli(capsys, "bench", "--m", "1", "--budget", "0.1", "--timeout", "1")
    with session_scope(sqlite_deployment) as s:
        (job,) = repo.list_jobs(s, kind="bench")
    assert code == 1 and "Traceback" not in err, err
    assert err.rstrip().endswith(f"quantplan: stopped waiting after 1 s (--timeout); job #{job.id} is still queued "
                                 f"and goes on (`quantplan jobs show {job.id}`, `quantplan jobs cancel {job.id}`)")
    with pytest.raises(SystemExit) as refused:  # argparse's refusal, before any job is written
        run_cli(capsys, "bench", "--m", "1", "--timeout", "0")
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--timeout: must be a positive number of seconds, got '0'" in err


def test_a_local_job_ended_by_sigterm_is_cancelled_not_left_running(sqlite_deployment, tmp_path):
    cli = _cli("bench", "--m", "2048", "--budget", "1.5", "--local", log=tmp_path / "cli.log")
    try:
        deadline = time.monotonic() + 240
        jobs: list[JobRecord] = []
        while not jobs and time.monotonic() < deadline and cli.p.poll() is None:
            with session_scope(sqlite_deployment) as s:
                jobs = repo.list_jobs(s, kind="bench")
            time.sleep(0.2)
        assert jobs, cli.text()
        running_mid_job(sqlite_deployment, jobs[0].id)
        cli.p.send_signal(signal.SIGTERM)
        assert cli.p.wait(timeout=120) == 128 + signal.SIGTERM, cli.text()  # 143, as a shell reports SIGTERM
    finally:
        cli.stop()
    done = job_now(sqlite_deployment, jobs[0].id)
    assert (done.status, done.message) == ("cancelled", "interrupted (SIGTERM) before it finished")
    assert f"quantplan: job #{done.id} cancelled: interrupted (SIGTERM) before it finished" in cli.text()
    assert "Traceback" not in cli.text()


# ---------------------------------------------------------------- a task delivered again


def test_a_redelivered_task_of_a_finished_or_running_job_is_dropped_by_a_real_worker(qp_settings, tmp_path):
    """The task of a job that already succeeded, and of one another worker runs, sent again by name (as Redis
    redelivers one after its visibility timeout): acknowledged and dropped with a log line, the rows untouched.
    (The default stale limit, 120 s: the job "running elsewhere" keeps its fresh heartbeat for the whole test.)"""
    from jobs.client import celery_client, submit_job
    from jobs.routing import task_name

    s = qp_settings
    (worker,) = start_workers(tmp_path, "only")
    try:
        done = submit_job("bench", {"device": "cpu", "m": [1], "budget_s": 0.1, "paths": ["baseline"]}, settings=s)
        done = wait_until(s, done.id, lambda j: j.finished, 300, "finished")
        assert done.status == "succeeded"
        with session_scope(s) as session:
            elsewhere = repo.create_job(session, kind="bench", params=dict(LONG_BENCH), queue="cpu", user="t")
            repo.mark_running(session, elsewhere.id, worker_host="other-host", device="cpu", torch_version="t")
        for job in (job_now(s, elsewhere.id), done):
            sent = celery_client(s).send_task(task_name("bench"), args=[job.id], queue="cpu")
            wait_for_line([worker], f"[{sent.id}] succeeded", 300)  # Celery's own line: the task ended, acknowledged
            after = job_now(s, job.id)
            assert (after.status, after.started_at, after.finished_at, after.worker_host) == (
                job.status, job.started_at, job.finished_at, job.worker_host)  # not run again
            assert f"job {job.id} is {job.status}, not queued: its task is acknowledged and dropped" in worker.text()
        assert runs_of(worker.text(), done.id) == 1 and runs_of(worker.text(), elsewhere.id) == 0
    finally:
        worker.stop()
