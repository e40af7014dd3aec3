"""A sharded sensitivity sweep on the worker: one shard's run (its part of the units, its progress into the sweep's,
run again alone when it fails) and the chord's callback that merges the shards into the one sweep (jobs.shards).

Every shard computes what the whole sweep computes before its units (the same evaluation tokens, the reference
log-probs, read from the model's cache folder when a shard or an earlier score stored them, the same calibration,
Hessians and AWQ scales over every layer) and then sweeps only its units: each unit's KL, top-1 agreement and SQNR
depend on that unit alone (the model is restored exactly after every unit), so the merged rows are the unsharded
sweep's rows, in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from jobs.shards import SHARD_ATTEMPTS, merged_rows, shard_part
from jobs.specs import SensitivitySpec
from store import repo
from store import shards as shard_rows
from store.db import session_scope
from store.settings import Settings, get_settings
from worker.runner import Outcome, run_job

log = logging.getLogger(__name__)

T = TypeVar("T")


def my_part(asked: SensitivitySpec, units: Sequence[T]) -> list[T]:
    """The units this job sweeps: all of them, or its shard's part (jobs.shards.shard_part)."""
    return list(units) if asked.shard is None else shard_part(units, *asked.shard)


def shard_outcome(asked: SensitivitySpec, result: dict[str, Any], rows: list[dict[str, Any]],
                  labels: Sequence[str]) -> Outcome:
    """A shard's outcome: its rows, each with its ``unit_index`` among ``labels`` (the whole sweep's units in model
    order), in its result for the merge; nothing written to the sensitivity table."""
    index = {label: i for i, label in enumerate(labels)}
    shard, count = asked.shard or (0, 1)
    rows = [{**r, "unit_index": index[r["layer"]]} for r in rows]
    summary = {k: v for k, v in result.items() if k not in ("top", "units")}
    return Outcome(result={**summary, "shard": [shard, count], "units": len(rows), "rows": rows},
                   message=f"shard {shard + 1} of {count}: {len(rows)} of {len(labels)} units swept")


def run_shard(job_id: int, body: Any, worker: str, settings: Settings | None = None) -> tuple[str, bool]:
    """Run the shard ``job_id`` on ``worker`` (this Celery node's name), its progress aggregated into its sweep's:
    (its final status, whether to run it again). A failed shard is put back on the queue while it has attempts left
    (jobs.shards.SHARD_ATTEMPTS) and its sweep was not cancelled; one whose worker was lost the stale-job sweep
    queues again (store.repo.sweep_stale_jobs), and the delivery that finds it so runs it."""
    s = settings or get_settings()
    with session_scope(s) as session:
        shard = shard_rows.shard_of(session, job_id)
        if shard is None:
            raise LookupError(f"job {job_id} is no sweep's shard")
        # a delivery that finds its shard running elsewhere or ended runs nothing: it is no attempt
        attempts = (shard_rows.count_attempt(session, job_id, worker) if shard.job.status == "queued"
                    else shard.attempts)

    def to_parent(fraction: float, message: str) -> None:
        with session_scope(s) as session:
            job = repo.get_job(session, job_id)
            shard_rows.report_parent(session, shard.parent_id, worker_host=f"{shard.shards} shards",
                                     device=job.device or "cpu", torch_version=job.torch_version or "",
                                     message=f"shard {shard.shard + 1} of {shard.shards} ({worker}): {message}")

    status = run_job(job_id, body, settings=s, on_progress=to_parent)
    if status == "skipped" and attempts < SHARD_ATTEMPTS:  # run_job's sweep may just have found it lost and
        with session_scope(s) as session:  # queued it again (store.repo.sweep_stale_jobs): this delivery runs it
            requeued = repo.get_job(session, job_id).status == "queued"
        if requeued:
            return run_shard(job_id, body, worker, s)
    if status != "failed" or attempts >= SHARD_ATTEMPTS:
        return status, False
    with session_scope(s) as session:
        job = repo.get_job(session, job_id)
        again = shard_rows.requeue(session, job_id, f"attempt {attempts} failed ({job.error or 'no message'}); "
                                                    "queued again")
    if again:
        log.warning("sweep %s: shard %s (job %s) failed, attempt %s of %s; queued again alone", shard.parent_id,
                    shard.shard + 1, job_id, attempts, SHARD_ATTEMPTS)
    return status, again


def shard_started(job_id: int, settings: Settings | None = None) -> bool:
    """Some delivery of the shard's task started it (a delivery that finds it so runs nothing: it is not the one
    whose end the chord waits for); False for a shard cancelled before any worker took it."""
    with session_scope(settings or get_settings()) as session:
        return repo.get_job(session, job_id).started_at is not None


def merge(parent_id: int, settings: Settings | None = None) -> str:
    """The chord's callback: once every shard ended, the sweep ``parent_id`` gets the merged rows and succeeds, or
    ends cancelled (it, or a shard, was cancelled) or failed (a shard failed on its last attempt, named). Its
    final status; a sweep already finished is left alone."""
    s = settings or get_settings()
    with session_scope(s) as session:
        parent = repo.get_job(session, parent_id)
        shards = shard_rows.shards_of(session, parent_id)
        if parent.finished:
            return parent.status
        if parent.status == "queued":  # every shard ended before one reported progress (all cancelled, say)
            repo.mark_running(session, parent_id, worker_host=f"{len(shards)} shards", device="-",
                              torch_version="")
        ended = {sh.job.status for sh in shards}
        if parent.cancel_requested or "cancelled" in ended:
            repo.finish_job(session, parent_id, status="cancelled", message="by request, while its shards ran")
            return "cancelled"
        failed = [sh for sh in shards if sh.job.status != "succeeded"]
        if failed:
            first = failed[0]
            repo.finish_job(session, parent_id, status="failed", message="failed",
                            error=f"shard {first.shard + 1} of {first.shards} (job {first.job.id}) "
                                  f"{first.job.status} after {first.attempts} attempt(s): "
                                  f"{first.job.error or first.job.message}")
            return "failed"
        results = [sh.job.result or {} for sh in shards]
        try:
            rows = merged_rows([r.get("rows") or [] for r in results])
        except ValueError as exc:
            repo.finish_job(session, parent_id, status="failed", message="failed", error=str(exc))
            return "failed"
        summary = next((r for r in results if r.get("rows")), results[0])
        result = {k: v for k, v in summary.items() if k not in ("rows", "shard")}
        hosts = sorted({sh.worker or sh.job.worker_host or "unknown" for sh in shards})
        result.update(units=len(rows), top=[{"layer": r["layer"], "kl_mean": r["kl_mean"]} for r in rows[:5]],
                      shards=len(shards), workers=hosts)
        name = str(result.get("scheme"))
        assert parent.model_id is not None, "a sensitivity sweep has a model"
        repo.save_sensitivity(session, job_id=parent_id, model_id=parent.model_id, scheme=name, rows=rows)
        repo.finish_job(session, parent_id, status="succeeded", result=result,
                        message=f"{name}: {len(rows)} units swept in {len(shards)} shards on "
                                f"{len(hosts)} worker(s) ({', '.join(hosts)})")
    return "succeeded"


__all__ = ["merge", "my_part", "run_shard", "shard_outcome", "shard_started"]
