"""Celery tasks: thin shells that run a job body by job id (heavy imports live in the bodies)."""

from __future__ import annotations

from celery.signals import worker_ready

from worker import bodies
from worker.celery_app import TASK_NAMES, celery_app
from worker.runner import run_job, sweep, sweep_leftovers


@celery_app.task(name=TASK_NAMES["register"])
def register_task(job_id: int) -> str:
    return run_job(job_id, bodies.register)


@celery_app.task(name=TASK_NAMES["calibrate"])
def calibrate_task(job_id: int) -> str:
    return run_job(job_id, bodies.calibrate)


@celery_app.task(name=TASK_NAMES["score"])
def score_task(job_id: int) -> str:
    return run_job(job_id, bodies.score)


@celery_app.task(name=TASK_NAMES["sensitivity"])
def sensitivity_task(job_id: int) -> str:
    return run_job(job_id, bodies.sensitivity)


@celery_app.task(name=TASK_NAMES["bench"])
def bench_task(job_id: int) -> str:
    return run_job(job_id, bodies.bench)


@worker_ready.connect
def _on_worker_ready(**_kwargs) -> None:
    sweep()
    sweep_leftovers()
