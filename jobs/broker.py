"""The Celery application's configuration, one for the senders (the app, the CLI: jobs.client) and the worker
(worker.celery_app, which adds its tasks through ``include``).

Reliability: a job is acknowledged only after its body returns (``acks_late``) and is requeued when the worker
process dies mid-job (``reject_on_worker_lost``); task bodies are idempotent (results are keyed by job id and a
rerun replaces them), and a sweep fails jobs whose heartbeat went stale.
"""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery

from store.settings import Settings, get_settings


def make_celery(settings: Settings | None = None, include: Sequence[str] = ()) -> Celery:
    """A Celery app on the settings' broker; ``include``: the modules holding its tasks (a worker's only: a sender
    sends tasks by name and imports none)."""
    s = settings or get_settings()
    app = Celery("quantplan", broker=s.broker_url, backend=s.result_backend, include=list(include))
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,  # one job at a time per worker: jobs are long and memory-hungry
        task_default_queue="cpu",
        # Celery enforces these only in its prefork / gevent pools; `quantplan worker` runs the solo pool, where the
        # job's own limit applies (worker.runner.JobTimedOut, checked whenever the job reports progress)
        task_soft_time_limit=s.job_soft_time_limit_s or None,  # 0: no limit
        task_time_limit=s.job_soft_time_limit_s + 120 if s.job_soft_time_limit_s else None,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_ignore_result=True,  # job state lives in the jobs table
    )
    if str(s.broker_url).startswith(("redis://", "rediss://")):
        # Redis redelivers an unacknowledged task after the visibility timeout: it must exceed the
        # longest job, or a long job would run twice. (kombu's SQLAlchemy transport takes no such option.)
        # (No limit, 0: a week; a redelivered job already running is skipped by worker.runner.run_job anyway.)
        longest = s.job_soft_time_limit_s or 7 * 24 * 3600
        app.conf.broker_transport_options = {"visibility_timeout": longest + 600}
    return app


__all__ = ["make_celery"]
