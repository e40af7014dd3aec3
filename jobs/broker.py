"""The Celery application's configuration, one for the senders (the app, the CLI: jobs.client) and the worker
(worker.celery_app, which adds its tasks through ``include``).

Reliability: a job is acknowledged only after its body returns (``acks_late``) and is requeued when the worker
process dies mid-job (``reject_on_worker_lost``); task bodies are idempotent (results are keyed by job id and a
rerun replaces them), and a sweep fails jobs whose heartbeat went stale.

A task runs its job only while the job is ``queued`` (store.repo.mark_running): a task delivered again, whatever
the reason, of a job that runs, ran or was cancelled is acknowledged and dropped (worker.runner). So Redis's
visibility timeout need not outlast the longest job: it is the stale limit plus one sweep interval (150 s by
default), when a job whose worker was killed is failed anyway. A killed worker's message then leaves Redis's
``unacked`` hash within that plus one restore scan, and its redelivery is dropped; a message whose worker was killed
before it marked its job running is run by the next worker, as late acks promise. kombu's SQLAlchemy transport has
no such timeout: a killed worker's message stays delivered (``visible`` false) and is never redelivered; the sweep
fails its job when it was running, and a live worker puts the message back (:func:`restore_messages`) when its job
is still queued past the stale limit (the worker died between taking it and marking the job running).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from typing import Any

from celery import Celery

from store.repo import beat_interval_s
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
        app.conf.broker_transport_options = redis_transport_options(s)
    return app


def redis_transport_options(settings: Settings) -> dict[str, Any]:
    """kombu's Redis options: an unacknowledged message comes back to the queue ``visibility_timeout`` seconds
    after its delivery, when the job of a killed worker is failed by the sweep (QUANTPLAN_HEARTBEAT_STALE_S plus one
    sweep interval); an idle worker looks for such messages every sweep interval (``unacked_restore_interval``,
    every call: ``unacked_restore_throttle`` 1; kombu's default scans every 100 s). A message whose job runs longer
    comes back too, once, and the worker that takes it drops it (the job is not queued)."""
    interval = beat_interval_s(settings.heartbeat_stale_s)
    return {"visibility_timeout": math.ceil(settings.heartbeat_stale_s + interval),
            "unacked_restore_interval": max(1, math.ceil(interval)), "unacked_restore_throttle": 1}


_ENGINES: dict[str, Any] = {}


def _sqla_broker(settings: Settings) -> Any | None:
    """An engine on the broker's own database when it is kombu's SQLAlchemy transport (``sqla+URL``), else None."""
    url = str(settings.broker_url)
    if not url.startswith("sqla+"):
        return None
    if url not in _ENGINES:
        from sqlalchemy import create_engine

        options: dict[str, Any] = {"connect_args": {"timeout": 30}} if url.startswith("sqla+sqlite") else {}
        _ENGINES[url] = create_engine(url.removeprefix("sqla+"), **options)
    return _ENGINES[url]


def taken_messages(settings: Settings, task_ids: Collection[str], *, scan: int = 5000) -> dict[str, int]:
    """kombu's SQLAlchemy transport only: {task id: message row id} of those of ``task_ids`` whose message a worker
    has taken (``visible`` false: kombu keeps taken messages), among the ``scan`` taken last; {} for another broker
    or no ids. (Redis brings such a message back by itself after its visibility timeout.)"""
    engine = _sqla_broker(settings)
    if engine is None or not task_ids:
        return {}
    from sqlalchemy import inspect, text

    if not inspect(engine).has_table("kombu_message"):
        return {}
    wanted, found = set(task_ids), {}
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, payload FROM kombu_message WHERE visible = :no ORDER BY id DESC "
                                 "LIMIT :scan"), {"no": False, "scan": scan})
        for row_id, payload in rows:
            try:
                task_id = json.loads(payload).get("headers", {}).get("id")
            except (ValueError, AttributeError):  # not a Celery message of ours
                continue
            if task_id in wanted:
                found[task_id] = int(row_id)
    return found


def restore_messages(settings: Settings, message_ids: Collection[int]) -> int:
    """Put taken messages of kombu's SQLAlchemy transport back on their queue (``visible`` true): the next worker
    takes them; how many. 0 for another broker."""
    engine = _sqla_broker(settings)
    if engine is None or not message_ids:
        return 0
    from sqlalchemy import bindparam, text

    statement = text("UPDATE kombu_message SET visible = :yes WHERE visible = :no AND id IN :ids").bindparams(
        bindparam("ids", expanding=True))
    with engine.begin() as conn:
        return int(conn.execute(statement, {"yes": True, "no": False, "ids": list(message_ids)}).rowcount)


__all__ = ["make_celery", "redis_transport_options", "restore_messages", "taken_messages"]
