"""What serving a plan runs into: memory with its KV cache, ideal step times, vLLM's refusals and warnings."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from quantplan.services.deployment import settings
from quantplan.services.models import attention_heads, layer_names, layer_shapes, routed_layers, unsplit_experts_warning
from quantplan.services.plans import bf16_body, kv_skipped, parallelism, resolve, resolved_or_raise, served_weight_bytes
from store import repo
from store.db import session_scope
from store.records import ModelRecord

if TYPE_CHECKING:
    from quantcore.kernels.roofline import StepBound
    from quantcore.models.parallel import Parallelism


def support_reasons(schemes: Iterable[str], target: str | None) -> list[str]:
    """Why each scheme of a plan that does not run natively on the target is emulated or unsupported there
    (quantcore.kernels.hardware.support_reason), one line per scheme; none for a CPU target or native schemes."""
    from quantcore.kernels.hardware import support_on_target, support_reason
    from quantcore.schemes.presets import get_scheme

    if not target:
        return []
    out = []
    for name in schemes:
        scheme = get_scheme(str(name))
        if scheme.weights is None:
            continue
        w, a = scheme.weights.format, scheme.activations.format if scheme.activations else None
        if support_on_target(target, w, a) != "native":
            out.append(f"{name}: {support_reason(target, w, a)}")
    return out


def split_refusals(model: ModelRecord, tp: int, expert_parallel: bool = False) -> list[str]:
    """Why vLLM would refuse to serve ``model`` over ``tp`` GPUs whatever the formats
    (quantcore.models.parallel.tp_misfits: heads, MLP widths); [] where it splits (and at one GPU). Asked before a job
    is queued for that many GPUs."""
    from quantcore.models.parallel import Parallelism, tp_misfits

    if tp <= 1:
        return []
    return tp_misfits(layer_shapes(model), Parallelism(tp, attention_heads(model), expert_parallel))


def plan_split_refusals(model: ModelRecord, body: dict[str, Any]) -> list[str]:
    """split_refusals at a plan body's own tensor_parallel / expert_parallel ([] for one GPU or a body that does
    not parse: the job says what is wrong with that)."""
    par = parallelism(model, body)
    return split_refusals(model, par.tp, par.expert_parallel)


def kv_memory(model: ModelRecord, body: dict[str, Any], target: str | None = None,
              context: int | None = None) -> dict[str, Any] | None:
    """The plan's KV cache next to BF16: bytes per token (every layer), and with a target GPU how many tokens
    of cache fit beside the weights (quantcore.evaluation.kvcache.kv_token_capacity: vLLM's 90 % memory share,
    activations not counted); with a ``context`` too, the cache of one sequence of that many tokens
    (sliding-window layers keep only their window) and how many such sequences fit. Weights = the plan's
    linear weights + every other parameter in BF16. None when the model has no separate k_proj / v_proj to
    count the cache from."""
    from quantcore.evaluation.kvcache import (
        get_kv_format,
        kv_bytes_per_sequence,
        kv_bytes_per_token,
        kv_token_capacity,
    )
    from quantcore.kernels.hardware import get_target
    from quantcore.models.parallel import kv_copies
    from quantcore.planning.plans import PlanSpec

    kv = get_kv_format(PlanSpec.from_dict(body).kv_cache)
    skip = kv_skipped(model, body)
    per_token = kv_bytes_per_token(model.linears, kv, skip=skip)
    bf16 = kv_bytes_per_token(model.linears, "AUTO")
    if per_token is None or bf16 is None:
        return None
    windows = model.attention_windows
    par = parallelism(model, body)
    copies = kv_copies(par)
    out: dict[str, Any] = {"kv_cache": kv.name, "bytes_per_token": per_token, "bf16_bytes_per_token": bf16,
                           "windowed_layers": len(windows), "windows": sorted(set(windows.values())),
                           "skipped_layers": len(skip), "tensor_parallel": par.tp, "kv_copies": copies}
    if context:
        out.update(context=context,
                   sequence_bytes=kv_bytes_per_sequence(model.linears, kv, context, windows=windows, skip=skip),
                   bf16_sequence_bytes=kv_bytes_per_sequence(model.linears, "AUTO", context, windows=windows))
    if target:
        from quantcore.planning.footprint import plan_footprint as footprint

        resolved = resolved_or_raise(model, body)
        weights, bf16_weights = served_weight_bytes(model, footprint(resolved, layer_shapes(model)), resolved)
        # tensor parallelism: the weights spread over tp GPUs' memory; a K/V head copied onto several GPUs
        # (more GPUs than key-value heads) is cached on each
        memory = get_target(target).memory_gb * par.tp
        out.update(target=target, memory_gb=memory, weight_bytes=weights, bf16_weight_bytes=bf16_weights,
                   tokens=kv_token_capacity(memory, weights, per_token * copies),
                   bf16_tokens=kv_token_capacity(memory, bf16_weights, bf16 * copies))
        if context:
            out.update(sequences=kv_token_capacity(memory, weights, out["sequence_bytes"] * copies),
                       bf16_sequences=kv_token_capacity(memory, bf16_weights, out["bf16_sequence_bytes"] * copies))
    return out


def decode_with_cache(model: ModelRecord, body: dict[str, Any], target: str, batch: int,
                      context: int) -> dict[str, float] | None:
    """The ideal decode step of ``batch`` sequences each holding ``context`` tokens of cache: the linears'
    roofline bound at M = batch plus reading each sequence's cache once (quantcore.kernels.roofline.kv_read_ms;
    sliding-window layers read only their window), for the plan and for all-BF16; at the plan's tensor_parallel,
    one GPU's step: its shard of the layers and its share of the cache. None where the model's
    cache cannot be counted (no k_proj / v_proj)."""
    from quantcore.evaluation.kvcache import kv_bytes_per_sequence
    from quantcore.kernels.roofline import kv_read_ms
    from quantcore.planning.plans import PlanSpec

    kv = PlanSpec.from_dict(body).kv_cache
    seq = kv_bytes_per_sequence(model.linears, kv, context, windows=model.attention_windows,
                                skip=kv_skipped(model, body))
    bf16_seq = kv_bytes_per_sequence(model.linears, "AUTO", context, windows=model.attention_windows)
    if seq is None or bf16_seq is None:
        return None
    from quantcore.models.parallel import kv_copies

    par = parallelism(model, body)
    share = kv_copies(par) / par.tp  # what one GPU of tp caches and reads
    linear, bf16_linear = (step_bound(model, b, target, batch).ms for b in (body, bf16_body(body)))
    kv_ms, bf16_kv_ms = (kv_read_ms(b * share, batch, target) for b in (seq, bf16_seq))
    return {"linear_ms": linear, "kv_ms": kv_ms, "ms": linear + kv_ms, "bf16_linear_ms": bf16_linear,
            "bf16_kv_ms": bf16_kv_ms, "bf16_ms": bf16_linear + bf16_kv_ms}


def target_names() -> dict[str, str]:
    """{target key: GPU name} of the GPUs in quantcore.kernels.hardware's table."""
    from quantcore.kernels.hardware import list_targets

    return {t.key: t.name for t in list_targets()}


def kv_backend_note(kv_cache: str, target: str) -> str | None:
    """Whether the KV format's attention assumption holds on a target GPU
    (quantcore.evaluation.kvcache.attention_backend_note)."""
    from quantcore.evaluation.kvcache import attention_backend_note
    from quantcore.kernels.hardware import get_target

    gpu = get_target(target)
    return attention_backend_note(kv_cache, gpu.sm, gpu.name)


def target_bandwidth(target: str) -> float:
    """Memory bandwidth of a target GPU in TB/s, from its datasheet."""
    from quantcore.kernels.hardware import get_target

    return get_target(target).memory_tbs


def step_bound(model: ModelRecord, body: dict[str, Any], target: str, m: int) -> StepBound:
    """quantcore.kernels.roofline.StepBound of a plan body on a target GPU at ``m`` tokens per step (the ideal
    time where nothing was measured); at the plan's tensor_parallel, one GPU's step over its shard of every layer
    (quantcore.models.parallel; the all-reduces between GPUs not counted). ValueError with the plan's problems when it
    does not resolve."""
    from quantcore.kernels.roofline import step_bound as bound

    resolved = resolved_or_raise(model, body)
    shapes = parallelism(model, body).first_gpu_shapes(layer_shapes(model))  # EP: the experts one GPU holds
    return bound({layer: resolved[layer] for layer in shapes}, shapes, target, m, routed_layers(model))


def parallel_notes(model: ModelRecord, par: Parallelism) -> list[str]:
    """What the tensor-parallel checks could not see: the model's attention heads (q/k/v are then taken to split
    evenly), layers outside the Llama-style layout (taken whole); and expert parallelism asked of a dense model."""
    from quantcore.models.parallel import unknown_layers

    out = []
    if par.expert_parallel and not routed_layers(model):
        out.append(f"expert_parallel: {model.name} has no routed experts (a dense model), so it changes nothing "
                   "here; vLLM's --enable-expert-parallel is for MoE models: drop it from the plan")
    tp = par.tp
    if tp <= 1:
        return out
    if par.heads is None:
        out.append(f"tensor_parallel {tp}: the model's config does not say how many attention heads it has, so "
                   f"q/k/v are checked as if each split in {tp} evenly; vLLM splits them by heads")
    unknown = unknown_layers(layer_names(model))
    if unknown:
        out.append(f"tensor_parallel {tp}: quantplan does not know how vLLM splits {len(unknown)} layer(s) (e.g. "
                   f"{unknown[0]}), outside the Llama-style q/k/v/o and gate/up/down: they are checked whole")
    return out


def serving_warnings(model: ModelRecord, body: dict[str, Any]) -> list[str]:
    """What serving this plan will run into though it resolves: at the plan's tensor_parallel, what vLLM refuses
    whatever the formats (quantcore.models.parallel.tp_misfits) and what the checks could not see (parallel_notes);
    groups that do not divide K (or each GPU's K) (quantcore.planning.serving.group_misfits), W4AFP8 layers vLLM's
    kernel cannot tile (quantcore.planning.serving.w4afp8_misfits), merged block-FP8 layers whose N the blocks do not
    divide (quantcore.planning.serving.fp8_block_misfits), activations vLLM quantizes otherwise than scored or not at
    all (quantcore.planning.serving.vllm_activation_misfits), SmoothQuant no llm-compressor recipe can carry
    (quantcore.export.targets.smoothquant_unexportable), layers AWQ cannot scale
    (quantcore.planning.serving.awq_unscaled), a quantized lm_head (quantcore.planning.serving.quantized_head), fused
    experts no plan reaches, and an unscaled KV cache that the newest calibration's K or V would overflow
    (quantcore.evaluation.kvcache.kv_clipping)."""
    from quantcore.evaluation.kvcache import kv_clipping
    from quantcore.export.vllm import serves_online_fp8
    from quantcore.models.mappings import smoothquant_unexportable, smoothquant_unexportable_message
    from quantcore.models.parallel import tp_misfits
    from quantcore.planning.plans import PlanSpec
    from quantcore.planning.serving import (
        awq_unscaled,
        fp8_block_misfits,
        group_misfits,
        marlin_misfits,
        moe_unserved,
        quantized_head,
        vllm_activation_misfits,
        w4afp8_misfits,
    )

    resolved, problem = resolve(model, body)
    if problem:
        return []
    assert resolved is not None  # resolve answers a plan or a problem
    shapes = layer_shapes(model)
    kv = PlanSpec.from_dict(body).kv_cache
    par = parallelism(model, body)
    warnings = (tp_misfits(shapes, par) + parallel_notes(model, par)
                + group_misfits(resolved, shapes, par) + w4afp8_misfits(resolved, shapes, par)
                + marlin_misfits(resolved, shapes, par)
                + fp8_block_misfits(resolved, shapes, par) + awq_unscaled(resolved, shapes)
                + vllm_activation_misfits(resolved, online_fp8=serves_online_fp8(resolved, list(resolved), kv))
                + quantized_head(resolved, shapes, model.tied_linears) + moe_unserved(resolved))
    if unsmoothable := smoothquant_unexportable(resolved):
        warnings.append("No llm-compressor recipe of this plan can be written: "
                        + smoothquant_unexportable_message(unsmoothable))
    if unsplit := unsplit_experts_warning(model):
        warnings.append(unsplit)
    if kv != "AUTO":
        with session_scope(settings()) as s:
            # not a rotated what-if calibration (issue #46): its V maxima are of the rotated model
            cal = next((c for c in repo.calibrations(s, model.id) if not (c.params or {}).get("rotation")), None)
        clipping = kv_clipping((cal.result or {}).get("kv_amax") if cal else None, kv)
        if clipping:
            warnings.append(clipping)
    return warnings
