"""Queue a job: check its parameters against its spec, write its row, then send its Celery task by name.

Torch-free and worker-free: the pages and the CLI queue jobs through here; the worker uses
:func:`create_local_job` for a job it runs itself first (a score's missing calibration).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from celery import Celery, chord
from sqlalchemy.orm import Session

from jobs.broker import make_celery
from jobs.errors import InvalidJob
from jobs.routing import LOCAL_QUEUE, NEEDS_CAUSAL_LM, queue_for, task_name
from jobs.shards import MERGE_TASK, SHARD_TASK, shard_count
from jobs.specs import LIMITS, JobSpec, SensitivitySpec, read_params
from store import repo
from store import shards as shard_rows
from store.db import session_scope
from store.records import JobRecord
from store.removal import refuse_removed
from store.settings import Settings, get_settings

_CLIENTS: dict[str, Celery] = {}


def celery_client(settings: Settings | None = None) -> Celery:
    """The sending Celery app of the settings' broker (one per broker URL in this process)."""
    s = settings or get_settings()
    key = str(s.broker_url)
    if key not in _CLIENTS:
        _CLIENTS[key] = make_celery(s)
    return _CLIENTS[key]


def refuse_unfit(session: Session, kind: str, model_id: int | None) -> None:
    """Refuse (InvalidJob, a ValueError; nothing queued) a job its model cannot run: a score or sensitivity sweep
    of a model that predicts no next token (an encoder), which would only fail on the worker; any job of a removed
    model (store.removal: its files are gone)."""
    if model_id is None:
        return
    model = repo.get_model(session, model_id)
    if (refusal := refuse_removed(model, f"a {kind} job")) is not None:
        raise InvalidJob(refusal)
    if kind not in NEEDS_CAUSAL_LM:
        return
    if model.causal_lm is False:
        raise InvalidJob(
            f"{model.name} is a {model.architecture} ({model.model_type}), not a causal language model: a {kind} "
            "job compares its next-token distributions with the unquantized model's, and an encoder has none. "
            "Its calibration, outliers, plans and export work; for KL scoring register a ...ForCausalLM checkpoint"
        )


def job_params(kind: str, params: Mapping[str, Any] | JobSpec) -> dict[str, Any]:
    """The JSON a job row stores: a spec's :meth:`~jobs.specs.JobSpec.to_params`, or a dict as given once its
    kind's spec accepts it (InvalidJob with the reason otherwise: nothing is written)."""
    if isinstance(params, JobSpec):
        if params.kind != kind:
            raise InvalidJob(f"a {params.kind} job's parameters were given for a {kind} job")
        return params.to_params()
    for key, value in params.items():  # a row of an older version read 0 as unset; a job asked for now may not
        if key in LIMITS and isinstance(value, int | float) and not isinstance(value, bool) and value == 0:
            LIMITS[key].check(value, kind)
    read_params(kind, params)  # checked; stored as given, so a job queued again is the same job
    return dict(params)


def submit_job(kind: str, params: Mapping[str, Any] | JobSpec, *, model_id: int | None = None,
               plan_id: int | None = None, user: str | None = None, settings: Settings | None = None) -> JobRecord:
    """Write a queued job row and send its task by name to the job's queue (jobs.routing); returns the job.
    ``params``: the job's spec, or its JSON dict (checked by the spec of ``kind``). InvalidJob, nothing queued,
    for parameters out of range or a model that cannot run the job."""
    s = settings or get_settings()
    stored = job_params(kind, params)
    queue = queue_for(kind, stored)
    name = task_name(kind)
    if kind == SensitivitySpec.kind:  # a sweep over several workers: one chord of shard tasks (jobs.shards)
        sweep = SensitivitySpec.from_params(stored)
        count = shard_count(sweep, queue, s)
        if count > 1:
            return submit_sharded(sweep, count, queue=queue, model_id=model_id, user=user, settings=s)
    with session_scope(s) as session:
        refuse_unfit(session, kind, model_id)
        job = repo.create_job(session, kind=kind, params=stored, queue=queue, user=user or s.user,
                              model_id=model_id, plan_id=plan_id)
    res = celery_client(s).send_task(name, args=[job.id], queue=queue)
    with session_scope(s) as session:
        repo.set_celery_task_id(session, job.id, res.id)
        return repo.get_job(session, job.id)


def submit_sharded(spec: SensitivitySpec, count: int, *, queue: str, model_id: int | None, user: str | None,
                   settings: Settings | None = None) -> JobRecord:
    """Write the sweep's parent row and ``count`` shard rows, then send the chord (a group of shard tasks, the merge
    task as its callback) to ``queue``; the parent job. ``count`` >= 2."""
    if count < 2:
        raise ValueError(f"a sharded sweep needs two shards or more; got {count}")
    s = settings or get_settings()
    params = spec.with_changes(shards=count).to_params()
    with session_scope(s) as session:
        refuse_unfit(session, spec.kind, model_id)
        parent = repo.create_job(session, kind=spec.kind, params=params, queue=queue, user=user or s.user,
                                 model_id=model_id)
        children = []
        for i in range(count):
            child = repo.create_job(session, kind=spec.kind, params={**params, "shard": [i, count]}, queue=queue,
                                    user=user or s.user, model_id=model_id)
            shard_rows.add_shard(session, parent_id=parent.id, job_id=child.id, shard=i, shards=count)
            children.append(child.id)
    app = celery_client(s)
    header = [app.signature(SHARD_TASK, args=[job_id], queue=queue, immutable=True) for job_id in children]
    callback = app.signature(MERGE_TASK, args=[parent.id], queue=queue, immutable=True)
    result = chord(header)(callback)
    group = result.parent
    with session_scope(s) as session:
        repo.set_celery_task_id(session, parent.id, result.id)
        for job_id, sent in zip(children, group.results if group is not None else [], strict=False):
            repo.set_celery_task_id(session, job_id, sent.id)
        return repo.get_job(session, parent.id)


def create_local_job(kind: str, params: Mapping[str, Any] | JobSpec, *, model_id: int | None = None,
                     plan_id: int | None = None, user: str | None = None,
                     settings: Settings | None = None) -> JobRecord:
    """A job row for a run in this process (CLI --local, a worker's own first calibration): the same row as
    :func:`submit_job` writes, on queue 'local', sent to no broker."""
    s = settings or get_settings()
    stored = job_params(kind, params)
    with session_scope(s) as session:
        refuse_unfit(session, kind, model_id)
        return repo.create_job(session, kind=kind, params=stored, queue=LOCAL_QUEUE, user=user or s.user,
                               model_id=model_id, plan_id=plan_id)


def sweep_stale(settings: Settings | None = None) -> list[int]:
    """Fail the jobs nothing runs any more (store.repo.sweep_stale_jobs at QUANTPLAN_HEARTBEAT_STALE_S): running
    ones whose heartbeat stopped, --local ones whose process died before they started; their ids."""
    s = settings or get_settings()
    with session_scope(s) as session:
        return repo.sweep_stale_jobs(session, stale_after_s=s.heartbeat_stale_s)


def wait_for(job_id: int, *, timeout_s: float | None = None, poll_s: float = 0.5,
             on_update: Callable[[JobRecord], Any] | None = None, settings: Settings | None = None) -> JobRecord:
    """Poll a job until it finishes, or until ``timeout_s`` passes (None: no limit); on_update(job) after each
    poll. The job as last read: finished, or (past the timeout) still queued or running.

    The wait sweeps stale jobs (:func:`sweep_stale`) when it starts and every store.repo.beat_interval_s while it
    waits, so a job whose worker was killed ends failed within QUANTPLAN_HEARTBEAT_STALE_S plus that interval of its
    last heartbeat even where no worker is left to sweep: the wait never outlives a job nothing runs."""
    s = settings or get_settings()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    sweep_every = repo.beat_interval_s(s.heartbeat_stale_s)
    next_sweep = time.monotonic()
    while True:
        if time.monotonic() >= next_sweep:
            sweep_stale(s)
            next_sweep = time.monotonic() + sweep_every
        with session_scope(s) as session:
            job = repo.get_job(session, job_id)
        if on_update is not None:
            on_update(job)
        if job.finished:
            return job
        if deadline is not None and time.monotonic() > deadline:
            return job
        time.sleep(poll_s)


__all__ = ["celery_client", "create_local_job", "job_params", "refuse_unfit", "submit_job", "sweep_stale", "wait_for"]
