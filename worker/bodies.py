"""Job bodies: load the job's inputs, run quantcore, hand back results to store.

Each body is a plain function of a JobContext (test it without Celery); heavy
modules (torch, transformers) are imported inside the bodies.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from store import repo
from store.db import session_scope
from worker.runner import JobContext, Outcome

# ----------------------------------------------------------------------------- shared helpers

_MODEL_CACHE: dict[tuple[str, str], tuple[Any, Any]] = {}


def resolve_device(name: str | None) -> str:
    from quantcore.errors import UnsupportedOnDevice

    device = (name or "cpu").strip()
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UnsupportedOnDevice(
                f"this worker has no CUDA device, so it cannot run a job on {device!r}; "
                "queue it on a GPU worker (queue 'gpu') or choose device 'cpu'"
            )
    elif device != "cpu":
        raise ValueError(f"unknown device {device!r}; use 'cpu' or 'cuda'")
    return device


def load_model(ctx: JobContext, model_rec, device: str):
    """The job's model (kept loaded between jobs of the same worker: one model at a time)."""
    from quantcore.models.checkpoint import load_model as qc_load

    key = (model_rec.sha256, device)
    if key not in _MODEL_CACHE:
        _MODEL_CACHE.clear()
        ctx.progress(0.01, f"loading {model_rec.name}")
        folder = Path(str(ctx.settings.artifact_dir)) / model_rec.path
        _MODEL_CACHE[key] = qc_load(folder, device=device)
        _complete_summary(ctx, model_rec, _MODEL_CACHE[key][0])
    return _MODEL_CACHE[key]


def _complete_summary(ctx: JobContext, model_rec, model) -> None:
    """A model registered before its summary kept ``attention_windows`` gets them from the loaded model, so its
    KV cache memory counts sliding windows from its next job on (registering it again would reuse the old row);
    one registered before quantplan split MoE experts gets its expert linears and routing (``moe``) so."""
    summary = model_rec.summary or {}
    fields: dict[str, Any] = {}
    if "attention_windows" not in summary:
        from quantcore.models.checkpoint import attention_windows

        fields["attention_windows"] = attention_windows(model)
    if "moe" not in summary:
        from dataclasses import asdict

        from quantcore.models.checkpoint import linear_infos
        from quantcore.models.moe import moe_summary, unsplit_experts

        fields.update(moe=moe_summary(model, model.config), unsplit_experts=unsplit_experts(model))
        if fields["moe"] is not None:
            fields["linears"] = [asdict(info) for info in linear_infos(model)]
    if fields:
        with session_scope(ctx.settings) as s:
            repo.add_model_summary_fields(s, model_rec.id, fields, replace=("linears",))


def text_path(ctx: JobContext, role: str, dataset_param: str = "dataset") -> tuple[Path, str]:
    """The text a job reads: an uploaded dataset (params[dataset_param]) or the built-in default for the role."""
    from quantcore.evaluation import text
    ref = ctx.params.get(dataset_param)
    if ref is None:
        path = text.default_calibration_text() if role == "calibration" else text.default_eval_text()
        return path, f"builtin:{path.name}"
    with session_scope(ctx.settings) as s:
        ds = repo.get_dataset(s, ref)
    path = Path(ds.path)
    if not path.is_absolute():
        path = Path(str(ctx.settings.data_dir)) / path
    return path, ds.name


def token_ids(ctx: JobContext, tokenizer, role: str, *, samples: int, seq_len: int,
              dataset_param: str = "dataset"):
    from quantcore.evaluation import text
    path, label = text_path(ctx, role, dataset_param)
    docs = text.load_documents(path)
    return text.token_batches(tokenizer, docs, n_samples=samples, seq_len=seq_len), label


def _model_record(ctx: JobContext):
    with session_scope(ctx.settings) as s:
        return repo.get_model(s, ctx.model_id)


# ----------------------------------------------------------------------------- register


def register(ctx: JobContext) -> Outcome:
    """Validate, store (content-addressed) and summarise a checkpoint; then the model row is written."""
    from quantcore.models import checkpoint
    p = ctx.params
    demo = bool(p.get("demo"))
    staging = Path(p["cleanup_dir"]) if p.get("cleanup_dir") else None
    try:
        src = checkpoint.demo_gguf_path() if demo else Path(p["source"])
        ctx.progress(0.05, f"validating {src.name}")
        sha, folder, summary = checkpoint.register_checkpoint(
            src, ctx.settings.models_dir, max_bytes=ctx.settings.upload_limit_bytes,
            cache_dir=Path(str(ctx.settings.cache_dir)),
        )
    finally:
        if staging is not None:  # an app upload: the staged copy is never needed again
            shutil.rmtree(staging, ignore_errors=True)
    kind = "demo" if demo else ("gguf" if src.suffix == ".gguf" else ("folder" if src.is_dir() else "archive"))
    name = p.get("name") or (repo.DEMO_MODEL_NAME if demo else _default_name(src, summary))
    rel = str(folder.relative_to(Path(str(ctx.settings.artifact_dir))))
    result: dict[str, Any] = {}

    def write(s: Session) -> None:
        known = repo.model_by_sha(s, sha)
        rec = known or repo.add_model(s, name=name, sha256=sha, source_kind=kind,
                                      source_name=p.get("source_name") or src.name, path=rel,
                                      summary=summary.to_dict(), user=p.get("user"))
        repo.set_job_model(s, ctx.job_id, rec.id)
        result.update(model_id=rec.id, name=rec.name, linears=len(summary.linears), already=known is not None)
        # the same content registered twice is one model: say so, under the name it has
        outcome.message = (f"already registered as {rec.name} (#{rec.id}): same checkpoint content" if known
                           else f"registered {rec.name}")

    outcome = Outcome(result=result, write=write, message=f"registered {name}")
    return outcome


def _default_name(src: Path, summary) -> str:
    stem = src.name
    for suffix in (".tar.gz", ".tgz", ".tar", ".zip", ".gguf"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    return stem or summary.architecture


# ----------------------------------------------------------------------------- calibrate

DEFAULT_CAL_SAMPLES = 32
DEFAULT_CAL_SEQ_LEN = 256


def calibrate(ctx: JobContext) -> Outcome:
    from quantcore.evaluation.calibrate import calibrate as run_calibration

    rec = _model_record(ctx)
    device = resolve_device(ctx.params.get("device"))
    model, tok = load_model(ctx, rec, device)
    samples = int(ctx.params.get("samples") or DEFAULT_CAL_SAMPLES)
    seq_len = int(ctx.params.get("seq_len") or DEFAULT_CAL_SEQ_LEN)
    ids, label = token_ids(ctx, tok, "calibration", samples=samples, seq_len=seq_len)
    ctx.progress(0.05, f"calibrating on {ids.shape[0]}×{ids.shape[1]} tokens of {label}")

    def run():
        return run_calibration(
            model, ids.to(device), batch_size=int(ctx.params.get("batch_size") or 4),
            progress=lambda f, msg: ctx.progress(0.05 + 0.9 * f, msg), should_cancel=ctx.should_cancel,
        )

    stats, kv_amax, kv_note = _with_kv_amax(model, run)
    ranked = sorted(stats.values(), key=lambda st: st.outlier_ratio, reverse=True)
    result = {
        "layers": len(stats), "tokens": int(ids.numel()), "text": label,
        "top": [{"name": st.name, "outlier_ratio": round(st.outlier_ratio, 2)} for st in ranked[:5]],
        "kv_amax": kv_amax, **({"kv_note": kv_note} if kv_note else {}),
    }

    def write(s: Session) -> None:
        repo.save_activation_stats(s, job_id=ctx.job_id, model_id=rec.id, stats=stats.values())

    return Outcome(result=result, write=write, message=f"{len(stats)} layers calibrated")


def _with_kv_amax(model, run):
    """(run(), per attention layer max |K| and |V| as cached or None, why not): the K/V maxima come from the
    same forwards (quantcore.evaluation.kvcache.kv_amax_observed); a model whose attention cannot be observed is
    calibrated all the same, and the note says why it has no K/V maxima."""
    from quantcore.errors import PlanError
    from quantcore.evaluation.kvcache import attention_modules, kv_amax_observed

    if not attention_modules(model):
        return run(), None, "no attention module with k_proj and v_proj"
    stats = None
    try:
        with kv_amax_observed(model) as amax:
            stats = run()
        return stats, amax.to_dict(), None
    except PlanError as exc:
        return (stats if stats is not None else run()), None, str(exc)


def score(ctx: JobContext) -> Outcome:  # defined in worker.scoring_bodies once scoring lands
    from worker.scoring_bodies import score as body

    return body(ctx)


def sensitivity(ctx: JobContext) -> Outcome:
    from worker.scoring_bodies import sensitivity as body

    return body(ctx)


def bench(ctx: JobContext) -> Outcome:
    from worker.bench_body import bench as body

    return body(ctx)
