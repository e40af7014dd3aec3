"""The calibrate job: per-channel activation statistics of every linear layer, and the K / V maxima of every
attention layer from the same forwards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from jobs.specs import CalibrateSpec
from store import repo
from worker.bodies.shared import load_model, model_record, resolve_device, token_ids
from worker.runner import JobContext, Outcome


def calibrate(ctx: JobContext) -> Outcome:
    """Calibrate the job's model on ``samples`` x ``seq_len`` tokens of its calibration text
    (:class:`jobs.specs.CalibrateSpec`); the statistics are stored with the job."""
    from quantcore.evaluation.calibrate import calibrate as run_calibration

    asked = CalibrateSpec.from_params(ctx.params)
    rec = model_record(ctx)
    device = resolve_device(asked.device)
    model, tok = load_model(ctx, rec, device)
    ids, label = token_ids(ctx, tok, "calibration", samples=asked.samples, seq_len=asked.seq_len,
                           dataset=asked.dataset)
    ctx.progress(0.05, f"calibrating on {ids.shape[0]}×{ids.shape[1]} tokens of {label}")

    def run():
        return run_calibration(
            model, ids.to(device), batch_size=asked.batch_size,
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
