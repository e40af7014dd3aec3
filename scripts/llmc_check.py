"""Load llm-compressor recipes with the real package and print what it parsed, as JSON.

Runs INSIDE .venv-llmc (see scripts/llmc_env.sh), never in quantplan's own environment:

    .venv-llmc/bin/python scripts/llmc_check.py recipe1.yaml [recipe2.yaml ...] [--presets NAME ...]

For every recipe path, ``llmcompressor.recipe.Recipe.create_instance(path)`` builds the modifiers
and the summary lists, in order, for each one:

- QuantizationModifier / GPTQModifier: ``config_groups`` as llm-compressor *resolved* them
  (presets expanded into QuantizationArgs, targets attached), ``ignore``, ``kv_cache_scheme``;
- SmoothQuantModifier: ``smoothing_strength`` and ``mappings`` as given;
- AWQModifier: ``duo_scaling`` and ``n_grid``, and (with ``--llama-blocks``) the mappings it resolves and would
  search on the tiny Llama with the recipe's quantization applied (``"resolved_mappings"``);
- anything else: its type and group.

``--presets`` adds the QuantizationArgs of the named compressed-tensors presets
(``preset_name_to_scheme``).

``--llama-blocks N`` also builds a tiny random Llama with N decoder blocks (hidden 64, GQA 4/2
heads; from a config, nothing downloaded) and, for each recipe, applies every quantization
modifier's resolved config to a fresh copy with compressed-tensors' own
``apply_quantization_config`` — reporting the args each ``nn.Linear`` really got
(``"layers"``) — and resolves every SmoothQuantModifier's mappings on it with
llm-compressor's own resolver (``"resolved_mappings"``: [smooth layer, [balance layers]]).

Output: one JSON object on stdout::

    {"versions": {...},
     "recipes": {path: {"modifiers": [...], "layers": {...}} | {"error": "..."}},
     "presets": {name: {"weights": {...} | null, "input_activations": {...} | null}}}

Exit status 1 when any recipe failed to load (its entry then carries the error text).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import json
import sys
from typing import Any


def _args(args: Any) -> dict[str, Any] | None:
    return None if args is None else args.model_dump(mode="json")


def _scheme(scheme: Any) -> dict[str, Any]:
    return {
        "targets": list(scheme.targets),
        "weights": _args(scheme.weights),
        "input_activations": _args(scheme.input_activations),
        "output_activations": _args(scheme.output_activations),
    }


TINY_LLAMA = {  # a Llama small enough to build in milliseconds; names match any Llama checkpoint
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}


def tiny_llama(blocks: int) -> Any:
    """A fresh random LlamaForCausalLM with ``blocks`` decoder blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=blocks, **TINY_LLAMA)).eval()


def applied_layers(modifier: Any, blocks: int) -> dict[str, Any]:
    """{linear name: its quantization args, or None} after compressed-tensors applies the modifier's config."""
    import torch
    from compressed_tensors.quantization import apply_quantization_config

    model = tiny_llama(blocks)
    apply_quantization_config(model, modifier.resolved_config, show_progress=False)
    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            scheme = getattr(module, "quantization_scheme", None)
            out[name] = (
                None
                if scheme is None
                else {"weights": _args(scheme.weights), "input_activations": _args(scheme.input_activations)}
            )
    return out


def applied_kv_scales(modifier: Any, blocks: int) -> dict[str, dict[str, list[int]]]:
    """{attention module: {"k": k_scale shape, "v": v_scale shape}} after compressed-tensors applies the modifier's
    kv_cache_scheme to a tiny Llama: one scale per layer, or one per KV head (strategy attn_head)."""
    from compressed_tensors.quantization import apply_quantization_config

    model = tiny_llama(blocks)
    apply_quantization_config(model, modifier.resolved_config, show_progress=False)
    return {name: {t: list(getattr(module, f"{t}_scale").shape) for t in ("k", "v")}
            for name, module in model.named_modules() if hasattr(module, "k_scale")}


def resolved_mappings(modifier: Any, blocks: int) -> list[list[Any]]:
    """[smooth layer name, [balance layer names]] as llm-compressor resolves the mappings on a tiny Llama."""
    model = tiny_llama(blocks)
    names = {m: n for n, m in model.named_modules()}
    return [[m.smooth_name, [names[b] for b in m.balance_layers]] for m in modifier._resolve_mappings(model)]


def resolved_awq_mappings(modifier: Any, modifiers: list[Any], blocks: int) -> list[list[Any]]:
    """[smooth layer name, [balance layer names]] of the mappings an AWQModifier searches on a tiny Llama, after the
    recipe's quantization modifiers attached their schemes (AWQ skips a mapping whose layers none quantizes, and
    v_proj -> o_proj under grouped-query attention)."""
    from compressed_tensors.quantization import apply_quantization_config

    model = tiny_llama(blocks)
    for other in modifiers:
        if hasattr(other, "resolved_config"):
            apply_quantization_config(model, other.resolved_config, show_progress=False)
    modifier._set_resolved_mappings(model)
    return [[m.smooth_name, list(m.balance_names)] for m in modifier._resolved_mappings]


def summarize(path: str, blocks: int | None = None) -> dict[str, Any]:
    """The modifiers llm-compressor builds from the recipe at ``path`` (and, with ``blocks``, their effect)."""
    from llmcompressor.recipe import Recipe

    recipe = Recipe.create_instance(path)
    mods: list[dict[str, Any]] = []
    for m in recipe.modifiers:
        entry: dict[str, Any] = {"type": type(m).__name__, "group": getattr(m, "group", None)}
        if hasattr(m, "resolved_config"):
            cfg = m.resolved_config
            entry["config_groups"] = {name: _scheme(s) for name, s in cfg.config_groups.items()}
            entry["ignore"] = list(cfg.ignore or [])
            entry["kv_cache_scheme"] = _args(cfg.kv_cache_scheme)
            entry["requires_calibration_data"] = bool(getattr(m, "requires_calibration_data", False))
            if hasattr(m, "dampening_frac"):  # GPTQModifier
                entry["gptq"] = {"block_size": m.block_size, "dampening_frac": m.dampening_frac}
            if blocks:
                entry["layers"] = applied_layers(m, blocks)
                if cfg.kv_cache_scheme is not None:
                    entry["kv_scale_shapes"] = applied_kv_scales(m, blocks)
        elif hasattr(m, "n_grid"):  # AWQModifier
            entry["awq"] = {"duo_scaling": m.duo_scaling, "n_grid": m.n_grid}
            entry["requires_calibration_data"] = bool(getattr(m, "requires_calibration_data", False))
            if blocks:
                entry["resolved_mappings"] = resolved_awq_mappings(m, recipe.modifiers, blocks)
        elif hasattr(m, "smoothing_strength"):
            entry["smoothing_strength"] = m.smoothing_strength
            entry["mappings"] = [
                [list(b) if isinstance(b, (list, tuple)) else b for b in mp] for mp in (m.mappings or [])
            ]
            if blocks:
                entry["resolved_mappings"] = resolved_mappings(m, blocks)
        mods.append(entry)
    return {"stage": recipe.stage, "modifiers": mods}


def presets(names: list[str]) -> dict[str, Any]:
    """QuantizationArgs of compressed-tensors presets, as llm-compressor expands them."""
    from compressed_tensors.quantization import preset_name_to_scheme

    out = {}
    for name in names:
        s = preset_name_to_scheme(name, ["Linear"])
        out[name] = {"weights": _args(s.weights), "input_activations": _args(s.input_activations)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", help="recipe YAML/JSON files to load")
    parser.add_argument("--presets", nargs="*", default=[], help="compressed-tensors preset names to expand")
    parser.add_argument(
        "--llama-blocks",
        type=int,
        default=0,
        help="apply each recipe to a tiny random Llama with this many blocks and report per layer",
    )
    ns = parser.parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):
        out: dict[str, Any] = {
            "versions": {
                d: md.version(d) for d in ("llmcompressor", "compressed-tensors", "torch", "transformers")
            },
            "recipes": {},
            "presets": presets(ns.presets) if ns.presets else {},
        }
    failed = False
    # llm-compressor logs (loguru) to stdout: keep stdout for the JSON alone
    with contextlib.redirect_stdout(sys.stderr):
        for path in ns.recipes:
            try:
                out["recipes"][path] = summarize(path, ns.llama_blocks or None)
            except Exception as exc:  # report every recipe, then fail
                out["recipes"][path] = {"error": f"{type(exc).__name__}: {exc}"}
                failed = True
    json.dump(out, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
