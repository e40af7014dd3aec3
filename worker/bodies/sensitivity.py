"""The sensitivity job: KL of quantizing one linear unit (a layer or its fusion group) at a time with one preset,
or of storing one attention layer's K and V at a time in one KV cache format."""

from __future__ import annotations

from functools import partial
from typing import Any

from sqlalchemy.orm import Session

from jobs.specs import SensitivitySpec
from quantcore.errors import PlanError, name_list
from store import repo
from worker.bodies import evaluation as ev
from worker.bodies import streamed_rounding as sr
from worker.bodies import sweep_shards as shards
from worker.runner import JobContext, Outcome


def swept_on(asked: SensitivitySpec, model: Any):
    """The GPUs a sensitivity sweep quantizes each unit as on: the job's ``tensor_parallel`` / ``expert_parallel``
    (one GPU without them), refused with vLLM's reason where the model cannot be split so."""
    from quantcore.models.parallel import Parallelism, attention_heads, parse_tp

    tp = parse_tp(asked.gpus)
    return ev.splittable(model, Parallelism(tp, attention_heads(model.config) if tp > 1 else None,
                                            asked.expert_parallel and tp > 1))


def sensitivity(ctx: JobContext) -> Outcome:
    """A sweep of one preset over the linear units (the job's ``scheme``), or of one KV cache format over the
    attention layers (its ``kv_sweep``: stored as scheme "KV <format>"); :class:`jobs.specs.SensitivitySpec`."""
    from worker.bodies.streaming import prepared

    asked = SensitivitySpec.from_params(ctx.params)
    with prepared(ctx, asked) as (rec, model, tok, ids, label, streamed):
        return _sweep(ctx, asked, rec, model, tok, ids, label, streamed)


def _sweep(ctx: JobContext, asked: SensitivitySpec, rec: Any, model: Any, tok: Any, ids: Any, label: str,
           streamed: Any) -> Outcome:
    """:func:`sensitivity` on the prepared model: whole, or streamed with one load of each block for the whole sweep
    (``streamed``, a StreamedModel: quantcore.evaluation.streamed_sweep)."""
    from quantcore.algorithms.gptq import rounding_inputs
    from quantcore.evaluation.kvcache import get_kv_format
    from quantcore.evaluation.sensitivity import (
        kv_sensitivity_sweep,
        linear_layer_names,
        sensitivity_sweep,
        sweep_units,
    )
    from quantcore.evaluation.streamed_sweep import streamed_kv_sensitivity_sweep, streamed_sensitivity_sweep
    from quantcore.models.decoder import attention_modules
    from quantcore.models.parallel import ONE_GPU
    from quantcore.planning.plans import group_label
    from quantcore.schemes.numerics import NUMERICS
    from quantcore.schemes.presets import get_scheme
    from worker.bodies.streaming import streamed_kv_amax, streamed_reference

    rotation = _rotation(asked)
    compute = None if streamed is None else partial(streamed_reference, streamed)
    kv_calibrate = None if streamed is None else partial(streamed_kv_amax, streamed)
    awq, parallel, rerouted, gptq_summary = None, ONE_GPU, False, None
    unsmoothable: list[str] = []  # layers a SmoothQuant sweep leaves out (sweepable)
    if asked.kv_sweep:  # K and V are quantized per head: the same on any number of GPUs
        kv = get_kv_format(asked.kv_sweep)
        ref = ev.reference_for(ctx, rec, model, ids, label, asked.batch_size, compute=compute)
        cal_ids, cal_text = ev.calibration_ids(ctx, asked, tok, ids.device, kv.calibrated)
        amax, _ = ev.kv_amax(ctx, rec, model, kv, {}, cal_ids, calibrate=kv_calibrate)
        labels = list(attention_modules(model))  # the whole sweep's units; a shard sweeps its part
        mine = shards.my_part(asked, labels)
        if asked.method == "fisher" and mine:  # every attention layer from one backward pass (evaluation.fisher_kv)
            from quantcore.evaluation.fisher import fisher_sensitivity
            from quantcore.evaluation.fisher_kv import KV_PREFIX
            from quantcore.evaluation.fisher_streamed import streamed_fisher_sensitivity

            kv_asked = {"kv_caches": [kv.name], "kv_amax": amax, "kv_layers": mine, "progress": ctx.rest(),
                        "should_cancel": ctx.should_cancel}
            rows = (fisher_sensitivity(model, [], ids, ref, **kv_asked) if streamed is None
                    else streamed_fisher_sensitivity(streamed, [], ids, ref, **kv_asked))[KV_PREFIX + kv.name]
        elif mine:
            rows = (kv_sensitivity_sweep(model, kv.name, ids, ref, amax=amax, layers=mine, progress=ctx.rest(),
                                         should_cancel=ctx.should_cancel) if streamed is None
                    else streamed_kv_sensitivity_sweep(streamed, kv.name, ids, ref, amax=amax, layers=mine,
                                                       progress=ctx.rest(), should_cancel=ctx.should_cancel))
        else:
            rows = []
        name = repo.KV_SWEEP_PREFIX + kv.name
    else:
        scheme = get_scheme(str(asked.scheme))
        if asked.alpha is not None:
            scheme = scheme.with_alpha(asked.alpha)
        parallel = swept_on(asked, model)  # checked before the reference is computed
        swept, unsmoothable = sweepable(linear_layer_names(model), scheme, _online(model, rotation))
        units = sweep_units(swept, groups=asked.groups, per_expert=asked.per_expert)
        labels = [group_label(u) for u in units]  # the whole sweep's units; a shard sweeps its part
        swept = [n for unit in shards.my_part(asked, units) for n in unit]
        if parallel.split and not scheme.scaled_per_gpu_share:
            parallel, rerouted = ONE_GPU, True  # its scales are the same on any number of GPUs: read exactly so
        needs = ev.calibration_needs([scheme])
        cal = ev.calibration_for(ctx, asked, rec, scheme.needs_calibration, rotation)
        ref = ev.reference_for(ctx, rec, model, ids, label, asked.batch_size, compute=compute)
        cal_ids, cal_text = ev.calibration_ids(ctx, asked, tok, ids.device, ev.reads_calibration_text(needs))
        every = {n: scheme for n in ev.linear_names(rec) if n not in unsmoothable}
        unit_reads = {n: read for unit in units if set(unit) <= set(swept)
                      for n, read in rounding_inputs(dict.fromkeys(unit, scheme)).items()}
        kept, keep_at = ev.kept_gptq(ctx, rec, model, unit_reads, cal_ids, cal, rotation)
        # streamed: the swept GPTQ layers are rounded block by block before the sweep, each as its unit alone
        # (quantcore.evaluation.streamed_sweep), kept on disk in the job's scratch folder as the streamed score's
        hessians = (ev.hessians(ctx, model, every, cal_ids, cal_text, rounded=kept, rotation=rotation)
                    if streamed is None else None)
        awq = ev.awq_scales(ctx, rec, model, every, cal_ids, cal_text, rotation,
                            search=None if streamed is None else partial(sr.awq_search, streamed))
        gptq_cache = dict(kept) if streamed is None else sr.spilled_cache(ctx, kept)
        inputs = ev.calibration_inputs(cal).replace(weight_hessians=hessians, awq=awq, parallel=parallel,
                                                    gptq_cache=gptq_cache, rotation=rotation)
        if asked.method == "fisher" and swept:  # every unit from a few backward passes (quantcore.evaluation.fisher)
            from quantcore.evaluation.fisher import fisher_sensitivity
            from quantcore.evaluation.fisher_streamed import streamed_fisher_sensitivity

            if streamed is None:
                rows = fisher_sensitivity(model, [scheme], ids, ref, groups=asked.groups, layers=swept, inputs=inputs,
                                          per_expert=asked.per_expert, progress=ctx.rest(),
                                          should_cancel=ctx.should_cancel)[scheme.name]
            else:  # block-wise gradient checkpointing; GPTQ layers rounded block by block first, as the sweep's
                rows = streamed_fisher_sensitivity(streamed, [scheme], ids, ref, groups=asked.groups, layers=swept,
                                                   inputs=inputs, per_expert=asked.per_expert,
                                                   calibration_ids=cal_ids, progress=ctx.rest(),
                                                   should_cancel=ctx.should_cancel)[scheme.name]
        elif swept:
            if streamed is not None and unit_reads and len(kept) < len(unit_reads):
                ctx.progress(ctx.furthest, f"GPTQ: input Hessians and rounding of {len(unit_reads) - len(kept)} "
                             f"layer(s) on {cal_text}, block by block, then the sweep")
            rest = ctx.rest()
            rows = (sensitivity_sweep(model, scheme, ids, ref, groups=asked.groups, layers=swept, inputs=inputs,
                                      per_expert=asked.per_expert, progress=rest, should_cancel=ctx.should_cancel)
                    if streamed is None
                    else streamed_sensitivity_sweep(streamed, scheme, ids, ref, groups=asked.groups, layers=swept,
                                                    inputs=inputs, per_expert=asked.per_expert, progress=rest,
                                                    calibration_ids=cal_ids, should_cancel=ctx.should_cancel))
        else:
            rows = []
        not_kept = ev.keep_gptq(ctx, gptq_cache, keep_at)
        name = scheme.name
        if unit_reads:
            gptq_summary = ev.gptq_summary(unit_reads, kept, not_kept)
    dicts = [r.to_dict() for r in rows]
    result = {"scheme": name, "units": len(dicts), "text": label, "tokens": list(ids.shape), "numerics": NUMERICS,
              "top": [{"layer": d["layer"], "kl_mean": d["kl_mean"]} for d in dicts[:5]], "method": asked.method,
              "mode": "whole model" if streamed is None else "streamed"}
    if cal_ids is not None:  # GPTQ Hessians, AWQ scales or KV cache scales came from it
        result.update(calibration_text=cal_text, calibration_tokens=list(cal_ids.shape))
    if awq is not None:
        result["awq"] = ev.awq_summary(awq)
    if gptq_summary is not None:
        result["gptq"] = gptq_summary
    if parallel.split:  # the planner reads a sweep for the GPU count it was made at
        result.update(tensor_parallel=parallel.tp, expert_parallel=parallel.expert_parallel)
    if unsmoothable:
        result["not_swept"] = unsmoothable
    if rotation is not None:  # what every unit was quantized in: the planner reads rotated sweeps only for it
        result["rotation"] = rotation.to_dict()
    if asked.shard is not None:  # a shard's rows go to its sweep's merge (worker.bodies.sweep_shards), not the table
        return shards.shard_outcome(asked, result, dicts, labels)

    def write(s: Session) -> None:
        repo.save_sensitivity(s, job_id=ctx.job_id, model_id=rec.id, scheme=name, rows=dicts)

    kept_note = (f" (from the cache: GPTQ {gptq_summary['from_cache']} of {gptq_summary['layers']} layers)"
                 if gptq_summary and gptq_summary["from_cache"] else "")
    not_swept = (f"; not swept: {len(unsmoothable)} layer(s) no llm-compressor recipe can smooth "
                 f"({name_list(unsmoothable, 2)})" if unsmoothable else "")
    return Outcome(result=result, write=write, message=f"{name}: {len(dicts)} units swept"
                   + (f", rotated {rotation.label()}" if rotation is not None else "")
                   + (" on one GPU (its scales are the same on any number)" if rerouted else "") + kept_note
                   + not_swept)


def _rotation(asked: SensitivitySpec) -> Any:
    """The sweep's rotation (a RotationSpec) or None, whole or streamed (quantcore.evaluation.streamed_sweep rotates
    each block as it loads); PlanError for a malformed one or a KV cache sweep (not built rotated)."""
    if asked.rotation is None:
        return None
    from quantcore.algorithms.rotation_spec import rotation_from_dict

    rotation = rotation_from_dict(asked.rotation, "the sweep's rotation")
    if asked.kv_sweep:
        raise PlanError("a KV cache sweep does not take a rotation yet: sweep the KV cache format unrotated")
    return rotation


def _online(model: Any, rotation: Any) -> set[str]:
    """The layers whose input ``rotation`` rotates online (R4: every down_proj; V: every decoder linear); none
    without it."""
    online = [r for r in ("R4", "V") if rotation is not None and r in rotation.rotations]
    if not online:
        return set()
    from quantcore.algorithms.rotation import rotation_widths

    layers = rotation_widths(model).layers
    return {n for r in online for n in layers.get(r, ())}


def sweepable(layers: list[str], scheme: Any, online: set[str] | frozenset[str] = frozenset()
              ) -> tuple[list[str], list[str]]:
    """(the layers a sweep of ``scheme`` quantizes, those it leaves out). A SmoothQuant scheme leaves out the layers
    no llm-compressor recipe can smooth (o_proj, lm_head: quantcore.models.mappings.smoothquant_unmapped): no
    served checkpoint holds that smoothing, the automatic planner never offers it there, and sweeping them would
    cost time for KLs nothing can use; and the ``online`` ones, whose input a rotation's R4 rotates after the rows
    the factors would fold into (a rotated plan quantizes them unsmoothed). A PlanError when that leaves nothing."""
    from quantcore.models.mappings import smoothquant_unmapped

    if scheme.smoothquant_alpha is None:
        return layers, []
    left_out = [n for n in layers if smoothquant_unmapped(n) or n in online]
    swept = [n for n in layers if not (smoothquant_unmapped(n) or n in online)]
    if not swept:
        raise PlanError(f"{scheme.name}: no layer of this model can carry SmoothQuant in an llm-compressor recipe "
                        "(its Llama-style mappings smooth q/k/v_proj, gate/up_proj and down_proj); sweep a scheme "
                        "without SmoothQuant, e.g. INT8_W8A8")
    return swept, left_out
