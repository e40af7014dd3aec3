"""Score and sensitivity job bodies: KL of a plan against the unquantized model, one layer at a time."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from quantcore.errors import PlanError, name_list
from quantcore.files import write_whole
from store import cache, repo
from store.db import session_scope
from worker.bodies import _model_record, load_model, resolve_device, token_ids
from worker.runner import JobContext, Outcome, run_job

DEFAULT_EVAL_SAMPLES = 16
DEFAULT_EVAL_SEQ_LEN = 256
# the calibration tokens a score or sweep reads (GPTQ Hessians, KV cache scales, a calibration run first)
DEFAULT_SCORE_CAL_SAMPLES = 16
DEFAULT_SCORE_CAL_SEQ_LEN = 256
# what a score's or sweep's token parameters mean when unset: two jobs, one of them explicit, read the same tokens
TOKEN_DEFAULTS = {"samples": DEFAULT_EVAL_SAMPLES, "seq_len": DEFAULT_EVAL_SEQ_LEN,
                  "cal_samples": DEFAULT_SCORE_CAL_SAMPLES, "cal_seq_len": DEFAULT_SCORE_CAL_SEQ_LEN}


def plan_spec(ctx: JobContext, layer_names: list[str]):
    """The job's plan: params['plan'] (a PlanSpec dict), params['scheme'] (one preset for all layers),
    or the stored plan the job points at (plan_id)."""
    from quantcore.planning.plans import PlanSpec, plan_from_scheme

    p = ctx.params
    if p.get("plan"):
        return PlanSpec.from_dict(p["plan"])
    if ctx.plan_id is not None:
        with session_scope(ctx.settings) as s:
            rec = repo.get_plan(s, ctx.plan_id)
        spec = PlanSpec.from_dict(rec.body)
        spec.name = rec.label  # "name vN": a score says which version of the plan it measured
        return spec
    if p.get("scheme"):
        return plan_from_scheme(p["scheme"], layer_names)
    raise ValueError("a score job needs a scheme, a plan or a stored plan id")


def linear_names(model_rec) -> list[str]:
    return [lin["name"] for lin in model_rec.linears]


def calibration_for(ctx: JobContext, model_rec, needed: bool):
    """Stored statistics of the model for SmoothQuant / static scales: the newest calibration, or a new
    one run here first (recorded as its own calibrate job)."""
    if not needed:
        return None
    with session_scope(ctx.settings) as s:
        cal = repo.latest_calibration(s, model_rec.id)
    if cal is None:
        from worker import bodies
        from worker.client import create_local_job

        ctx.progress(0.02, "no stored calibration: calibrating first")
        job = create_local_job("calibrate", {"device": ctx.params.get("device") or "cpu",
                                             "samples": ctx.params.get("cal_samples") or DEFAULT_SCORE_CAL_SAMPLES,
                                             "seq_len": ctx.params.get("cal_seq_len") or DEFAULT_SCORE_CAL_SEQ_LEN},
                               model_id=model_rec.id, settings=ctx.settings)
        status = run_job(job.id, bodies.calibrate, settings=ctx.settings)
        if status != "succeeded":
            raise ValueError(f"the calibration this job needs (job #{job.id}) {status}")
        with session_scope(ctx.settings) as s:
            cal = repo.get_job(s, job.id)
    with session_scope(ctx.settings) as s:
        stats = repo.load_activation_stats(s, cal.id)
    return cal.id, stats


def _cache_key(**parts: Any) -> str:
    """A file-name-safe key of what a cached result was computed from; token tensors enter by their digest."""
    digest = {k: hashlib.sha256(v.cpu().numpy().tobytes()).hexdigest() if hasattr(v, "numpy") else v
              for k, v in parts.items()}
    return hashlib.sha256(json.dumps(digest, sort_keys=True).encode()).hexdigest()[:24]


def _software() -> dict[str, str]:
    """The versions of the code a kept result came from: torch (its kernels' float rounding) and transformers (the
    model's forward: rotary embedding, masks, attention). Another version computes anew rather than read it."""
    import torch
    import transformers

    return {"torch": str(torch.__version__), "transformers": str(transformers.__version__)}


def reference_for(ctx: JobContext, model_rec, model, ids, eval_label: str):
    """Reference log-probs of the unquantized model on these tokens, cached in the artifact store."""
    from quantcore.evaluation import scoring
    ctx.cache_used = True  # the job's end keeps the cache under its limit (worker.runner.trim_cache)
    key = _cache_key(text=eval_label, shape=list(ids.shape), ids=ids, **_software())
    path = scoring.reference_cache_path(ctx.settings.reference_root, model_rec.sha256, key)
    if Path(path).exists():
        try:
            ref = scoring.ReferenceCache.load(path)
        except scoring.ReferenceMismatch as exc:  # damaged, of an older format, or just trimmed (store.cache): anew
            ctx.progress(0.05, f"computing reference log-probs again: {exc}")
        else:
            cache.mark_used(path)
            ctx.progress(0.1, "reference log-probs from the cache")
            return ref
    else:
        ctx.progress(0.05, "computing reference log-probs (once per model and text)")
    ref = scoring.compute_reference(model, ids, batch_size=int(ctx.params.get("batch_size") or 4),
                                    model_sha=model_rec.sha256, eval_key=key,
                                    progress=lambda f, m: ctx.progress(0.05 + 0.25 * f, m),
                                    should_cancel=ctx.should_cancel)
    ref.save(path)
    return ref


def base_label(ctx: JobContext, spec) -> str:
    """A score's plan label before its KV cache and GPUs are added: the label asked for, the plan's name, its preset,
    or, for a nameless plan of rules, the preset and how many rules and overrides change it (never the preset alone,
    which a score of that preset is labelled)."""
    if label := ctx.params.get("label") or spec.name:
        return label
    changes = len(spec.rules) + len(spec.layers)
    return f"{spec.default} + {changes} rule(s) / override(s)" if changes else spec.default


def _prepare(ctx: JobContext):
    rec = _model_record(ctx)
    device = resolve_device(ctx.params.get("device"))
    model, tok = load_model(ctx, rec, device)
    samples = int(ctx.params.get("samples") or DEFAULT_EVAL_SAMPLES)
    seq_len = int(ctx.params.get("seq_len") or DEFAULT_EVAL_SEQ_LEN)
    ids, label = token_ids(ctx, tok, "evaluation", samples=samples, seq_len=seq_len)
    ids = ids.to(device)
    return rec, model, tok, ids, label


def _calibration_maps(cal) -> tuple[dict[str, float] | None, dict[str, Any] | None]:
    if cal is None:
        return None, None
    _, stats = cal
    return {st.name: st.amax for st in stats}, {st.name: st.channel_max for st in stats}


def _calibration_ids(ctx: JobContext, tok, device, needed: bool = True):
    """(token ids, label) of the calibration text: params['cal_dataset'] or the built-in one, never the evaluation
    text; params['cal_samples'] x params['cal_seq_len'] tokens (16 x 256 by default). (None, None) when not
    ``needed`` (no GPTQ Hessians, no KV cache scales): one tokenization serves both."""
    if not needed:
        return None, None
    ids, label = token_ids(ctx, tok, "calibration", samples=int(ctx.params.get("cal_samples") or DEFAULT_SCORE_CAL_SAMPLES),
                           seq_len=int(ctx.params.get("cal_seq_len") or DEFAULT_SCORE_CAL_SEQ_LEN),
                           dataset_param="cal_dataset")
    return ids.to(device), label


def _hessians(ctx: JobContext, model, plan, cal_ids, text, rounded=()) -> dict[str, Any] | None:
    """GPTQ Hessians of the plan's layers that round with GPTQ, from the unquantized model on the calibration
    tokens; None when no layer does, or all are ``rounded`` already (:func:`_kept_gptq`)."""
    from quantcore.algorithms.gptq import collect_hessians

    layers = [n for n, s in plan.items() if s.needs_hessians and n not in rounded]
    if rounded:
        ctx.progress(0.3, f"GPTQ: {len(rounded)} layer(s) rounded by an earlier job, from the cache")
    if not layers:
        return None
    ctx.progress(0.3, f"GPTQ: input Hessians of {len(layers)} layer(s) on {text}")
    return collect_hessians(model, layers, cal_ids, should_cancel=ctx.should_cancel)


def _kept_gptq(ctx: JobContext, rec, model, reads: dict[str, dict[str, Any]], cal_ids, cal):
    """GPTQ-rounded weights kept beside the model's reference log-probs by earlier jobs: ({layer: weight} found,
    {layer: file} to keep the others at once rounded, :func:`_keep_gptq`). ``reads``: what each GPTQ layer's
    rounding reads of the plan it is applied in (quantcore.algorithms.gptq.rounding_inputs; a sweep applies one unit at a
    time). The key is everything the rounding reads
    (quantcore.algorithms.gptq.rounding_inputs: the schemes of the layer's fusion group, of the o_proj / down_proj folding
    into its rows and of the plan's AWQ layers; the calibration tokens, the calibration statistics where
    SmoothQuant divides by them, the weights' dtype, the device kind, torch's and transformers' versions,
    quantplan's numerics), so a
    plan rounds a layer once whichever job asks again: a second score, the automatic plan's check after a sweep."""
    from safetensors.torch import load_file

    from quantcore.schemes.specs import NUMERICS

    if cal_ids is None or not reads:
        return {}, {}
    tokens = _cache_key(tokens=cal_ids, shape=list(cal_ids.shape))
    dtype = str(next(model.parameters()).dtype)
    software = _software()  # another torch may round a float the other way in the Cholesky
    folder = ctx.settings.model_reference_dir(rec.sha256)
    modules = dict(model.named_modules())
    found, paths = {}, {}
    for layer, read in reads.items():
        key = _cache_key(tokens=tokens, dtype=dtype, device=cal_ids.device.type, numerics=NUMERICS, **software,
                         calibration=cal[0] if read["smoothed"] and cal else None, **read)
        path = cache.gptq_path(folder, key)
        weight = None
        if path.exists():
            try:
                weight = load_file(path, device=str(cal_ids.device))["weight"]
            except Exception:  # a damaged file (a full disk, a copy cut short): rounded again and written anew
                weight = None
        own = modules[layer].weight
        if weight is not None and weight.shape == own.shape and weight.dtype == own.dtype:
            cache.mark_used(path)
            found[layer] = weight
        else:
            paths[layer] = path
    return found, paths


def _keep_gptq(ctx: JobContext, rounded: dict[str, Any], paths: dict[str, Path]) -> str | None:
    """Write the layers of ``rounded`` that ``paths`` wants kept (:func:`_kept_gptq`), each whole or not at all
    (quantcore.files.write_whole; the job's end trims the cache to ``cache_max_gib``: worker.runner.trim_cache);
    none of them where together they would not fit (a large model's roundings take the size of its weights), and
    why."""
    from safetensors.torch import save_file

    todo = {layer: path for layer, path in paths.items() if layer in rounded}
    size = sum(rounded[layer].numel() * rounded[layer].element_size() for layer in todo)
    limit = ctx.settings.cache_max_bytes
    if limit and size > limit:
        return (f"{len(todo)} rounded layer(s), {size / 2**20:,.1f} MiB, not kept: more than "
                f"QUANTPLAN_CACHE_MAX_GIB allows ({limit / 2**20:,.1f} MiB)")
    for layer, path in todo.items():
        write_whole(path, lambda part, w=rounded[layer]: save_file({"weight": w.detach().contiguous().cpu()}, part))
    return None


def _gptq_summary(reads: dict[str, Any], kept: dict[str, Any], not_kept: str | None = None) -> dict[str, Any]:
    """What a result keeps of a job's GPTQ: the layers it rounded, how many of them an earlier job had, and why
    its own roundings were not kept, where they were not (:func:`_keep_gptq`)."""
    return {"layers": len(reads), "from_cache": len(kept), **({"not_kept": not_kept} if not_kept else {})}


def _awq(ctx: JobContext, rec, model, plan, cal_ids, text):
    """AWQ's searched input scales for the plan's layers that scale with AWQ, on the calibration tokens; None
    when no layer does. Kept beside the model's reference log-probs, keyed by everything the search reads (the
    calibration tokens, the AWQ layers and their weight format, the grid, the device kind, the weights' dtype,
    torch's and transformers' versions, quantplan's numerics), so another score or a sweep of the same AWQ layers
    reuses it; ``.cached`` says whether it came from there (a damaged file is searched again)."""
    from quantcore.algorithms.awq import awq_search, load_awq, save_awq
    from quantcore.schemes.specs import AWQ_DUO_SCALING, AWQ_N_GRID, NUMERICS

    layers = [n for n, s in plan.items() if s.needs_awq]
    if not layers:
        return None
    key = _cache_key(tokens=cal_ids, shape=list(cal_ids.shape), grid=[AWQ_N_GRID, AWQ_DUO_SCALING],
                     layers={n: plan[n].weights.to_dict() for n in sorted(layers)}, device=cal_ids.device.type,
                     dtype=str(next(model.parameters()).dtype), numerics=NUMERICS, **_software())
    path = cache.awq_path(ctx.settings.model_reference_dir(rec.sha256), key)
    if path.exists():
        try:
            found = load_awq(path)
        except Exception:  # a damaged file (a full disk, a copy cut short): searched again and written anew
            pass
        else:
            cache.mark_used(path)
            ctx.progress(0.3, f"AWQ: input scales of {len(layers)} layer(s) on {text}, from the cache")
            found.cached = True
            return found
    ctx.progress(0.3, f"AWQ: searching the input scales of {len(layers)} layer(s) on {text}")
    found = awq_search(model, plan, cal_ids, should_cancel=ctx.should_cancel,
                       progress=lambda _f, message: ctx.progress(0.3, message))
    save_awq(found, path)
    return found


def _awq_summary(found) -> dict[str, Any]:
    """What a result row keeps of an AWQ search: mappings searched, layers left unscaled, and how much the best
    scales cut the mappings' output error (median of best / unscaled)."""
    ratios = sorted(best / first for first, best, _ in found.errors.values() if first > 0)
    return {"mappings": len(found.errors), "unscaled_layers": len(found.skipped),
            "median_error_ratio": ratios[len(ratios) // 2] if ratios else None, "cached": found.cached}


def _kv_amax(ctx: JobContext, rec, model, kv, plan, cal_ids, cal=None, act_amax=None, act_channel_max=None,
             weight_hessians=None, awq=None, gptq_cache=None, parallel=None):
    """Per-layer K/V amax for a calibrated KV format, with ``plan`` applied, on the calibration tokens
    (params['cal_dataset'] or the built-in text), never the evaluation text; None for a format without
    calibrated scales. Kept beside the model's reference log-probs as ``kv-<key>.json``, keyed by what the pass
    reads (the plan's quantized layers and their schemes, the calibration statistics ``cal`` they use, the
    calibration tokens, the GPUs, the weights' dtype, the device kind, torch's and transformers' versions,
    quantplan's numerics; not
    the KV format: K and V are observed before it quantizes them), so another score of the plan with a calibrated
    KV cache (another format, another evaluation text) reads it; a damaged file (unreadable, or without every
    attention layer) is calibrated again. Returns
    (amax, whether it came from there)."""
    from quantcore.evaluation.kvcache import KvAmax, attention_modules
    from quantcore.evaluation.scoring import calibrate_kv_cache
    from quantcore.schemes.specs import NUMERICS

    if not kv.calibrated:
        return None, False
    key = _cache_key(tokens=_cache_key(tokens=cal_ids, shape=list(cal_ids.shape)),
                     plan={n: s.to_dict() for n, s in sorted(plan.items()) if not s.is_identity},
                     calibration=cal[0] if cal else None,
                     gpus=[parallel.tp, parallel.expert_parallel] if parallel is not None else [1, False],
                     dtype=str(next(model.parameters()).dtype), device=cal_ids.device.type, numerics=NUMERICS,
                     **_software())
    path = cache.kv_path(ctx.settings.model_reference_dir(rec.sha256), key)
    if path.exists():
        try:
            amax = KvAmax.from_dict(json.loads(path.read_text()))
        except Exception:  # damaged or unreadable: calibrated again, written anew
            amax = None
        layers = set(attention_modules(model))
        if amax is not None and all(set(table) == layers for table in (amax.k, amax.v, amax.k_head, amax.v_head)):
            cache.mark_used(path)
            ctx.progress(0.3, f"the {kv.name} KV cache scales' amax, from the cache")
            return amax, True
    ctx.progress(0.3, f"calibrating the {kv.name} KV cache scales")
    amax = calibrate_kv_cache(model, plan, cal_ids, act_amax=act_amax, act_channel_max=act_channel_max,
                              should_cancel=ctx.should_cancel, weight_hessians=weight_hessians, awq=awq,
                              gptq_cache=gptq_cache, parallel=parallel)
    write_whole(path, lambda part: Path(part).write_text(json.dumps(amax.to_dict())))
    return amax, False


def served_on(ctx: JobContext, spec, model):
    """The GPUs a score job scores the plan on: the job's ``tensor_parallel`` / ``expert_parallel`` where it gives
    them (they replace the plan's, in ``spec`` too), else the plan's; refused with vLLM's reason where the model
    cannot be split so (quantcore.models.parallel.tp_misfits)."""
    from quantcore.models.parallel import attention_heads, parse_tp

    p = ctx.params
    if p.get("tensor_parallel"):
        spec.tensor_parallel = parse_tp(p["tensor_parallel"])
        spec.expert_parallel = bool(p.get("expert_parallel")) and spec.tensor_parallel > 1
    return _splittable(model, spec.parallelism(attention_heads(model.config)))


def swept_on(ctx: JobContext, model):
    """The GPUs a sensitivity sweep quantizes each unit as on: the job's ``tensor_parallel`` /
    ``expert_parallel`` (one GPU without them), refused as :func:`served_on` refuses."""
    from quantcore.models.parallel import Parallelism, attention_heads, parse_tp

    tp = parse_tp(ctx.params.get("tensor_parallel") or 1)
    return _splittable(model, Parallelism(tp, attention_heads(model.config) if tp > 1 else None,
                                          bool(ctx.params.get("expert_parallel")) and tp > 1))


def _splittable(model, parallel):
    """``parallel``, or ValueError with vLLM's reasons where it would refuse to split the model so
    (quantcore.models.parallel.tp_misfits)."""
    import torch

    from quantcore.models.parallel import tp_misfits

    shapes = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    misfits = tp_misfits(shapes, parallel)
    if misfits:
        raise ValueError("; ".join(misfits))
    return parallel


def score(ctx: JobContext) -> Outcome:
    from quantcore.algorithms.gptq import rounding_inputs
    from quantcore.evaluation.kvcache import attention_modules, get_kv_format, kv_skip_layers
    from quantcore.evaluation.scoring import score_plan
    from quantcore.models.checkpoint import attention_windows
    from quantcore.planning.plans import kv_label, resolve_plan

    rec, model, tok, ids, label = _prepare(ctx)
    names = linear_names(rec)
    spec = plan_spec(ctx, names)
    if ctx.params.get("kv_cache"):  # the job's KV cache format replaces the plan's
        spec.kv_cache = get_kv_format(ctx.params["kv_cache"]).name
    kv = get_kv_format(spec.kv_cache)
    if kv.is_identity:
        spec.kv_cache_skip = []  # nothing quantized, nothing kept out (a stored AUTO plan has no skip list)
    plan = resolve_plan(spec, names)
    parallel = served_on(ctx, spec, model)  # checked before the reference is computed, as the KV cache skips are
    if spec.kv_cache_skip:  # checked before the reference is computed
        kv_skip_layers(spec.kv_cache_skip, attention_modules(model), attention_windows(model))
    cal = calibration_for(ctx, rec, any(s.needs_calibration for s in plan.values()))
    act_amax, act_channel_max = _calibration_maps(cal)
    ref = reference_for(ctx, rec, model, ids, label)
    gptq = any(s.needs_hessians for s in plan.values())
    awq_needed = any(s.needs_awq for s in plan.values())
    cal_ids, cal_text = _calibration_ids(ctx, tok, ids.device, gptq or awq_needed or kv.calibrated)
    gptq_reads = rounding_inputs(plan)
    kept, keep_at = _kept_gptq(ctx, rec, model, gptq_reads, cal_ids, cal)
    hessians = _hessians(ctx, model, plan, cal_ids, cal_text, rounded=kept)
    awq = _awq(ctx, rec, model, plan, cal_ids, cal_text)
    gptq_cache = dict(kept)  # the KV cache calibration and the score round each GPTQ layer once between them
    kv_amax, kv_cached = _kv_amax(ctx, rec, model, kv, plan, cal_ids, cal, act_amax, act_channel_max, hessians,
                                  awq, gptq_cache, parallel)
    # batch_size=None: score in the reference's own batches, so an identity plan is exactly KL 0
    report = score_plan(model, plan, ids, ref, act_amax=act_amax, act_channel_max=act_channel_max,
                        batch_size=None, kv_cache=kv.name, kv_amax=kv_amax, kv_skip=spec.kv_cache_skip,
                        weight_hessians=hessians, awq=awq, gptq_cache=gptq_cache, parallel=parallel,
                        progress=ctx.rest(), should_cancel=ctx.should_cancel)
    not_kept = _keep_gptq(ctx, gptq_cache, keep_at)
    rep = report.to_dict()
    if cal_ids is not None:  # stored with the score: two scores of one plan may differ only in this
        rep["calibration"] = f"{cal_text}, {cal_ids.shape[0]} × {cal_ids.shape[1]} tokens"
    plan_label = base_label(ctx, spec)
    if ctx.params.get("kv_cache") and not ctx.params.get("label") and not kv.is_identity:
        plan_label = f"{plan_label} + KV {kv_label(spec)}"
    if parallel.split and not ctx.params.get("label") and not plan_label.endswith(f"-tp{parallel.tp}"):
        plan_label = f"{plan_label} (TP {parallel.tp}{', EP' if parallel.expert_parallel else ''})"
    result = {k: rep[k] for k in ("kl_mean", "kl_p50", "kl_p99", "kl_max", "top1_agree", "ppl_ref", "ppl",
                                  "tokens", "kv_cache")}
    result.update(plan=plan_label, calibration_job=cal[0] if cal else None)
    if kv.calibrated:
        result.update(kv_calibration_text=cal_text, kv_amax_cached=kv_cached)
    if gptq:
        result.update(gptq_calibration_text=cal_text, gptq=_gptq_summary(gptq_reads, kept, not_kept))
    if awq is not None:
        result["awq_calibration_text"] = cal_text
        result["awq"] = _awq_summary(awq)
    if cal_ids is not None:
        result["calibration_tokens"] = list(cal_ids.shape)  # sequences, tokens each

    def write(s: Session) -> None:
        repo.save_score(s, job_id=ctx.job_id, model_id=rec.id, plan_id=ctx.plan_id, plan_label=plan_label,
                        plan_body=spec.to_dict(), dataset=label, report=rep,
                        predicted_kl=ctx.params.get("predicted_kl"))

    reused = ([f"GPTQ {len(kept)} of {len(gptq_reads)} layers"] if kept else []) + (["KV maxima"] if kv_cached else [])
    return Outcome(result=result, write=write,
                   message=f"{plan_label}: KL {rep['kl_mean']:.4g}, top-1 {rep['top1_agree']:.3f}"
                   + (f" (from the cache: {', '.join(reused)})" if reused else ""))


def sensitivity(ctx: JobContext) -> Outcome:
    """A sweep of one preset over the linear units (params['scheme']), or of one KV cache format over the attention
    layers (params['kv_sweep']: stored as scheme "KV <format>")."""
    from quantcore.algorithms.gptq import rounding_inputs
    from quantcore.evaluation.kvcache import get_kv_format
    from quantcore.evaluation.sensitivity import (
        kv_sensitivity_sweep,
        linear_layer_names,
        sensitivity_sweep,
        sweep_units,
    )
    from quantcore.models.parallel import ONE_GPU
    from quantcore.schemes.specs import get_scheme

    rec, model, tok, ids, label = _prepare(ctx)

    awq, parallel, rerouted, gptq_summary = None, ONE_GPU, False, None
    unsmoothable: list[str] = []  # layers a SmoothQuant sweep leaves out (_sweepable)
    if ctx.params.get("kv_sweep"):  # K and V are quantized per head: the same on any number of GPUs
        kv = get_kv_format(ctx.params["kv_sweep"])
        ref = reference_for(ctx, rec, model, ids, label)
        cal_ids, cal_text = _calibration_ids(ctx, tok, ids.device, kv.calibrated)
        amax, _ = _kv_amax(ctx, rec, model, kv, {}, cal_ids)
        rows = kv_sensitivity_sweep(model, kv.name, ids, ref, amax=amax, progress=ctx.rest(),
                                    should_cancel=ctx.should_cancel)
        name = repo.KV_SWEEP_PREFIX + kv.name
    else:
        scheme = get_scheme(ctx.params["scheme"])
        if ctx.params.get("alpha") is not None:
            scheme = scheme.with_alpha(float(ctx.params["alpha"]))
        parallel = swept_on(ctx, model)  # checked before the reference is computed
        swept, unsmoothable = _sweepable(linear_layer_names(model), scheme)  # so is what is left to sweep
        if parallel.split and not scheme.scaled_per_gpu_share:
            parallel, rerouted = ONE_GPU, True  # its scales are the same on any number of GPUs: read exactly so
        cal = calibration_for(ctx, rec, scheme.needs_calibration)
        act_amax, act_channel_max = _calibration_maps(cal)
        ref = reference_for(ctx, rec, model, ids, label)
        cal_ids, cal_text = _calibration_ids(ctx, tok, ids.device, scheme.needs_hessians or scheme.needs_awq)
        groups = bool(ctx.params.get("groups", True))
        every = {n: scheme for n in linear_names(rec) if n not in unsmoothable}
        unit_reads = {n: read for unit in sweep_units(swept, groups=groups)
                      for n, read in rounding_inputs(dict.fromkeys(unit, scheme)).items()}
        kept, keep_at = _kept_gptq(ctx, rec, model, unit_reads, cal_ids, cal)
        hessians = _hessians(ctx, model, every, cal_ids, cal_text, rounded=kept)
        awq = _awq(ctx, rec, model, every, cal_ids, cal_text)
        gptq_cache = dict(kept)
        rows = sensitivity_sweep(model, scheme, ids, ref, groups=groups, layers=swept,
                                 act_amax=act_amax, act_channel_max=act_channel_max, progress=ctx.rest(),
                                 should_cancel=ctx.should_cancel, weight_hessians=hessians, awq=awq,
                                 parallel=parallel, gptq_cache=gptq_cache)
        not_kept = _keep_gptq(ctx, gptq_cache, keep_at)
        name = scheme.name
        if unit_reads:
            gptq_summary = _gptq_summary(unit_reads, kept, not_kept)
    dicts = [r.to_dict() for r in rows]
    from quantcore.schemes.specs import NUMERICS

    result = {"scheme": name, "units": len(dicts), "text": label, "tokens": list(ids.shape), "numerics": NUMERICS,
              "top": [{"layer": d["layer"], "kl_mean": d["kl_mean"]} for d in dicts[:5]]}
    if cal_ids is not None:  # GPTQ Hessians, AWQ scales or KV cache scales came from it
        result.update(calibration_text=cal_text, calibration_tokens=list(cal_ids.shape))
    if awq is not None:
        result["awq"] = _awq_summary(awq)
    if gptq_summary is not None:
        result["gptq"] = gptq_summary
    if parallel.split:  # the planner reads a sweep for the GPU count it was made at
        result.update(tensor_parallel=parallel.tp, expert_parallel=parallel.expert_parallel)
    if unsmoothable:
        result["not_swept"] = unsmoothable

    def write(s: Session) -> None:
        repo.save_sensitivity(s, job_id=ctx.job_id, model_id=rec.id, scheme=name, rows=dicts)

    kept_note = (f" (from the cache: GPTQ {gptq_summary['from_cache']} of {gptq_summary['layers']} layers)"
                 if gptq_summary and gptq_summary["from_cache"] else "")
    not_swept = (f"; not swept: {len(unsmoothable)} layer(s) no llm-compressor recipe can smooth "
                 f"({name_list(unsmoothable, 2)})" if unsmoothable else "")
    return Outcome(result=result, write=write, message=f"{name}: {len(dicts)} units swept"
                   + (" on one GPU (its scales are the same on any number)" if rerouted else "") + kept_note
                   + not_swept)


def _sweepable(layers: list[str], scheme) -> tuple[list[str], list[str]]:
    """(the layers a sweep of ``scheme`` quantizes, those it leaves out). A SmoothQuant scheme leaves out the layers
    no llm-compressor recipe can smooth (o_proj, lm_head: quantcore.export.targets.smoothquant_unmapped): no served
    checkpoint holds that smoothing, the automatic planner never offers it there, and sweeping them would cost
    time for KLs nothing can use. A PlanError when that leaves nothing."""
    from quantcore.export.targets import smoothquant_unmapped

    if scheme.smoothquant_alpha is None:
        return layers, []
    left_out = [n for n in layers if smoothquant_unmapped(n)]
    swept = [n for n in layers if not smoothquant_unmapped(n)]
    if not swept:
        raise PlanError(f"{scheme.name}: no layer of this model can carry SmoothQuant in an llm-compressor recipe "
                         "(its Llama-style mappings smooth q/k/v_proj, gate/up_proj and down_proj); sweep a scheme "
                         "without SmoothQuant, e.g. INT8_W8A8")
    return swept, left_out
