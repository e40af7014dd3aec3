"""The compressed-tensors target: a plan as the ``quantization_config`` that llm-compressor writes into a compressed
checkpoint's ``config.json`` and vLLM reads, and back (torch-free)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from quantcore.errors import PlanError
from quantcore.errors import format_problems as _format
from quantcore.evaluation.kvcache import KvCacheFormat
from quantcore.export.common import (
    Claim,
    assign_schemes,
    checked_plan,
    config_group,
    ct_groups,
    group_plan,
    targets_list,
)
from quantcore.export.quant_args import (
    CT_QUANT_METHOD,
    CT_STATUS_COMPRESSED,
    FORMAT_MIXED,
    kv_cache_from_args,
    kv_cache_scheme,
)
from quantcore.schemes.specs import Scheme
from quantcore.schemes.targets import LINEAR_CLASS, compact_targets


def to_compressed_tensors_config(
    plan: Mapping[str, Scheme | str], *, layer_names: Sequence[str], kv_cache: str | KvCacheFormat | None = None
) -> dict[str, Any]:
    """The compressed-tensors ``quantization_config`` of the checkpoint llm-compressor makes from ``plan``.

    JSON-able dict: ``quant_method``, ``format`` (one CompressionFormat or
    ``mixed-precision``), ``quantization_status: compressed``, ``config_groups`` (each with
    targets, weights, input_activations and its own ``format``), ``ignore`` (BF16 layers),
    ``kv_cache_scheme`` (the FP8 args for a calibrated FP8 KV cache, else None). SmoothQuant
    leaves no trace here: it is folded into the weights before quantization.
    """
    names = list(layer_names)
    resolved = checked_plan(plan, names)
    groups, unquantized = group_plan(resolved, names)
    if len(groups) == 1:
        config_groups = {"group_0": config_group(groups[0], [LINEAR_CLASS], with_format=True)}
    else:
        config_groups = {
            f"group_{i}": config_group(g, compact_targets(g.layers, names), with_format=True)
            for i, g in enumerate(groups)
        }
    formats = {g.format for g in groups}
    fmt = "dense" if not formats else (formats.pop() if len(formats) == 1 else FORMAT_MIXED)
    return {
        "quant_method": CT_QUANT_METHOD,
        "format": fmt,
        "quantization_status": CT_STATUS_COMPRESSED,
        "config_groups": config_groups,
        "ignore": compact_targets(unquantized, names),
        "kv_cache_scheme": kv_cache_scheme(kv_cache),
        "global_compression_ratio": None,
    }


def from_compressed_tensors_config(
    cfg: Mapping[str, Any], *, layer_names: Sequence[str]
) -> dict[str, Scheme]:
    """The per-layer plan a compressed-tensors ``quantization_config`` describes.

    ``cfg`` is the ``quantization_config`` dict or a whole ``config.json`` holding one.
    Every layer of ``layer_names`` gets a scheme (BF16 when ignored or not targeted).
    Raises PlanError naming each config group or layer quantplan cannot represent.
    """
    if isinstance(cfg, Mapping) and "quantization_config" in cfg:
        cfg = cfg["quantization_config"]
    if not isinstance(cfg, Mapping):
        raise PlanError(f"a quantization_config must be a mapping, got {type(cfg).__name__}")
    problems: list[str] = []
    method = cfg.get("quant_method", CT_QUANT_METHOD)
    if method != CT_QUANT_METHOD:
        raise PlanError(f"quant_method is {method!r}; quantplan imports {CT_QUANT_METHOD!r} configs only")
    kv_cache_from_args(cfg.get("kv_cache_scheme"), "quantization_config", problems)
    if cfg.get("sparsity_config"):
        problems.append("sparsity_config is set: quantplan plans quantization only")
    groups = ct_groups(cfg.get("config_groups", {}), "", problems)
    ignore = targets_list(cfg.get("ignore"), "ignore", problems)
    plan = assign_schemes(list(layer_names), [Claim("quantization_config", groups, ignore)], {}, problems)
    if problems:
        raise PlanError(_format("This compressed-tensors config cannot be imported", problems))
    return plan


def kv_cache_of_config(cfg: Mapping[str, Any]) -> str:
    """The KV cache format of a compressed-tensors ``quantization_config`` (or a ``config.json`` holding
    one): ``FP8`` for static per-tensor E4M3 K/V scales, else ``AUTO``. Check the layers with
    :func:`from_compressed_tensors_config`, which refuses a kv_cache_scheme quantplan cannot represent."""
    if isinstance(cfg, Mapping) and "quantization_config" in cfg:
        cfg = cfg["quantization_config"]
    return kv_cache_from_args(cfg.get("kv_cache_scheme") if isinstance(cfg, Mapping) else None, "", [])
