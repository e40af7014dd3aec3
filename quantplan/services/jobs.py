"""Jobs as stored: listing, cancelling, retrying, and what each works on in a few words."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from typing import Any

from jobs.progress import ETA_MARK
from jobs.specs import read_params
from quantplan.services import access
from quantplan.services.deployment import settings
from quantplan.services.errors import Refused
from quantplan.services.models import list_models
from quantplan.services.plans import gpus_label
from quantplan.services.queue import submit
from store import removal, repo
from store.db import session_scope
from store.records import JobRecord


def list_jobs(limit: int = 100, kind: str | Sequence[str] | None = None, model_id: int | None = None,
              status: Sequence[str] | None = None, offset: int = 0) -> list[JobRecord]:
    """Jobs newest first, ``limit`` of them from ``offset``, of ``kind`` / ``model_id`` / ``status`` where given."""
    with session_scope(settings()) as s:
        return repo.list_jobs(s, limit=limit, kind=kind, model_id=model_id, status=status, offset=offset)


def count_jobs(kind: str | Sequence[str] | None = None, status: Sequence[str] | None = None) -> int:
    """How many jobs there are of ``kind`` / ``status`` where given."""
    with session_scope(settings()) as s:
        return repo.count_jobs(s, kind=kind, status=status)


def get_job(job_id: int) -> JobRecord:
    """One job; store.repo.NotFound (a LookupError) for an unknown id."""
    with session_scope(settings()) as s:
        return repo.get_job(s, job_id)


def cancel_job(job_id: int) -> JobRecord:
    """Cancel a queued job at once, or ask a running one to stop at its next check (store.repo.request_cancel).
    A member cancels their own jobs, an admin anyone's (access.Forbidden otherwise); another's is audited."""
    actor = access.require("cancel_own")
    with session_scope(settings()) as s:
        job = repo.get_job(s, job_id)
        if job.requested_by != actor.name:
            access.require("cancel_any")
            access.audit("cancel-job", f"job #{job.id} {job.kind} of {job.requested_by}", session=s)
        return repo.request_cancel(s, job_id)


def retry_refusal(job: JobRecord) -> str | None:
    """Why ``job`` cannot be queued again (:func:`retry_job`), or None where it can: the Jobs page offers no button
    that could only answer with this."""
    if job.status not in ("failed", "cancelled"):
        return f"job #{job.id} is {job.status}: only a failed or cancelled job is queued again"
    if job.kind == "register" and job.params.get("cleanup_dir"):
        return f"job #{job.id} registered an upload whose staged copy is gone: upload the file again"
    removed = job.params.get(repo.REMOVED_MODEL_KEY)
    if removed or (job.kind in ("calibrate", "score", "sensitivity") and job.model_id is None):
        which = f"model {removed}" if removed else "model"
        return f"job #{job.id}'s {which} was removed: there is nothing to run it on"
    if job.kind == "score" and "scheme" not in job.params and job.plan_id is None:
        return f"job #{job.id} scored a plan that was removed"
    if job.model_id is not None:
        with session_scope(settings()) as s:  # marked removed: its files are gone, its history kept
            gone = removal.removal_of(s, job.model_id) and removal.refuse_removed(repo.get_model(s, job.model_id),
                                                                                 f"job #{job.id}")
        if gone:
            return gone
    return None


def retry_job(job_id: int) -> JobRecord:
    """Queue a failed or cancelled job again: same kind, parameters, model and plan, asked by this user.

    Refused, with the reason, for a job still queued / running / done, an upload whose staged copy is
    gone, and a job whose model or plan was removed since."""
    job = get_job(job_id)
    if refusal := retry_refusal(job):
        raise Refused(refusal)
    # its spec's JSON: an older version's row (where 0 meant the default) is queued as what it meant
    params = {k: v for k, v in read_params(job.kind, job.params).to_params().items() if k != "user"}
    return submit(job.kind, params, model_id=job.model_id, plan_id=job.plan_id)


def silent_note(job: JobRecord, now: dt.datetime | None = None) -> str | None:
    """A warning for a running job that missed two heartbeats (its worker may have died), else None."""
    silent = job.silent_seconds(now)
    if silent is None or silent < 2 * repo.JOB_HEARTBEAT_S:
        return None
    return (f"No heartbeat from {job.worker_host or 'its worker'} for {silent:.0f} s (a running job sends one every "
            f"{repo.JOB_HEARTBEAT_S:.0f} s): its worker may have stopped. The job is marked failed after "
            f"{settings().heartbeat_stale_s} s without one; queue it again then.")


def sweep_stale() -> list[int]:
    """Fail the running jobs whose heartbeat is older than QUANTPLAN_HEARTBEAT_STALE_S; their ids."""
    s = settings()
    with session_scope(s) as session:
        return repo.sweep_stale_jobs(session, stale_after_s=s.heartbeat_stale_s)


def jobs_what(jobs: Iterable[JobRecord]) -> dict[int, str]:
    """:func:`job_what` of each job by id, the labels of the plans they point at read in one query (a table of jobs
    redrawn every few seconds)."""
    jobs = list(jobs)
    with session_scope(settings()) as s:
        labels = repo.plan_labels(s, {j.plan_id for j in jobs if j.plan_id is not None})
    return {j.id: job_what(j, labels) for j in jobs}


def jobs_model(jobs: Iterable[JobRecord]) -> dict[int, str]:
    """The model each job ran on, by job id: its name, "NAME (removed)" for a model removed since, "" for none."""
    names: dict[int | None, str] = {m.id: m.name + (" (removed)" if m.removed else "")
                                    for m in list_models(include_removed=True)}
    out = {}
    for j in jobs:
        removed = j.params.get(repo.REMOVED_MODEL_KEY)
        out[j.id] = names.get(j.model_id) or (f"{removed} (removed)" if removed else "")
    return out


def job_what(job: JobRecord, plan_labels: dict[int, str] | None = None) -> str:
    """What a job works on, in a few words, from its parameters: "FP8_DYNAMIC + KV FP8 · 16 × 256",
    "plan my-plan v3", "INT8_W8A8 sweep", "cuda M 1,16". ``plan_labels``: the labels of plans by id, read already
    (:func:`jobs_what`); a removed plan is '#id'."""
    from quantcore.planning.plans import kv_label

    p: dict[str, Any] = job.params or {}
    parts: list[str] = []
    if job.kind in ("score", "sensitivity"):
        plan_file: dict[str, Any] = p["plan"] if isinstance(p.get("plan"), dict) else {}
        if job.plan_id is not None and plan_labels is None:
            return jobs_what([job])[job.id]
        label = (plan_labels or {}).get(job.plan_id or 0) or f"#{job.plan_id}"
        what = p.get("scheme") or (f"plan {label}" if job.plan_id else
                                   f"plan {plan_file.get('name') or 'file'}" if plan_file else "")
        kv = p.get("kv_cache") or plan_file.get("kv_cache")
        if kv and kv != "AUTO":
            what += f" + KV {kv_label({'kv_cache': kv, 'kv_cache_skip': plan_file.get('kv_cache_skip')})}"
        if p.get("kv_sweep"):
            what = f"KV {p['kv_sweep']}"
        tp = p.get("tensor_parallel") or plan_file.get("tensor_parallel")  # the job's replaces the plan file's
        ep = p.get("expert_parallel") if p.get("tensor_parallel") else plan_file.get("expert_parallel")
        gpus = f" on {gpus_label(int(tp), bool(ep))}" if tp is not None and str(tp) != "1" else ""
        parts.append(what + (" sweep" if job.kind == "sensitivity" else "") + gpus)
    if job.kind == "register":  # which upload or folder, so a failed one is told apart from another
        source = "the demo" if p.get("demo") else (p.get("source_name") or p.get("source") or "")
        parts.append(f"{source} as {p['name']}" if p.get("name") and source else source)
    if job.kind in ("score", "sensitivity", "calibrate") and p.get("samples") and p.get("seq_len"):
        parts.append(f"{p['samples']} × {p['seq_len']}")
    if job.kind == "bench":
        parts.append(" ".join(x for x in (p.get("device") or "", f"M {','.join(map(str, p['m']))}" if p.get("m")
                                          else "") if x))
        if paths := p.get("paths"):  # a chosen subset (all paths when absent)
            parts.append(", ".join(paths) if len(paths) <= 3 else f"{len(paths)} paths")
    return " · ".join(x for x in parts if x)


def jobs_by_id(ids: Iterable[int]) -> dict[int, JobRecord]:
    """The jobs of ``ids`` that still exist, by id (a table of scores names who asked for each and where it ran)."""
    out: dict[int, JobRecord] = {}
    with session_scope(settings()) as s:
        for i in set(ids):
            try:
                out[i] = repo.get_job(s, i)
            except LookupError:  # removed since: its row says nothing more
                pass
    return out


def finished_runs(kind: str, device: str, limit: int = 50) -> list[JobRecord]:
    """The newest succeeded jobs of ``kind`` that ran on ``device`` ("cpu", "cuda": the start of the device the
    worker wrote, e.g. "cuda (NVIDIA H100)"), newest first: what a form's estimate of a new job's time is measured
    on (app.forms)."""
    done = list_jobs(limit=limit * 4, kind=kind, status=("succeeded",))
    return [j for j in done if (j.device or "").startswith(device) and j.run_seconds() is not None][:limit]


def duration_text(seconds: float | None) -> str:
    """"42 s" / "3 min 5 s" / "1 h 12 min"; "" for none."""
    if seconds is None:
        return ""
    s = round(seconds)
    if s < 90:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def progress_cell(job: JobRecord, now: dt.datetime | None = None) -> str:
    """A job's progress as a table cell: an ended job's final state ("done in 3 min 5 s", "failed after 12 s",
    "cancelled"), never the partial fraction it stopped at; a running one's percent and what it says (its count
    and time left, worker.runner / jobs.progress: "40% · about 40 s left · scoring: 12 of 32 sequences"); a queued
    one's wait."""
    ran = duration_text(job.run_seconds(now))
    if job.status == "succeeded":
        return f"done in {ran}" if ran else "done"
    if job.status == "failed":
        return f"failed after {ran}" if ran else "failed"
    if job.status == "cancelled":
        return f"cancelled after {ran}" if ran else "cancelled before it started"
    if job.status == "queued":
        return "waiting for a worker"
    said, mark, left = job.progress_text.partition(ETA_MARK)  # the time left first: a narrow cell keeps it in view
    return f"{job.progress:.0%} · about {left} · {said}" if mark else f"{job.progress:.0%} · {said}"
