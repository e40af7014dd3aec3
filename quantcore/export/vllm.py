"""The vLLM target: the ``vllm serve`` command line that serves a plan, with comment lines that say how
(torch-free)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from quantcore.errors import PlanError
from quantcore.evaluation.kvcache import KvCacheFormat, get_kv_format, normalize_kv_skip
from quantcore.export.common import checked_plan, group_plan, scheme_counts
from quantcore.planning.serving import expert_mix, is_w4afp8, mixed_expert_blocks
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme

# vLLM
VLLM_ONLINE_FP8_SCHEME = "FP8_PER_TENSOR"  # `--quantization fp8`: E4M3 per-tensor weights, dynamic
#                                            per-tensor activations, every Linear except lm_head
VLLM_UNQUANTIZED_HEAD = "lm_head"  # vLLM's online FP8 never quantizes the output head
DEFAULT_RECIPE_FILE = "recipe.yaml"
COMPRESSED_SUFFIX = "-quantplan"  # default output folder of the compression step: <model><suffix>


def serves_online_fp8(plan: Mapping[str, Scheme | str], layer_names: Sequence[str],
                      kv_cache: str | KvCacheFormat | None = None) -> bool:
    """True when vLLM applies the plan itself at load time (``--quantization fp8``): every layer but lm_head in
    FP8_PER_TENSOR, lm_head (if any) unquantized, and no calibrated KV cache scales to carry in a checkpoint."""
    online_fp8 = get_scheme(VLLM_ONLINE_FP8_SCHEME)
    body = [n for n in layer_names if n != VLLM_UNQUANTIZED_HEAD]
    return (not get_kv_format(kv_cache).calibrated and bool(body)
            and all(get_scheme(plan[n]) == online_fp8 for n in body)
            and all(get_scheme(plan[n]).is_identity for n in layer_names if n == VLLM_UNQUANTIZED_HEAD))


def to_vllm_command(
    plan: Mapping[str, Scheme | str],
    *,
    model_path: str,
    layer_names: Sequence[str],
    compressed_path: str | None = None,
    recipe_path: str = DEFAULT_RECIPE_FILE,
    kv_cache: str | KvCacheFormat | None = None,
    kv_skip: Sequence[str] = (),
    tensor_parallel: int = 1,
    expert_parallel: bool = False,
) -> str:
    """The ``vllm serve`` command line for ``plan``, with ``#`` comment lines that say how.

    - every layer but ``lm_head`` in ``FP8_PER_TENSOR``, ``lm_head`` (if any) BF16: vLLM's
      online dynamic FP8 is exactly that plan: ``vllm serve <model_path> --quantization fp8``;
    - every layer BF16: ``vllm serve <model_path>``;
    - anything else needs a compressed checkpoint: comment lines give the llm-compressor
      step (with ``recipe_path``; whether calibration data is needed), then
      ``vllm serve <compressed_path> --quantization compressed-tensors``
      (``compressed_path`` defaults to ``<model_path>-quantplan``).

    ``kv_cache`` (:mod:`quantcore.evaluation.kvcache`) adds ``--kv-cache-dtype``: ``FP8_UNSCALED`` and
    ``FP8_E5M2`` are that flag alone (scale 1.0); ``FP8``'s calibrated scales come from the
    llm-compressor checkpoint, so a plan with it always goes through the compression step.
    ``kv_skip`` (a plan's ``kv_cache_skip``: layer indices, ``sliding_window``) adds
    ``--kv-cache-dtype-skip-layers``: those layers keep the model's dtype.
    ``tensor_parallel`` above 1 (a plan's ``tensor_parallel``) adds ``--tensor-parallel-size``, ``expert_parallel``
    ``--enable-expert-parallel``.
    Raises PlanError for plans llm-compressor cannot express, and for a per-expert plan whose experts of one MoE
    block differ (vLLM's fused MoE runs a block with one method).
    """
    names = list(layer_names)
    resolved = checked_plan(plan, names)
    mixed = mixed_expert_blocks(resolved)
    if mixed:
        blocks = "; ".join(f"{block}: {expert_mix(by)}" for block, by in mixed.items())
        raise PlanError(f"This plan cannot be served by vLLM: its fused MoE layer runs every expert of a block with "
                        f"one quantization method, and {len(mixed)} MoE block(s) give their experts different "
                        f"schemes ({blocks}). Export it for llm-compressor (its recipe and the compressed-tensors "
                        "checkpoint hold per-expert schemes), or give each block's experts one scheme (a plan "
                        "without per_expert)")
    groups, unquantized = group_plan(resolved, names)  # raises for what cannot be expressed
    kvf = get_kv_format(kv_cache)
    skip = [] if kvf.is_identity else normalize_kv_skip(kv_skip)
    flags = [] if kvf.is_identity else ["--kv-cache-dtype", kvf.vllm_dtype]
    if skip:
        flags += ["--kv-cache-dtype-skip-layers", *skip]
    if tensor_parallel > 1:
        flags += ["--tensor-parallel-size", str(tensor_parallel)]
    if expert_parallel:
        flags.append("--enable-expert-parallel")
    counts = ", ".join(f"{s} x{n}" for s, n in scheme_counts(resolved).items())
    if not kvf.is_identity:
        counts += f"; KV cache {kvf.name}" + (f" except layers {', '.join(skip)}" if skip else "")
    lines = [f"# quantplan plan for {model_path}: {counts}"]
    if skip:
        lines.append(f"# --kv-cache-dtype-skip-layers keeps the cache of {', '.join(skip)} in the model's dtype "
                     "(a recent vLLM flag: check that yours has it)")
    if kvf.element == "fp8_e4m3" and not kvf.calibrated:
        lines.append("# FP8 KV cache without calibrated scales: vLLM's K and V scales default to 1.0, so |K|, |V| "
                     "above 448 saturate (the plan's score shows whether they do)")
    if kvf.per_head:
        lines.append("# per-head K/V scales (kv_cache_scheme strategy attn_head): only vLLM's FlashAttention backend "
                     "reads them, and its FP8 path is FlashAttention 3 on Hopper (sm90); elsewhere score kv_cache FP8 "
                     "(one scale per layer)")
        lines.append("# FP8 attention: FlashAttention 3 quantizes Q (scale 1.0: no q_scale in the checkpoint) and the "
                     "softmax probabilities to E4M3 with this cache, as the plan's score emulated")
    elif kvf.attention:
        lines.append("# FP8 attention: vLLM's FlashAttention 3 backend (its default on Hopper) quantizes Q (scale 1.0: "
                     "no q_scale in the checkpoint) and the softmax probabilities to E4M3 with this cache, as the "
                     "plan's score emulated; a backend that dequantizes the cache (FlashInfer, Triton) keeps "
                     f"attention in BF16, which is kv_cache {kvf.name.replace('_ATTN', '')}")
    elif kvf.element == "fp8_e4m3":
        lines.append(f"# kv_cache {kvf.name} was scored with attention in BF16 (a backend that dequantizes the cache); "
                     "on Hopper vLLM's FlashAttention 3 backend runs attention itself in FP8 with this cache (Q at "
                     f"scale 1.0, softmax probabilities in E4M3): score kv_cache {kvf.name.replace('FP8', 'FP8_ATTN')} "
                     "to see that")
    w4afp8 = [n for n in names if is_w4afp8(resolved[n])]
    if w4afp8:
        lines.append(f"# W4AFP8 ({len(w4afp8)} layer(s)): vLLM serves INT4 weights with FP8 activations by its CUTLASS "
                     "W4A8 kernel alone, built for Hopper (sm90): on any other GPU this checkpoint does not load")
    if not groups and not kvf.calibrated:
        lines.append("# every layer stays unquantized: serve the model as it is")
        cmd = ["vllm", "serve", model_path, *flags]
    elif serves_online_fp8(resolved, names, kvf):
        lines.append(
            "# vLLM applies this plan at load time (online dynamic FP8: E4M3 per-tensor weight scales, "
            "dynamic per-tensor activation scales, lm_head unquantized); no calibration, no checkpoint"
        )
        cmd = ["vllm", "serve", model_path, "--quantization", "fp8", *flags]
    else:
        out = compressed_path or model_path.rstrip("/") + COMPRESSED_SUFFIX
        needs_data = kvf.calibrated or any(
            s.needs_calibration or s.needs_hessians or s.needs_awq
            or (s.activations is not None and s.activations.format == "nvfp4")
            for s in resolved.values()
        )
        lines += [
            "# vLLM cannot apply this plan at load time: serve the compressed-tensors checkpoint that llm-compressor",
            f"# makes with the exported recipe ({recipe_path}):",
            f'#   python -c "from llmcompressor import oneshot; oneshot(model={model_path!r}, '
            f"recipe={recipe_path!r}, output_dir={out!r}"
            + (', dataset=..., num_calibration_samples=512)"' if needs_data else ')"'),
        ]
        if needs_data:
            lines.append(
                "#   (needs calibration data: static activation or KV cache scales, NVFP4 global scales, "
                "SmoothQuant, GPTQ or AWQ)"
            )
        else:
            lines.append("#   (runs without calibration data: weights only and dynamic activation scales)")
        cmd = ["vllm", "serve", out, "--quantization", "compressed-tensors", *flags]
    lines.append(shlex.join(cmd))
    return "\n".join(lines) + "\n"
