"""Queue a job: write its row, then send the Celery task by name (no torch, safe for the app)."""

from __future__ import annotations

import time
from typing import Any

from store import repo
from store.db import session_scope
from store.records import JobRecord
from store.settings import Settings, get_settings
from worker.celery_app import TASK_NAMES, make_celery

_CLIENTS: dict[str, Any] = {}


def celery_client(settings: Settings | None = None):
    s = settings or get_settings()
    key = str(s.broker_url)
    if key not in _CLIENTS:
        _CLIENTS[key] = make_celery(s)
    return _CLIENTS[key]


def queue_for(kind: str, params: dict[str, Any]) -> str:
    """The queue a job goes to: jobs on a CUDA device go to 'gpu' (or the device class asked for)."""
    if params.get("queue"):
        return str(params["queue"])
    device = str(params.get("device") or "cpu")
    return "gpu" if device.startswith("cuda") else "cpu"


NEEDS_CAUSAL_LM = ("score", "sensitivity")  # job kinds that compare next-token distributions


def refuse_unfit(session, kind: str, model_id: int | None) -> None:
    """Refuse (ValueError, nothing queued) a job its model cannot run: a score or sensitivity sweep of a
    model that predicts no next token (an encoder), which would only fail on the worker."""
    if model_id is None or kind not in NEEDS_CAUSAL_LM:
        return
    model = repo.get_model(session, model_id)
    if model.causal_lm is False:
        raise ValueError(
            f"{model.name} is a {model.architecture} ({model.model_type}), not a causal language model: a {kind} "
            "job compares its next-token distributions with the unquantized model's, and an encoder has none. "
            "Its calibration, outliers, plans and export work; for KL scoring register a ...ForCausalLM checkpoint"
        )


def submit_job(kind: str, params: dict[str, Any], *, model_id: int | None = None, plan_id: int | None = None,
               user: str | None = None, settings: Settings | None = None) -> JobRecord:
    """Write a queued job row and send its task; returns the job."""
    s = settings or get_settings()
    queue = queue_for(kind, params)
    with session_scope(s) as session:
        refuse_unfit(session, kind, model_id)
        job = repo.create_job(session, kind=kind, params=params, queue=queue, user=user or s.user,
                              model_id=model_id, plan_id=plan_id)
    res = celery_client(s).send_task(TASK_NAMES[kind], args=[job.id], queue=queue)
    with session_scope(s) as session:
        repo.set_celery_task_id(session, job.id, res.id)
        return repo.get_job(session, job.id)


def create_local_job(kind: str, params: dict[str, Any], *, model_id: int | None = None,
                     plan_id: int | None = None, user: str | None = None,
                     settings: Settings | None = None) -> JobRecord:
    """A job row for a run in this process (CLI --local): same row, no broker."""
    s = settings or get_settings()
    with session_scope(s) as session:
        refuse_unfit(session, kind, model_id)
        return repo.create_job(session, kind=kind, params=params, queue="local", user=user or s.user,
                               model_id=model_id, plan_id=plan_id)


def wait_for(job_id: int, *, timeout_s: float | None = None, poll_s: float = 0.5, on_update=None,
             settings: Settings | None = None) -> JobRecord:
    """Poll a job until it finishes (or timeout_s passes); on_update(job) after each poll."""
    s = settings or get_settings()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        with session_scope(s) as session:
            job = repo.get_job(session, job_id)
        if on_update is not None:
            on_update(job)
        if job.finished:
            return job
        if deadline is not None and time.monotonic() > deadline:
            return job
        time.sleep(poll_s)
