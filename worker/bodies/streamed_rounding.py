"""A streamed score's or sensitivity sweep's GPTQ rounding and AWQ search (quantcore.algorithms.streamed_rounding),
block by block: the GPTQ-rounded weights kept as files in the job's scratch folder (removed when the job ends:
worker.bodies.streaming), never the whole rounded model in memory. A sweep rounds its units inside
quantcore.evaluation.streamed_sweep (each layer as its unit alone), into :func:`spilled_cache`."""

from __future__ import annotations

from typing import Any

from worker.runner import JobContext


def spilled_cache(ctx: JobContext, kept: dict[str, Any]) -> Any:
    """The streamed job's ``gptq_cache``: on disk in its scratch folder, holding the roundings an earlier job kept
    (``kept``: worker.bodies.evaluation.kept_gptq)."""
    from quantcore.algorithms.streamed_rounding import SpilledWeights

    return SpilledWeights(ctx.settings.job_scratch_dir(ctx.job_id) / "gptq", kept)


def round_gptq(ctx: JobContext, streamed: Any, plan: dict[str, Any], cal_ids: Any, text: str | None,
               inputs: Any) -> None:
    """Round the plan's GPTQ layers not in ``inputs.gptq_cache`` yet into it, block by block, each on the
    unquantized model's inputs on the calibration tokens (as the whole-model job's Hessians)."""
    from quantcore.algorithms.streamed_rounding import round_gptq_streamed

    cache = inputs.gptq_cache
    todo = [n for n, s in plan.items() if s.needs_hessians and n not in cache]
    if not todo:
        return
    ctx.progress(0.3, f"GPTQ: input Hessians and rounding of {len(todo)} layer(s) on {text}, block by block")
    round_gptq_streamed(streamed, plan, cal_ids, cache=cache, inputs=inputs,
                        progress=lambda _f, message: ctx.progress(0.3, message), should_cancel=ctx.should_cancel)


def awq_search(streamed: Any, _model: Any, plan: Any, cal_ids: Any, **options: Any) -> Any:
    """awq_search's call (worker.bodies.evaluation.awq_scales), run on the StreamedModel."""
    from quantcore.algorithms.streamed_rounding import awq_search_streamed

    return awq_search_streamed(streamed, plan, cal_ids, **options)


__all__ = ["awq_search", "round_gptq", "spilled_cache"]
