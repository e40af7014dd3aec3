"""The calibrate job: per-channel activation statistics of every linear layer, and the K / V maxima of every
attention layer from the same forwards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from jobs.specs import CalibrateSpec
from store import repo
from worker.bodies.shared import load_model, model_record, resolve_device, token_ids
from worker.bodies.streaming import Mode, choose_mode, streamed_model
from worker.runner import JobContext, Outcome


def calibrate(ctx: JobContext) -> Outcome:
    """Calibrate the job's model on ``samples`` x ``seq_len`` tokens of its calibration text
    (:class:`jobs.specs.CalibrateSpec`); the statistics are stored with the job."""
    asked = CalibrateSpec.from_params(ctx.params)
    rec = model_record(ctx)
    device = resolve_device(asked.device)
    mode = choose_mode(ctx, rec, asked.stream, device)
    if mode.stream:
        with streamed_model(ctx, rec, device, mode) as (streamed, tok):
            stats, kv_amax, kv_note, ids, label, experts = _calibrated(ctx, asked, streamed.model, tok, mode, device,
                                                                       streamed)
    else:
        model, tok = load_model(ctx, rec, device)
        stats, kv_amax, kv_note, ids, label, experts = _calibrated(ctx, asked, model, tok, mode, device)
    ranked = sorted(stats.values(), key=lambda st: st.outlier_ratio, reverse=True)
    result = {
        "layers": len(stats), "tokens": int(ids.numel()), "text": label,
        "top": [{"name": st.name, "outlier_ratio": round(st.outlier_ratio, 2)} for st in ranked[:5]],
        "kv_amax": kv_amax, **({"kv_note": kv_note} if kv_note else {}),
        "mode": "streamed" if mode.stream else "whole model",
        **({"rotation": asked.rotation} if asked.rotation else {}),
        **({"experts": experts} if experts else {}),  # an MoE model: tokens routed to each expert (evaluation.experts)
    }

    def write(s: Session) -> None:
        repo.save_activation_stats(s, job_id=ctx.job_id, model_id=rec.id, stats=stats.values())

    return Outcome(result=result, write=write, message=f"{len(stats)} layers calibrated")


def _calibrated(ctx: JobContext, asked: CalibrateSpec, model: Any, tok: Any, mode: Mode, device: str,
                streamed: Any = None) -> tuple[Any, ...]:
    """(statistics, K/V maxima, why none, token ids, text label) of the job's calibration, whole or streamed."""
    from quantcore.evaluation.calibrate import calibrate as run_calibration
    from quantcore.evaluation.streamed import calibrate_streamed

    ids, label = token_ids(ctx, tok, "calibration", samples=asked.samples, seq_len=asked.seq_len,
                           dataset=asked.dataset)
    ctx.progress(0.05, f"calibrating on {ids.shape[0]}×{ids.shape[1]} tokens of {label}, {mode.text}")

    def progress(f: float, msg: str) -> None:
        ctx.progress(0.05 + 0.9 * f, msg if streamed is not None else f"{msg} (whole model)")

    rotation = _rotation_of(asked)

    def run():
        from quantcore.algorithms.rotation import rotation_applied

        # a what-if calibration of the rotated model (issue #46); streamed, each block is rotated as it loads
        with rotation_applied(model, rotation):
            if streamed is not None:
                return calibrate_streamed(streamed, ids, batch_size=asked.batch_size, progress=progress,
                                          should_cancel=ctx.should_cancel)
            return run_calibration(model, ids.to(device), batch_size=asked.batch_size, progress=progress,
                                   should_cancel=ctx.should_cancel)

    from quantcore.evaluation.experts import expert_coverage_observed

    experts: dict[str, Any] = {}

    def observed() -> Any:  # the router's choices over the same forwards
        with expert_coverage_observed(model) as coverage:
            out = run()
        experts.update(coverage.to_dict())
        return out

    return (*_with_kv_amax(model, observed), ids, label, experts)


def _rotation_of(asked: CalibrateSpec) -> Any:
    """The job's rotation (quantcore.algorithms.rotation_spec.RotationSpec) or None; PlanError for a malformed one.
    Whole or streamed alike (quantcore.algorithms.rotation.rotate_model rotates a streamed model block by block)."""
    if asked.rotation is None:
        return None
    from quantcore.algorithms.rotation_spec import rotation_from_dict

    return rotation_from_dict(asked.rotation, "the job's rotation")


def _with_kv_amax(model: Any, run: Callable[[], Any]) -> tuple[Any, dict[str, Any] | None, str | None]:
    """(run(), per attention layer max |K| and |V| as cached or None, why not): the K/V maxima come from the
    same forwards (quantcore.evaluation.kvcache.kv_amax_observed); a model whose attention cannot be observed is
    calibrated all the same, and the note says why it has no K/V maxima."""
    from quantcore.errors import PlanError
    from quantcore.evaluation.kvcache import kv_amax_observed
    from quantcore.models.decoder import attention_modules

    if not attention_modules(model):
        return run(), None, "no attention module with k_proj and v_proj"
    stats = None
    try:
        with kv_amax_observed(model) as amax:
            stats = run()
        return stats, amax.to_dict(), None
    except PlanError as exc:
        return (stats if stats is not None else run()), None, str(exc)
