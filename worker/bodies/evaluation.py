"""What a score and a sensitivity sweep share: the tokens they read, the unquantized model's reference
log-probs, the stored calibration statistics (a calibration run first where none is stored), and the inputs
that GPTQ, AWQ and a calibrated KV cache need, each kept beside the model's reference log-probs (store.cache) so
a later job that would compute the same reads it instead."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jobs.client import create_local_job
from jobs.specs import CalibrateSpec, TextJobSpec
from quantcore.algorithms.inputs import NO_INPUTS, PlanInputs
from quantcore.files import write_whole
from store import cache, repo
from store.db import session_scope
from store.records import ModelRecord
from worker.bodies.shared import token_ids
from worker.runner import JobContext, run_job


def linear_names(model_rec: ModelRecord) -> list[str]:
    """The stored model's linear layers, by name."""
    return [lin["name"] for lin in model_rec.linears]


def calibration_for(ctx: JobContext, asked: TextJobSpec, model_rec: ModelRecord, needed: bool, rotation: Any = None):
    """(calibration job id, its LayerStats) of the model for SmoothQuant / static scales: the newest calibration,
    or a new one run here first (recorded as its own calibrate job on the job's calibration token counts);
    None when not ``needed``. ``rotation`` (a RotationSpec): the newest calibration of the model rotated so, or a
    rotated one run first (whole model): statistics of the rotated model, as a rotated plan's scales and
    SmoothQuant factors need them (QuaRot / SpinQuant: rotate, then calibrate)."""
    if not needed:
        return None
    from quantcore.evaluation.stats import LayerStats
    from worker.bodies.calibrate import calibrate

    with session_scope(ctx.settings) as s:
        # a calibration rotated otherwise (or not at all) saw another model than the one scored here
        cal = next((c for c in repo.calibrations(s, model_rec.id) if rotation_of(c) == rotation), None)
    if cal is None:
        ctx.progress(0.02, "no stored calibration" + (f" rotated {rotation.label()}" if rotation else "")
                     + ": calibrating first")
        first = CalibrateSpec(device=asked.device, samples=asked.cal_samples, seq_len=asked.cal_seq_len,
                              stream=asked.stream,
                              rotation=rotation.to_dict() if rotation is not None else None)
        job = create_local_job("calibrate", first, model_id=model_rec.id, settings=ctx.settings)
        status = run_job(job.id, calibrate, settings=ctx.settings)
        if status != "succeeded":
            raise ValueError(f"the calibration this job needs (job #{job.id}) {status}")
        with session_scope(ctx.settings) as s:
            cal = repo.get_job(s, job.id)
    with session_scope(ctx.settings) as s:
        stats = [LayerStats.from_record(r) for r in repo.load_activation_stats(s, cal.id)]
    return cal.id, stats


def rotation_of(job: Any) -> Any:
    """The RotationSpec a calibration job ran under (its params' ``rotation``), None for a plain one; a stored
    rotation that no longer parses counts as none of today's (a string, never equal to a RotationSpec)."""
    raw = (job.params or {}).get("rotation")
    if not raw:
        return None
    from quantcore.algorithms.rotation_spec import rotation_from_dict
    from quantcore.errors import PlanError

    try:
        return rotation_from_dict(raw, "a stored calibration's rotation")
    except PlanError:
        return "malformed"


def rotated(model: Any, rotation: Any):
    """A context: ``model`` rotated by ``rotation`` (None: unchanged) while GPTQ's Hessians, AWQ's search or the
    KV cache's maxima are taken, so they are those of the rotated model the plan quantizes."""
    from quantcore.algorithms.rotation import rotation_applied

    return rotation_applied(model, rotation)


def _rotation_key(rotation: Any) -> dict[str, Any]:
    """A cache key's part for a rotation (nothing without one: the keys of unrotated results stay as they were)."""
    return {"rotation": rotation.to_dict()} if rotation is not None else {}


def calibration_inputs(cal) -> PlanInputs:
    """The plan inputs of :func:`calibration_for`'s statistics: ``{layer: max |x|}`` and ``{layer: per-channel
    max |x|}``, what static scales and SmoothQuant read (nothing calibrated without them)."""
    if cal is None:
        return NO_INPUTS
    _, stats = cal
    return PlanInputs(act_amax={st.name: st.amax for st in stats},
                      act_channel_max={st.name: st.channel_max for st in stats})


# the PlanInputs fields a job computes here by forwards of the calibration text (GPTQ Hessians, AWQ's searched
# scales); the calibrated statistics (act_amax, act_channel_max) come from a calibration job instead
TEXT_INPUTS = ("weight_hessians", "awq")


def calibration_needs(schemes: Iterable[Any]) -> dict[str, list[str]]:
    """{PlanInputs field: the rounding methods and transforms that read it} for ``schemes``
    (quantcore.algorithms.registry.calibration_needs), with every method and transform registered first."""
    import quantcore.algorithms.apply  # noqa: F401 - importing it registers RTN, GPTQ, AWQ and SmoothQuant
    from quantcore.algorithms.registry import calibration_needs as needs_of

    return needs_of(schemes)


def reads_calibration_text(needs: Mapping[str, Any]) -> bool:
    """True when a plan of these :func:`calibration_needs` needs forwards of the calibration text (GPTQ
    Hessians, AWQ scales)."""
    return any(field in needs for field in TEXT_INPUTS)


def calibration_ids(ctx: JobContext, asked: TextJobSpec, tok: Any, device: Any, needed: bool = True):
    """(token ids, label) of the calibration text: the job's ``cal_dataset`` or the built-in one, never the
    evaluation text; ``cal_samples`` x ``cal_seq_len`` tokens. (None, None) when not ``needed`` (no GPTQ
    Hessians, no AWQ scales, no KV cache scales): one tokenization serves them all."""
    if not needed:
        return None, None
    ids, label = token_ids(ctx, tok, "calibration", samples=asked.cal_samples, seq_len=asked.cal_seq_len,
                           dataset=asked.cal_dataset)
    return ids.to(device), label


def cache_key(**parts: Any) -> str:
    """A file-name-safe key of what a cached result was computed from; token tensors enter by their digest."""
    digest = {k: hashlib.sha256(v.cpu().numpy().tobytes()).hexdigest() if hasattr(v, "numpy") else v
              for k, v in parts.items()}
    return hashlib.sha256(json.dumps(digest, sort_keys=True).encode()).hexdigest()[:24]


def software() -> dict[str, str]:
    """The versions of the code a kept result came from: torch (its kernels' float rounding) and transformers (the
    model's forward: rotary embedding, masks, attention). Another version computes anew rather than read it."""
    import torch
    import transformers

    return {"torch": str(torch.__version__), "transformers": str(transformers.__version__)}


def reference_for(ctx: JobContext, model_rec: ModelRecord, model: Any, ids: Any, eval_label: str, batch_size: int,
                  compute: Any = None):
    """The unquantized model's reference on these tokens, cached in the artifact store: every log-prob where that
    is at most ``reference_full_max_mb``, else the compact top-k record (``reference_topk``); computed in the job
    and not kept (its ``kind`` then reads ``recomputed``) where it would not fit in the cache at all. ``compute``:
    what computes it (default quantcore.evaluation.reference.compute_reference; a streamed job's runs block by
    block)."""
    from quantcore.evaluation import reference

    ctx.cache_used = True  # the job's end keeps the cache under its limit (worker.runner.trim_cache)
    s = ctx.settings
    n, length = int(ids.shape[0]), int(ids.shape[1])
    topk = reference.choose_topk(n, length, reference.model_vocab(model),
                                 full_max_bytes=int(s.reference_full_max_mb * 2**20), topk=s.reference_topk)
    key = cache_key(text=eval_label, shape=list(ids.shape), ids=ids, topk=topk, **software())
    path = reference.reference_cache_path(s.reference_root, model_rec.sha256, key)
    if Path(path).exists():
        try:
            ref = reference.ReferenceCache.load(path)
        except reference.ReferenceMismatch as exc:  # damaged, of an older format, or just trimmed (store.cache): anew
            ctx.progress(0.05, f"computing reference log-probs again: {exc}")
        else:
            cache.mark_used(path)
            ctx.progress(0.1, f"reference log-probs from the cache ({ref.kind})")
            return ref
    else:
        what = "every log-prob" if topk is None else f"top {topk} a position"
        ctx.progress(0.05, f"computing reference log-probs ({what}; once per model and text)")
    ref = (compute or reference.compute_reference)(model, ids, batch_size=batch_size, model_sha=model_rec.sha256,
                                                   eval_key=key, topk=topk,
                                                   progress=lambda f, m: ctx.progress(0.05 + 0.25 * f, m),
                                                   should_cancel=ctx.should_cancel)
    if s.cache_max_bytes and ref.nbytes > s.cache_max_bytes:
        ref.recomputed = True  # one score's worth: kept only for this job, the cache could not hold it
    else:
        ref.save(path)
    return ref


def hessians(ctx: JobContext, model: Any, plan: dict[str, Any], cal_ids: Any, text: str | None,
             rounded: Any = (), rotation: Any = None) -> dict[str, Any] | None:
    """GPTQ Hessians of the plan's layers that round with GPTQ, from the unquantized model on the calibration
    tokens (rotated by ``rotation`` first: the Hessians of the rotated inputs the rotated weights are rounded
    against); None when no layer does, or all are ``rounded`` already (:func:`kept_gptq`)."""
    from quantcore.algorithms.gptq import collect_hessians

    layers = [n for n, s in plan.items() if s.needs_hessians and n not in rounded]
    if rounded:
        ctx.progress(0.3, f"GPTQ: {len(rounded)} layer(s) rounded by an earlier job, from the cache")
    if not layers:
        return None
    ctx.progress(0.3, f"GPTQ: input Hessians of {len(layers)} layer(s) on {text}"
                 + (f", rotated {rotation.label()}" if rotation is not None else ""))
    with rotated(model, rotation):
        return collect_hessians(model, layers, cal_ids, should_cancel=ctx.should_cancel)


def kept_gptq(ctx: JobContext, rec: ModelRecord, model: Any, reads: dict[str, dict[str, Any]], cal_ids: Any, cal,
              rotation: Any = None):
    """GPTQ-rounded weights kept beside the model's reference log-probs by earlier jobs: ({layer: weight} found,
    {layer: file} to keep the others at once rounded, :func:`keep_gptq`). ``reads``: what each GPTQ layer's
    rounding reads of the plan it is applied in (quantcore.algorithms.gptq.rounding_inputs; a sweep applies one
    unit at a time). The key is everything the rounding reads (quantcore.algorithms.gptq.rounding_inputs: the
    schemes of the layer's fusion group, of the o_proj / down_proj folding into its rows and of the plan's AWQ
    layers; the calibration tokens, the calibration statistics where SmoothQuant divides by them, the weights'
    dtype, the device kind, torch's and transformers' versions, quantplan's numerics, the plan's rotation), so a
    plan rounds a layer
    once whichever job asks again: a second score, the automatic plan's check after a sweep."""
    from safetensors.torch import load_file

    from quantcore.schemes.numerics import NUMERICS

    if cal_ids is None or not reads:
        return {}, {}
    tokens = cache_key(tokens=cal_ids, shape=list(cal_ids.shape))
    dtype = str(next(model.parameters()).dtype)
    versions = software()  # another torch may round a float the other way in the Cholesky
    folder = ctx.settings.model_reference_dir(rec.sha256)
    modules = dict(model.named_modules())
    found, paths = {}, {}
    for layer, read in reads.items():
        key = cache_key(tokens=tokens, dtype=dtype, device=cal_ids.device.type, numerics=NUMERICS, **versions,
                        calibration=cal[0] if read["smoothed"] and cal else None, **read, **_rotation_key(rotation))
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


def keep_gptq(ctx: JobContext, rounded: dict[str, Any], paths: dict[str, Path]) -> str | None:
    """Write the layers of ``rounded`` that ``paths`` wants kept (:func:`kept_gptq`), each whole or not at all
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
        write_whole(path, functools.partial(_save_weight, save_file, rounded[layer]))
    return None


def _save_weight(save_file: Any, weight: Any, part: str) -> None:
    """Write one rounded weight as a safetensors file (its only tensor, ``weight``, on the CPU)."""
    save_file({"weight": weight.detach().contiguous().cpu()}, part)


def gptq_summary(reads: dict[str, Any], kept: dict[str, Any], not_kept: str | None = None) -> dict[str, Any]:
    """What a result keeps of a job's GPTQ: the layers it rounded, how many of them an earlier job had, and why
    its own roundings were not kept, where they were not (:func:`keep_gptq`)."""
    return {"layers": len(reads), "from_cache": len(kept), **({"not_kept": not_kept} if not_kept else {})}


def awq_scales(ctx: JobContext, rec: ModelRecord, model: Any, plan: dict[str, Any], cal_ids: Any, text: str | None,
               rotation: Any = None, search: Any = None):
    """AWQ's searched input scales for the plan's layers that scale with AWQ, on the calibration tokens; None
    when no layer does. Kept beside the model's reference log-probs, keyed by everything the search reads (the
    calibration tokens, the AWQ layers and their weight format, the grid, the device kind, the weights' dtype,
    torch's and transformers' versions, quantplan's numerics), so another score or a sweep of the same AWQ layers
    reuses it; ``.cached`` says whether it came from there (a damaged file is searched again). ``rotation``: searched
    on the model rotated so (in the key too); a down_proj whose input R4 rotates online is left unscaled, said in
    ``skipped`` (its factors would fold into up_proj's rows, before the online Hadamard). ``search``: what runs
    the search in :func:`quantcore.algorithms.awq.awq_search`'s place (a streamed job's, block by block:
    worker.bodies.streamed_rounding)."""
    from quantcore.algorithms.awq import awq_search, load_awq, save_awq
    from quantcore.schemes.numerics import NUMERICS
    from quantcore.schemes.specs import AWQ_DUO_SCALING, AWQ_N_GRID

    layers = [n for n, s in plan.items() if s.needs_awq]
    if not layers:
        return None
    key = cache_key(tokens=cal_ids, shape=list(cal_ids.shape), grid=[AWQ_N_GRID, AWQ_DUO_SCALING],
                    layers={n: plan[n].weights.to_dict() for n in sorted(layers)}, device=cal_ids.device.type,
                    dtype=str(next(model.parameters()).dtype), numerics=NUMERICS, **software(),
                    **_rotation_key(rotation))
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
    with rotated(model, rotation) as handle:
        online = set(handle.online) if handle is not None else set()
        found = (search or awq_search)(model, {n: s for n, s in plan.items() if n not in online}, cal_ids,
                           should_cancel=ctx.should_cancel, progress=lambda _f, message: ctx.progress(0.3, message))
    found.skipped.update({n: "R4 rotates its input online, after up_proj's rows where AWQ's factors would fold "
                             "(the rotation spreads its outliers instead)" for n in layers if n in online})
    save_awq(found, path)
    return found


def awq_summary(found: Any) -> dict[str, Any]:
    """What a result row keeps of an AWQ search: mappings searched, layers left unscaled, and how much the best
    scales cut the mappings' output error (median of best / unscaled)."""
    ratios = sorted(best / first for first, best, _ in found.errors.values() if first > 0)
    return {"mappings": len(found.errors), "unscaled_layers": len(found.skipped),
            "median_error_ratio": ratios[len(ratios) // 2] if ratios else None, "cached": found.cached}


def kv_amax(ctx: JobContext, rec: ModelRecord, model: Any, kv: Any, plan: dict[str, Any], cal_ids: Any, cal=None,
            inputs: PlanInputs = NO_INPUTS, calibrate: Any = None):
    """Per-layer K/V amax for a calibrated KV format, with ``plan`` applied with its ``inputs`` (their
    ``gptq_cache`` filled here), on the calibration tokens (the job's
    ``cal_dataset`` or the built-in text), never the evaluation text; None for a format without calibrated
    scales. Kept beside the model's reference log-probs as ``kv-<key>.json``, keyed by what the pass reads (the
    plan's quantized layers and their schemes, the calibration statistics ``cal`` they use, the calibration
    tokens, the GPUs, the weights' dtype, the device kind, torch's and transformers' versions, quantplan's
    numerics; not the KV format: K and V are observed before it quantizes them), so another score of the plan
    with a calibrated KV cache (another format, another evaluation text) reads it; a damaged file (unreadable,
    or without every attention layer) is calibrated again. Returns (amax, whether it came from there).
    ``calibrate``: what runs the pass (default quantcore.evaluation.scoring.calibrate_kv_cache; a streamed job's
    runs block by block)."""
    from quantcore.evaluation.kvcache import KvAmax
    from quantcore.evaluation.scoring import calibrate_kv_cache
    from quantcore.models.decoder import attention_modules
    from quantcore.schemes.numerics import NUMERICS

    if not kv.calibrated:
        return None, False
    key = cache_key(tokens=cache_key(tokens=cal_ids, shape=list(cal_ids.shape)),
                    plan={n: s.to_dict() for n, s in sorted(plan.items()) if not s.is_identity},
                    calibration=cal[0] if cal else None, **_rotation_key(inputs.rotation),
                    gpus=[inputs.parallel.tp, inputs.parallel.expert_parallel] if inputs.parallel else [1, False],
                    dtype=str(next(model.parameters()).dtype), device=cal_ids.device.type, numerics=NUMERICS,
                    **software())
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
    amax = (calibrate or calibrate_kv_cache)(model, plan, cal_ids, inputs=inputs, should_cancel=ctx.should_cancel)
    write_whole(path, lambda part: Path(part).write_text(json.dumps(amax.to_dict())))
    return amax, False


def splittable(model: Any, parallel: Any) -> Any:
    """``parallel``, or ValueError with vLLM's reasons where it would refuse to split the model so
    (quantcore.models.parallel.tp_misfits)."""
    import torch

    from quantcore.models.parallel import tp_misfits

    shapes = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    misfits = tp_misfits(shapes, parallel)
    if misfits:
        raise ValueError("; ".join(misfits))
    return parallel
