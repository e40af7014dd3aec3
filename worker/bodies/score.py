"""The score job: KL of a plan against the unquantized model on held-out text, with the GPTQ roundings, AWQ
scales and KV cache scales the plan needs (worker.bodies.evaluation)."""

from __future__ import annotations

from functools import partial
from typing import Any

from sqlalchemy.orm import Session

from jobs.specs import ScoreSpec
from store import repo
from store.db import session_scope
from store.records import SCORE_STATISTICS
from worker.bodies import evaluation as ev
from worker.bodies import streamed_rounding as sr
from worker.bodies.shared import forget_model
from worker.bodies.streaming import prepared, refuse_streamed, streamed_kv_amax, streamed_reference
from worker.runner import JobContext, Outcome


def plan_spec(ctx: JobContext, asked: ScoreSpec, layer_names: list[str]):
    """The job's plan (a quantcore PlanSpec): its ``plan`` (a plan file's dict), the stored plan the job points
    at (plan_id), or its ``scheme`` (one preset for all layers)."""
    from quantcore.planning.plans import PlanSpec, plan_from_scheme

    if asked.plan:
        return PlanSpec.from_dict(asked.plan)
    if ctx.plan_id is not None:
        with session_scope(ctx.settings) as s:
            rec = repo.get_plan(s, ctx.plan_id)
        spec = PlanSpec.from_dict(rec.body)
        spec.name = rec.label  # "name vN": a score says which version of the plan it measured
        return spec
    if asked.scheme:
        return plan_from_scheme(asked.scheme, layer_names)
    raise ValueError("a score job needs a scheme, a plan or a stored plan id")


def base_label(label: str | None, spec: Any) -> str:
    """A score's plan label before its KV cache and GPUs are added: the ``label`` asked for, the plan's name, its
    preset, or, for a nameless plan of rules, the preset and how many rules and overrides change it (never the
    preset alone, which a score of that preset is labelled)."""
    if label := label or spec.name:
        return label
    changes = len(spec.rules) + len(spec.layers)
    return f"{spec.default} + {changes} rule(s) / override(s)" if changes else spec.default


def served_on(asked: ScoreSpec, spec: Any, model: Any):
    """The GPUs a score job scores the plan on: the job's ``tensor_parallel`` / ``expert_parallel`` where it gives
    them (they replace the plan's, in ``spec`` too), else the plan's; refused with vLLM's reason where the model
    cannot be split so (quantcore.models.parallel.tp_misfits)."""
    from quantcore.models.parallel import attention_heads, parse_tp

    if asked.tensor_parallel:
        spec.tensor_parallel = parse_tp(asked.tensor_parallel)
        spec.expert_parallel = asked.expert_parallel and spec.tensor_parallel > 1
    return ev.splittable(model, spec.parallelism(attention_heads(model.config)))


def score(ctx: JobContext) -> Outcome:
    """Score the job's plan (:class:`jobs.specs.ScoreSpec`), whole or streamed (worker.bodies.streaming); the report
    is stored with the job."""
    asked = ScoreSpec.from_params(ctx.params)
    with prepared(ctx, asked) as (rec, model, tok, ids, label, streamed):
        return _score(ctx, asked, rec, model, tok, ids, label, streamed)


def _score(ctx: JobContext, asked: ScoreSpec, rec: Any, model: Any, tok: Any, ids: Any, label: str,
           streamed: Any) -> Outcome:
    """:func:`score` on the prepared model: whole, or streamed block by block (``streamed``, a StreamedModel)."""
    from quantcore.algorithms.gptq import rounding_inputs
    from quantcore.evaluation.kvcache import get_kv_format, kv_skip_layers
    from quantcore.evaluation.scoring import score_plan
    from quantcore.evaluation.streamed import score_streamed
    from quantcore.models.decoder import attention_modules
    from quantcore.models.summary import attention_windows
    from quantcore.planning.plans import kv_label, resolve_plan

    names = ev.linear_names(rec)
    spec = plan_spec(ctx, asked, names)
    if asked.kv_cache:  # the job's KV cache format replaces the plan's
        spec.kv_cache = get_kv_format(asked.kv_cache).name
    kv = get_kv_format(spec.kv_cache)
    if kv.is_identity:
        spec.kv_cache_skip = []  # nothing quantized, nothing kept out (a stored AUTO plan has no skip list)
    plan = resolve_plan(spec, names)
    parallel = served_on(asked, spec, model)  # checked before the reference is computed, as the KV cache skips are
    if spec.kv_cache_skip:  # checked before the reference is computed
        kv_skip_layers(spec.kv_cache_skip, attention_modules(model), attention_windows(model))
    needs = ev.calibration_needs(plan.values())  # the calibrated inputs the plan's rounding and transforms read
    gptq = "weight_hessians" in needs
    # statistics, Hessians, AWQ and KV maxima are all taken on the model rotated so; streamed, the rotation folds
    # into each block as it loads (quantcore.algorithms.rotation.rotate_model on the StreamedModel's model)
    rotation = spec.rotation
    if streamed is not None:  # refused before anything runs
        refuse_streamed(["rollouts"] if asked.rollouts else [])
    cal = ev.calibration_for(ctx, asked, rec, any(s.needs_calibration for s in plan.values()), rotation)
    ref = ev.reference_for(ctx, rec, model, ids, label, asked.batch_size,
                           compute=None if streamed is None else partial(streamed_reference, streamed))
    cal_ids, cal_text = ev.calibration_ids(ctx, asked, tok, ids.device,
                                           ev.reads_calibration_text(needs) or kv.calibrated)
    gptq_reads = rounding_inputs(plan)
    kept, keep_at = ev.kept_gptq(ctx, rec, model, gptq_reads, cal_ids, cal, rotation)
    # streamed: each block's GPTQ layers are rounded as it loads, below (worker.bodies.streamed_rounding)
    hessians = (ev.hessians(ctx, model, plan, cal_ids, cal_text, rounded=kept, rotation=rotation)
                if streamed is None else None)
    awq = ev.awq_scales(ctx, rec, model, plan, cal_ids, cal_text, rotation,
                        search=None if streamed is None else partial(sr.awq_search, streamed))
    # the KV cache calibration and the score round each GPTQ layer once between them
    gptq_cache = dict(kept) if streamed is None else sr.spilled_cache(ctx, kept)
    inputs = ev.calibration_inputs(cal).replace(weight_hessians=hessians, awq=awq, gptq_cache=gptq_cache,
                                                parallel=parallel, rotation=rotation)
    if streamed is not None and gptq:  # in the rotated blocks, SmoothQuant off where the rotation is online
        from quantcore.evaluation.streamed import rotated_plan

        with ev.rotated(model, rotation):
            sr.round_gptq(ctx, streamed, rotated_plan(model, plan, rotation), cal_ids, cal_text,
                          inputs.replace(rotation=None))
    kv_amax, kv_cached = ev.kv_amax(ctx, rec, model, kv, plan, cal_ids, cal, inputs,
                                    calibrate=None if streamed is None else partial(streamed_kv_amax, streamed))
    rest = ctx.rest()
    share = 0.5 if asked.rollouts else 1.0  # of what is left of the bar: the score's, then the rollouts'
    # batch_size=None: score in the reference's own batches, so an identity plan is exactly KL 0
    mode = "" if streamed is not None else " (whole model)"  # a streamed pass says "streamed, block i/N"
    options = dict(inputs=inputs.replace(kv_amax=kv_amax), batch_size=None, kv_cache=kv.name,
                   kv_skip=spec.kv_cache_skip, progress=lambda f, msg: rest(share * f, msg + mode),
                   should_cancel=ctx.should_cancel)
    # the model's last use unless rollouts follow: the rounded weights go over the originals (no second copy of
    # the model in memory); the worker then loads it again for its next job
    in_place = streamed is None and not asked.rollouts
    if in_place:
        forget_model()
    # written whatever the throttle (no count: not timed), so the reference's "from the cache" does not stand for
    # the whole score while the plan is applied and the first batch runs
    ctx.progress(ctx.furthest, f"applying the plan, then scoring {ids.shape[0]} sequences{mode}", force=True)
    report = (score_plan(model, plan, ids, ref, keep_originals=not in_place, **options)  # type: ignore[arg-type]
              if streamed is None
              else score_streamed(streamed, plan, ids, ref, **options))  # type: ignore[arg-type]
    rep = report.to_dict()
    if asked.rollouts:  # sequences the quantized model generates itself, against the reference on them
        from quantcore.evaluation.rollouts import rollout_drift

        rep["rollout"] = rollout_drift(model, plan, ids, count=asked.rollouts, length=asked.rollout_len,
                                       clip_eps=asked.clip_eps, inputs=inputs.replace(kv_amax=kv_amax),
                                       progress=lambda f, msg: rest(0.5 + 0.5 * f, msg),
                                       should_cancel=ctx.should_cancel).to_dict()
    not_kept = ev.keep_gptq(ctx, gptq_cache, keep_at)
    if cal_ids is not None:  # stored with the score: two scores of one plan may differ only in this
        rep["calibration"] = f"{cal_text}, {cal_ids.shape[0]} × {cal_ids.shape[1]} tokens"
    plan_label = base_label(asked.label, spec)
    if asked.kv_cache and not asked.label and not kv.is_identity:
        plan_label = f"{plan_label} + KV {kv_label(spec)}"
    if parallel.split and not asked.label and not plan_label.endswith(f"-tp{parallel.tp}"):
        plan_label = f"{plan_label} (TP {parallel.tp}{', EP' if parallel.expert_parallel else ''})"
    result = {k: rep[k] for k in ("kl_mean", "kl_p50", "kl_p99", "kl_max", "top1_agree", "ppl_ref", "ppl",
                                  "tokens", "kv_cache")}
    # which reference the KL came from and the bound it carries (docs/scoring.md, "The compact reference")
    result.update({k: rep.get(k) for k in ("reference_kind", "topk", "kl_tail_bound")})
    # the statistics with their uncertainty (quantcore.evaluation.statistics; None where not measured)
    result.update({k: rep.get(k) for k in ("kl_p90", *SCORE_STATISTICS, "eval_key")})
    result.update(plan=plan_label, calibration_job=cal[0] if cal else None)
    if "rollout" in rep:
        result["rollout"] = {k: v for k, v in rep["rollout"].items() if k != "log_ratios"}
    if kv.calibrated:
        result.update(kv_calibration_text=cal_text, kv_amax_cached=kv_cached)
    if gptq:
        result.update(gptq_calibration_text=cal_text, gptq=ev.gptq_summary(gptq_reads, kept, not_kept))
    if awq is not None:
        result["awq_calibration_text"] = cal_text
        result["awq"] = ev.awq_summary(awq)
    if cal_ids is not None:
        result["calibration_tokens"] = list(cal_ids.shape)  # sequences, tokens each

    def write(s: Session) -> None:
        repo.save_score(s, job_id=ctx.job_id, model_id=rec.id, plan_id=ctx.plan_id, plan_label=plan_label,
                        plan_body=spec.to_dict(), dataset=label, report=rep, predicted_kl=asked.predicted_kl)

    reused = ([f"GPTQ {len(kept)} of {len(gptq_reads)} layers"] if kept else []) + (["KV maxima"] if kv_cached else [])
    return Outcome(result=result, write=write,
                   message=f"{plan_label}: KL {rep['kl_mean']:.4g}"
                   + (f" (top-{rep['topk']} reference, tail bound {rep['kl_tail_bound']:.2g})" if rep.get("topk")
                      else "")
                   + f", top-1 {rep['top1_agree']:.3f}"
                   + (f" (from the cache: {', '.join(reused)})" if reused else ""))
