"""Celery tasks: thin shells that run a job body by job id (heavy imports live in the bodies)."""

from __future__ import annotations

import os
import socket
from typing import Any

from celery.exceptions import Ignore
from celery.signals import worker_ready, worker_shutdown

from jobs.routing import TASK_NAMES
from jobs.shards import MERGE_TASK, SHARD_ATTEMPTS, SHARD_TASK
from store.settings import get_settings
from worker import presence
from worker.bodies import body_for
from worker.celery_app import celery_app
from worker.runner import run_job, start_sweeping, sweep, sweep_leftovers


@celery_app.task(name=TASK_NAMES["register"])
def register_task(job_id: int) -> str:
    return run_job(job_id, body_for("register"))


@celery_app.task(name=TASK_NAMES["calibrate"])
def calibrate_task(job_id: int) -> str:
    return run_job(job_id, body_for("calibrate"))


@celery_app.task(name=TASK_NAMES["score"])
def score_task(job_id: int) -> str:
    return run_job(job_id, body_for("score"))


@celery_app.task(name=TASK_NAMES["sensitivity"])
def sensitivity_task(job_id: int) -> str:
    return run_job(job_id, body_for("sensitivity"))


@celery_app.task(name=TASK_NAMES["bench"])
def bench_task(job_id: int) -> str:
    return run_job(job_id, body_for("bench"))


@celery_app.task(name=SHARD_TASK, bind=True, ignore_result=False, max_retries=SHARD_ATTEMPTS)
def sensitivity_shard_task(self: Any, job_id: int) -> str:
    """One shard of a sharded sweep (jobs.shards): a header task of its chord, so its result is stored; a failed
    shard is sent again alone (Celery's retry, the same task id: the chord waits for it)."""
    from worker.bodies.sweep_shards import run_shard, shard_started

    status, again = run_shard(job_id, body_for("sensitivity"), worker=str(self.request.hostname or "worker"))
    if again:
        raise self.retry(countdown=1)
    if status == "skipped" and shard_started(job_id):  # a second delivery (Redis brings a long task back): only the
        raise Ignore()  # one that ran it counts for the chord, or its callback would fire while the shard still runs
    return status


@celery_app.task(name=MERGE_TASK, ignore_result=False)
def sensitivity_merge_task(parent_id: int) -> str:
    """The chord's callback: the shards' rows merged into the sweep's (worker.bodies.sweep_shards.merge)."""
    from worker.bodies.sweep_shards import merge

    status = merge(parent_id)
    settings = get_settings()
    if settings.mlflow_tracking_uri:  # the sweep itself is a run too (each shard was one, by worker.runner)
        from worker.mlflow_log import log_finished_job

        log_finished_job(parent_id, settings)
    return status


_NODE: dict[str, str] = {}  # this process's Celery node name, once ready


def _consumed_queues(sender: Any) -> list[str]:
    """The queues this worker consumes (-Q), else the configured ones."""
    try:
        consume = sender.app.amqp.queues.consume_from
        if consume:
            return list(consume)
    except AttributeError:
        pass
    return get_settings().queues


@worker_ready.connect
def _on_worker_ready(sender: Any = None, **_kwargs) -> None:
    """Sweep now and every store.repo.beat_interval_s from a timer thread (worker.runner.start_sweeping: a job whose
    worker died is failed with no page open), remove abandoned intake folders, record this worker, beat."""
    sweep()
    start_sweeping()
    sweep_leftovers()
    name = getattr(sender, "hostname", None) or f"{os.getpid()}@{socket.gethostname()}"
    queues = _consumed_queues(sender)
    try:
        presence.announce(name, queues)
    except Exception:  # being listed is a convenience: the worker works without it
        presence.log.exception("could not record worker %s in the store", name)
    presence.start_heartbeat(name, queues)
    _NODE["name"] = name


@worker_shutdown.connect
def _on_worker_shutdown(**_kwargs) -> None:
    if "name" in _NODE:
        presence.forget(_NODE["name"])
