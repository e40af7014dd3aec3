"""Every finished job also logged as an MLflow run, where a team already uses MLflow (QUANTPLAN_MLFLOW_TRACKING_URI).

Called by worker.runner once a job has its final status (succeeded, failed or cancelled), in the process that ran
it. The run, in experiment QUANTPLAN_MLFLOW_EXPERIMENT (created where missing), carries:

- parameters: the job's own (its spec's JSON; a plan file's dict goes as an artifact instead), values as JSON text
  cut at MLflow's 6,000 characters;
- metrics: every number of the job's result summary (nested keys joined with ``.``), a score's figures (KL mean,
  percentiles and standard error, top-1 agreement, perplexities, the predicted KL) and ``duration_s``;
- artifacts: ``result.json`` (the job's result summary), and for a job with a plan (a stored version, a plan file,
  one scheme for every layer) ``plan.yaml`` (quantplan's plan file) and ``recipe.yaml`` (the llm-compressor recipe
  the Plans page exports; where the plan cannot be one, ``recipe-not-exported.txt`` says why);
- tags: ``quantplan.model``, ``quantplan.plan``, ``quantplan.person`` (also ``mlflow.user``), the job's id, kind,
  status, device and worker, and a failed job's error.

Logging never fails a job: any error (mlflow not installed, the server down) is logged and added to the job's
message ("· not logged to MLflow: ..."). mlflow-skinny (``pip install quantplan[mlflow]``) is enough.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from store import models as m
from store import repo
from store.db import session_scope
from store.records import JobRecord, ModelRecord, PlanRecord, ScoreRecord
from store.settings import Settings

log = logging.getLogger(__name__)

MAX_PARAM_CHARS = 6000  # MLflow's limit on a parameter's value
MAX_TAG_CHARS = 5000
RUN_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
SCORE_METRICS = ("tokens", "kl_mean", "kl_p50", "kl_p90", "kl_p99", "kl_max", "top1_agree", "ppl_ref", "ppl",
                 "predicted_kl", "kl_mean_err", "top1_agree_err", "ln_ppl_ratio", "ln_ppl_ratio_err", "dp_mean")
_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


def log_finished_job(job_id: int, settings: Settings) -> str | None:
    """Log finished job ``job_id`` as an MLflow run; its run id. None where no tracking URI is set, the job is not
    finished, or logging failed (then said in the job's message and the worker's log). Never raises."""
    uri = settings.mlflow_tracking_uri
    if not uri:
        return None
    try:
        with session_scope(settings) as s:
            job = repo.get_job(s, job_id)
            if not job.finished:
                return None
            model = repo.get_model(s, job.model_id) if job.model_id is not None else None
            plan = repo.get_plan(s, job.plan_id) if job.plan_id is not None else None
            score = None
            if job.kind == "score" and job.status == "succeeded":
                try:
                    score = repo.get_score(s, job_id)
                except repo.NotFound:
                    score = None
        return _log(uri, settings, job, model, plan, score)
    except Exception as exc:  # never the job's failure: said beside its outcome
        reason = (f"mlflow is not installed on this worker ({exc}); pip install 'quantplan[mlflow]'"
                  if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}")
        log.warning("job %s: not logged to MLflow at %s: %s", job_id, uri, reason)
        _say_in_message(settings, job_id, f"not logged to MLflow: {reason}")
        return None


def _say_in_message(settings: Settings, job_id: int, text: str) -> None:
    try:
        with session_scope(settings) as s:
            row = s.get(m.Job, job_id)
            if row is not None:
                row.message = f"{row.message or row.status} · {text}"[:4000]
    except Exception:  # the database itself is gone: the worker's log line above is what is left
        log.exception("job %s: could not record the MLflow failure in its message", job_id)


def _ms(t: Any) -> int | None:
    return None if t is None else int(t.timestamp() * 1000)


def _key(name: str) -> str:
    return _KEY.sub("_", name)[:250]


def _numbers(prefix: str, value: Any, out: dict[str, float]) -> None:
    """Every finite number of ``value`` (dicts walked, keys joined with '.') into ``out``."""
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        if value == value and abs(value) != float("inf"):
            out[_key(prefix)] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _numbers(f"{prefix}.{k}" if prefix else str(k), v, out)


def job_params(job: JobRecord) -> dict[str, str]:
    """The job's parameters as MLflow parameters (strings, cut at MLflow's limit); a plan file's dict left out."""
    out = {}
    for k, v in sorted((job.params or {}).items()):
        if k in ("user", "plan") or v is None:
            continue
        text = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
        out[_key(k)] = text[:MAX_PARAM_CHARS]
    return out


def job_metrics(job: JobRecord, score: ScoreRecord | None) -> dict[str, float]:
    """The job's numbers: its result summary's, a score's headline figures, and ``duration_s``."""
    out: dict[str, float] = {}
    _numbers("", job.result or {}, out)
    if score is not None:
        for name in SCORE_METRICS:
            value = getattr(score, name, None)
            if value is not None:
                _numbers(f"score.{name}", value, out)
    if job.started_at is not None and job.finished_at is not None:
        out["duration_s"] = max(0.0, (job.finished_at - job.started_at).total_seconds())
    return out


def job_tags(job: JobRecord, model: ModelRecord | None, plan: PlanRecord | None) -> dict[str, str]:
    """model / plan / person, and the job's id, kind, status, device, worker and error."""
    params = job.params or {}
    model_name = model.name if model is not None else str(params.get(repo.REMOVED_MODEL_KEY) or "")
    plan_file = params.get("plan") if isinstance(params.get("plan"), dict) else {}
    # a stored version's label, a plan file's name, or the one scheme every layer gets
    plan_name = plan.label if plan is not None else str(plan_file.get("name") or params.get("scheme") or "")
    tags = {"quantplan.job": str(job.id), "quantplan.kind": job.kind, "quantplan.status": job.status,
            "quantplan.model": model_name, "quantplan.plan": plan_name,
            "quantplan.person": job.requested_by or "", "mlflow.user": job.requested_by or "",
            "quantplan.device": job.device or "", "quantplan.worker": job.worker_host or "",
            "mlflow.runName": f"{job.kind} #{job.id}" + (f" {plan_name}" if plan_name else "")}
    if job.error:
        tags["quantplan.error"] = job.error
    return {k: v[:MAX_TAG_CHARS] for k, v in tags.items() if v}


def plan_files(job: JobRecord, model: ModelRecord | None, plan: PlanRecord | None,
               artifact_dir: Path | None = None) -> dict[str, str]:
    """{artifact name: text}: the plan file and its llm-compressor recipe, for a job with a plan; {} otherwise."""
    from quantcore.planning.plans import PlanSpec, plan_from_scheme

    if model is None:
        return {}
    names = [str(lin["name"]) for lin in model.linears]
    asked = (job.params or {}).get("plan")
    if isinstance(asked, dict):
        spec = PlanSpec.from_dict(asked)
    elif plan is not None:
        spec = PlanSpec.from_dict(plan.body)
    elif job.kind == "score" and (job.params or {}).get("scheme"):
        spec = plan_from_scheme(str(job.params["scheme"]), names, model=model.name)
    else:
        return {}
    files = {"plan.yaml": spec.to_yaml()}
    try:
        files["recipe.yaml"] = _recipe(spec, model, names, artifact_dir)
    except Exception as exc:  # a plan no recipe can carry: said in its place
        files["recipe-not-exported.txt"] = f"{type(exc).__name__}: {exc}\n"
    return files


def _recipe(spec: Any, model: ModelRecord, names: list[str], artifact_dir: Path | None) -> str:
    """The llm-compressor recipe of ``spec`` for ``model``, as quantplan.services.exchange exports it."""
    from quantcore.export import llmcompressor
    from quantcore.models.architectures import get_architecture
    from quantcore.planning.plans import resolve_plan

    widths = None
    if spec.rotation is not None:
        from quantcore.export.spinquant import widths_from_linears
        from quantcore.models.parallel import stored_heads

        heads = stored_heads(model.attention_heads, (artifact_dir or Path(".")) / model.path)
        widths = widths_from_linears(model.linears, heads.head_dim if heads is not None else None)
    return llmcompressor.to_llmcompressor_recipe(resolve_plan(spec, names), layer_names=names,
                                                 mlp_norm=get_architecture(model.model_type).mlp_norm,
                                                 kv_cache=spec.kv_cache, rotation=spec.rotation,
                                                 rotation_widths=widths)


def _experiment(client: Any, settings: Settings) -> str:
    """The id of experiment QUANTPLAN_MLFLOW_EXPERIMENT, created where missing (a local store's artifacts under
    the artifact folder, which every worker can write)."""
    name = settings.mlflow_experiment
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    uri = str(settings.mlflow_tracking_uri)
    location = None
    if uri.startswith(("sqlite:", "file:")) or "://" not in uri:
        location = (Path(str(settings.artifact_dir)).resolve() / "mlflow").as_uri()
    try:
        return str(client.create_experiment(name, artifact_location=location))
    except Exception:  # another worker created it meanwhile
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def _log(uri: str, settings: Settings, job: JobRecord, model: ModelRecord | None, plan: PlanRecord | None,
         score: ScoreRecord | None) -> str:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(_experiment(client, settings), start_time=_ms(job.started_at or job.created_at),
                            tags=job_tags(job, model, plan))
    run_id = run.info.run_id
    now = int(time.time() * 1000)
    params = [Param(k, v) for k, v in job_params(job).items()]
    metrics = [Metric(k, v, _ms(job.finished_at) or now, 0) for k, v in job_metrics(job, score).items()]
    for i in range(0, max(len(params), len(metrics)), 100):  # MLflow takes at most 100 parameters a batch
        client.log_batch(run_id, metrics=metrics[i:i + 100], params=params[i:i + 100])
    client.log_text(run_id, json.dumps(job.result or {}, indent=2, sort_keys=True, default=str) + "\n",
                    "result.json")
    for name, text in plan_files(job, model, plan, Path(str(settings.artifact_dir))).items():
        client.log_text(run_id, text, name)
    client.set_terminated(run_id, RUN_STATUS.get(job.status, "FINISHED"), end_time=_ms(job.finished_at) or now)
    log.info("job %s logged to MLflow as run %s (%s)", job.id, run_id, uri)
    return str(run_id)
