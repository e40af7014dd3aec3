"""The llm-compressor target: a plan as a recipe (YAML) and back (torch-free).

A ``QuantizationModifier`` (``GPTQModifier`` for GPTQ-rounded layers) with a preset ``scheme`` or explicit
``config_groups``, ``targets`` and an ``ignore`` list, preceded by one ``SmoothQuantModifier`` per SmoothQuant strength
the plan uses and an ``AWQModifier`` for AWQ layers. The mappings (which norm feeds which projections) come from
:mod:`quantcore.models.architectures`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from quantcore.algorithms.rotation_spec import RotationSpec, RotationWidths
from quantcore.errors import PlanError
from quantcore.errors import format_problems as _format
from quantcore.errors import name_list as _cut
from quantcore.evaluation.kvcache import AUTO as KV_AUTO
from quantcore.evaluation.kvcache import KvCacheFormat, get_kv_format
from quantcore.export.common import (
    Claim,
    ConfigGroup,
    GroupArgs,
    assign_schemes,
    checked_plan,
    config_group,
    ct_groups,
    group_plan,
    scheme_counts,
    targets_list,
)
from quantcore.export.quant_args import CT_PRESETS, kv_cache_from_args, kv_cache_scheme
from quantcore.export.spinquant import rotation_header, rotation_stage
from quantcore.models.architectures import (
    LLAMA_STYLE,
    MLP_NORM_LLAMA,
    MLP_NORMS,
    SQ_KIND_ATTN,
    SQ_KIND_DOWN,
    SQ_KIND_MLP,
)
from quantcore.models.mappings import smoothquant_layers, smoothquant_unexportable_message, smoothquant_unmapped
from quantcore.planning.plans import TextDumper
from quantcore.safeload import load_yaml
from quantcore.schemes.fusion import expert_block
from quantcore.schemes.specs import AWQ_DUO_SCALING, AWQ_N_GRID, GPTQ_ACTORDER, GPTQ_BLOCK_SIZE, GPTQ_DAMPENING, Scheme
from quantcore.schemes.targets import LINEAR_CLASS, compact_targets, target_matches

# llm-compressor recipe layout: <stage>_stage -> <group>_modifiers -> {ModifierType: args}
RECIPE_SOURCE = "the recipe"  # what a recipe's text is called in messages when no file name is known
RECIPE_STAGE = "quant_stage"
RECIPE_QUANT_GROUP = "quant_modifiers"
RECIPE_SMOOTH_GROUP = "smoothing_modifiers"  # "smoothing_<i>_modifiers" when several alphas
QUANT_MODIFIERS = ("QuantizationModifier", "GPTQModifier")  # GPTQ: same config, GPTQ-rounded weights
GPTQ_MODIFIER = QUANT_MODIFIERS[1]
# what quantcore.algorithms.gptq runs, written out so that a later llm-compressor default cannot change the recipe
GPTQ_RECIPE_ARGS = {"block_size": GPTQ_BLOCK_SIZE, "dampening_frac": GPTQ_DAMPENING, "actorder": GPTQ_ACTORDER}
AWQ_MODIFIER = "AWQModifier"  # llm-compressor 0.14: a transform before the quantization modifier that rounds
# what quantcore.algorithms.awq runs, written out so that a later llm-compressor default cannot change the recipe
AWQ_RECIPE_ARGS = {"duo_scaling": AWQ_DUO_SCALING, "n_grid": AWQ_N_GRID}
# AWQ mappings of Llama-style blocks (llm-compressor's default_mappings): leaf of the smooth layer (the norm's name
# for the MLP is mlp_norm), leaves of the balance layers, and the submodule that holds them
_A = LLAMA_STYLE
AWQ_KINDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (_A.attention_norm, _A.qkv, _A.attention),
    (_A.v_proj, (_A.o_proj,), _A.attention),
    ("<mlp_norm>", _A.gate_up, _A.mlp),
    (_A.up_proj, (_A.down_proj,), _A.mlp),
)
SMOOTH_MODIFIER = "SmoothQuantModifier"
SQ_DEFAULT_STRENGTH = 0.5  # SmoothQuantModifier.smoothing_strength default

# SmoothQuant mappings for Llama-style models: [[balance layers], smooth layer]. The first two are
# llm-compressor's DEFAULT_SMOOTHQUANT_MAPPINGS (used when a recipe gives none); the third folds
# 1/s of down_proj's input into up_proj's output rows (exact: down's input is SiLU(gate) * up).
LLAMA_SQ_MAPPINGS: dict[str, list[Any]] = {
    SQ_KIND_ATTN: [[f"re:.*{leaf}" for leaf in _A.qkv], f"re:.*{_A.attention_norm}"],
    SQ_KIND_MLP: [[f"re:.*{leaf}" for leaf in _A.gate_up], f"re:.*{_A.mlp_norm}"],
    SQ_KIND_DOWN: [[f"re:.*{_A.down_proj}"], f"re:.*{_A.up_proj}"],
}
LLM_COMPRESSOR_DEFAULT_SQ_MAPPINGS = [LLAMA_SQ_MAPPINGS[SQ_KIND_ATTN], LLAMA_SQ_MAPPINGS[SQ_KIND_MLP]]


# ------------------------------------------------------------------ SmoothQuant mappings


def _llama_mappings(
    smoothed: Sequence[str], layer_names: Sequence[str], mlp_norm: str = MLP_NORM_LLAMA
) -> tuple[list[list[Any]], list[str]]:
    """Llama-style SmoothQuant mappings covering exactly ``smoothed``; (mappings, problems)."""
    unmapped = [layer for layer in smoothed if smoothquant_unmapped(layer)]
    problems = [smoothquant_unexportable_message(unmapped)] if unmapped else []
    by_kind: dict[str, list[str]] = {}
    for layer in smoothed:
        if not smoothquant_unmapped(layer):
            by_kind.setdefault(_A.smoothquant_kinds[layer.rsplit(".", 1)[-1]], []).append(layer)
    mappings: list[list[Any]] = []
    for kind in (SQ_KIND_ATTN, SQ_KIND_MLP, SQ_KIND_DOWN):
        members = by_kind.get(kind)
        if not members:
            continue
        all_of_kind = [n for n in layer_names if _A.smoothquant_kinds.get(n.rsplit(".", 1)[-1]) == kind]
        if set(members) == set(all_of_kind):
            generic = LLAMA_SQ_MAPPINGS[kind]
            if kind == SQ_KIND_MLP:
                generic = [generic[0], f"re:.*{mlp_norm}"]
            mappings.append(generic)
            continue
        by_parent: dict[str, list[str]] = {}
        for m in members:
            by_parent.setdefault(m.rsplit(".", 1)[0], []).append(m)
        for parent, ms in by_parent.items():
            balance = [f"re:{re.escape(m)}$" for m in ms]
            if kind == SQ_KIND_DOWN:
                smooth = f"{parent}.up_proj"
            else:
                block = parent.rsplit(".", 1)[0]
                smooth = f"{block}.input_layernorm" if kind == SQ_KIND_ATTN else f"{block}.{mlp_norm}"
            mappings.append([balance, f"re:{re.escape(smooth)}$"])
    return mappings, problems


def _expand_mappings(mappings: Sequence[Any], layer_names: Sequence[str]) -> set[str]:
    """Linear layers named as balance layers by SmoothQuant ``mappings``."""
    out: set[str] = set()
    for mapping in mappings:
        if not isinstance(mapping, (list, tuple)) or len(mapping) != 2:
            raise PlanError(f"SmoothQuant mapping {mapping!r} must be [[balance layers...], smooth layer]")
        balance = mapping[0] if isinstance(mapping[0], (list, tuple)) else [mapping[0]]
        for pattern in balance:
            out |= {n for n in layer_names if target_matches(str(pattern), n)}
    return out


# ------------------------------------------------------------------ AWQ mappings


def _awq_mappings(awq_layers: Sequence[str], layer_names: Sequence[str], mlp_norm: str) -> list[dict[str, Any]]:
    """AWQModifier mappings covering exactly the AWQ layers' folds: one per kind (q/k/v, o_proj, gate/up,
    down_proj), llm-compressor's own regexes when every block has AWQ there, else the blocks named."""
    chosen = set(awq_layers)
    out = []
    for smooth_leaf, leaves, sub in AWQ_KINDS:
        smooth_leaf = mlp_norm if smooth_leaf == "<mlp_norm>" else smooth_leaf
        blocks_all: list[str] = []
        blocks_awq: list[str] = []
        for n in layer_names:
            block, _, rest = n.rpartition(f".{sub}.")
            if rest == leaves[0] and block:
                blocks_all.append(block)
                if any(f"{block}.{sub}.{leaf}" in chosen for leaf in leaves):
                    blocks_awq.append(block)
        if not blocks_awq:
            continue
        smooth_at = sub + "." if smooth_leaf in ("v_proj", "up_proj") else ""
        if blocks_awq == blocks_all:
            prefix = ".*"
        else:
            prefix = "^(?:" + "|".join(re.escape(b) for b in blocks_awq) + ")\\."
        out.append({
            "smooth_layer": f"re:{prefix}{re.escape(smooth_at)}{smooth_leaf}$",
            "balance_layers": _Flow([f"re:{prefix}{sub}\\.{leaf}$" for leaf in leaves]),
        })
    # routed experts (a plan gives a block's experts one scheme): their gate/up into the norm before the block's
    # MLP, with its router (llm-compressor's MoE mapping), and each expert's down_proj into its own up_proj
    blocks_all = list(dict.fromkeys(b for n in layer_names if (b := expert_block(n))))
    blocks_awq = [b for b in blocks_all if b in {expert_block(n) for n in chosen}]
    if blocks_awq:
        if blocks_awq == blocks_all:
            experts, owner = ".*\\.experts", ".*"
        else:
            experts = "^(?:" + "|".join(re.escape(b) for b in blocks_awq) + ")"
            owner = "^(?:" + "|".join(re.escape(b.removesuffix(".mlp.experts")) for b in blocks_awq) + ")\\."
        out.append({"smooth_layer": f"re:{owner}{mlp_norm}$",
                    "balance_layers": _Flow([f"re:{owner}mlp\\.gate$", f"re:{experts}\\.\\d+\\.gate_proj$",
                                             f"re:{experts}\\.\\d+\\.up_proj$"])})
        out.append({"smooth_layer": f"re:{experts}\\.\\d+\\.up_proj$",
                    "balance_layers": _Flow([f"re:{experts}\\.\\d+\\.down_proj$"])})
    return out


def _awq_covered(mappings: Any, layer_names: Sequence[str], where: str, problems: list[str]) -> set[str]:
    """The linear layers an AWQModifier's ``mappings`` name as balance layers (None: llm-compressor's defaults)."""
    if mappings is None:
        mappings = _awq_mappings(layer_names, layer_names, MLP_NORM_LLAMA)
    out: set[str] = set()
    if not isinstance(mappings, (list, tuple)):
        problems.append(f"{where}: mappings must be a list of {{smooth_layer, balance_layers}}, got {mappings!r}")
        return out
    for m in mappings:
        balance = m.get("balance_layers") if isinstance(m, Mapping) else None
        if isinstance(balance, str):
            balance = [balance]
        if not isinstance(balance, (list, tuple)) or not isinstance(m.get("smooth_layer"), str):
            problems.append(f"{where}: mapping {m!r} needs smooth_layer (a name) and balance_layers (a list)")
            continue
        for pattern in balance:
            out |= {n for n in layer_names if target_matches(str(pattern), n)}
    return out


# ------------------------------------------------------------------ export


class _Flow(list):
    """A list written in YAML flow style (``[a, b]``): keeps each SmoothQuant mapping on one line."""


class _RecipeDumper(TextDumper):
    """The plan files' dumper, writing :class:`_Flow` lists inline."""


_RecipeDumper.add_representer(
    _Flow, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)


def _quant_modifier(
    groups: Sequence[ConfigGroup],
    unquantized: Sequence[str],
    layer_names: Sequence[str],
    *,
    every_quantized: bool = True,
) -> dict[str, Any]:
    """One quantization modifier's arguments for ``groups``; ``every_quantized``: they hold every quantized layer
    of the plan, so a single group may target the class ``Linear`` (else each group names its layers)."""
    ignore = compact_targets(unquantized, layer_names)
    if len(groups) == 1 and every_quantized:
        g = groups[0]
        body: dict[str, Any] = {"targets": [LINEAR_CLASS]}
        if g.preset is not None:
            body["scheme"] = g.preset
        else:
            body = {"config_groups": {"group_0": config_group(g, [LINEAR_CLASS])}}
        body["ignore"] = ignore
        return body
    if all(g.preset is not None for g in groups):
        return {
            "scheme": {g.preset: compact_targets(g.layers, layer_names) for g in groups},
            "ignore": ignore,
        }
    return {
        "config_groups": {
            f"group_{i}": config_group(g, compact_targets(g.layers, layer_names))
            for i, g in enumerate(groups)
        },
        "ignore": ignore,
    }


def to_llmcompressor_recipe(
    plan: Mapping[str, Scheme | str],
    *,
    layer_names: Sequence[str],
    smoothquant_mappings: Sequence[Any] | None = None,
    mlp_norm: str = MLP_NORM_LLAMA,
    kv_cache: str | KvCacheFormat | None = None,
    rotation: RotationSpec | None = None,
    rotation_widths: RotationWidths | None = None,
) -> str:
    """An llm-compressor recipe (YAML text) that quantizes the model as ``plan`` says.

    One ``QuantizationModifier``: ``scheme: <preset>`` with ``targets: [Linear]`` when every
    quantized layer shares one llm-compressor preset; ``scheme: {preset: targets}`` when every
    group is a preset; else explicit ``config_groups``. BF16 layers go to ``ignore``. Layers with
    GPTQ schemes (``W4A16_GPTQ``...) go to a ``GPTQModifier`` instead, written the same way; a plan
    with both gets both, the GPTQModifier first, each naming its own layers (llm-compressor runs
    them one after the other, so the round-to-nearest layers stay round-to-nearest). Layers
    with a SmoothQuant alpha get a ``SmoothQuantModifier`` per distinct alpha (its
    ``smoothing_strength``), placed before the quantization, with Llama-style mappings
    (q/k/v <- input_layernorm, gate/up <- post_attention_layernorm, down <- up_proj) limited
    to the smoothed layers, or ``smoothquant_mappings`` verbatim (one alpha only).
    ``mlp_norm`` names the norm before the MLP: ``post_attention_layernorm`` (Llama,
    Mistral, Qwen2) or ``pre_feedforward_layernorm`` (Gemma2/3, whose
    ``post_attention_layernorm`` sits after attention and must not be smoothed).
    ``kv_cache`` ``FP8`` adds ``kv_cache_scheme`` (static per-tensor E4M3, calibrated: the
    recipe then needs calibration data); the unscaled KV formats are a vLLM flag, not a recipe
    entry, and are named in the header.

    ``rotation`` (a plan's ``transforms.rotation``, over the model's ``rotation_widths``) comes first, as a
    ``SpinQuantModifier`` (:mod:`quantcore.export.spinquant`, which refuses what it cannot express).

    Raises PlanError for layers llm-compressor cannot express (FP8 E5M2, plain FP4, 2-D
    activation blocks), split fusion groups, and SmoothQuant on layers no mapping covers.
    """
    names = list(layer_names)
    if mlp_norm not in MLP_NORMS:
        raise PlanError(
            f"mlp_norm {mlp_norm!r} is not a known MLP input norm; use one of {', '.join(MLP_NORMS)}, or "
            "pass smoothquant_mappings"
        )
    resolved = checked_plan(plan, names)
    groups, unquantized = group_plan(resolved, names, split_gptq=True)
    stage: dict[str, Any] = rotation_stage(rotation, rotation_widths)  # rotate first, then smooth and round
    smooth = smoothquant_layers(resolved, names)
    problems: list[str] = []
    if rotation is not None and "R4" in rotation.rotations:  # scored unsmoothed (quantcore.algorithms.rotation)
        down = [n for alpha_layers in smooth.values() for n in alpha_layers if n.endswith(f".{_A.down_proj}")]
        if down:
            problems.append(f"SmoothQuant on {_cut(down)}: R4 rotates their input online, so quantplan scores them "
                            "unsmoothed; drop their smoothquant_alpha (or R4) to export what was scored")
    if rotation is not None and "V" in rotation.rotations:  # every decoder linear's input rotated online
        online = [n for alpha_layers in smooth.values() for n in alpha_layers]
        awq = [n for n, sch in resolved.items() if sch.needs_awq]
        if online or awq:
            problems.append(f"{'SmoothQuant' if online else 'AWQ'} on {_cut(online or awq)}: V rotates every decoder "
                            "linear's input online, so quantplan scores them unsmoothed and unscaled; drop it (or "
                            "the rotation) to export what was scored")
    if smooth and not groups:
        problems.append("SmoothQuant without any quantized layer")
    if smoothquant_mappings is not None and len(smooth) > 1:
        problems.append(
            f"custom smoothquant_mappings apply to one alpha, but the plan uses {sorted(smooth)}; give "
            "the smoothed layers one alpha"
        )
    for i, (alpha, layers) in enumerate(smooth.items()):
        if smoothquant_mappings is not None:
            mappings = [list(m) for m in smoothquant_mappings]
            covered = _expand_mappings(mappings, names)
            if covered != set(layers):
                problems.append(
                    f"smoothquant_mappings cover {_cut(sorted(covered - set(layers)) or ['(none extra)'])} beyond "
                    f"and miss {_cut(sorted(set(layers) - covered)) or '(none)'} of the layers smoothed with "
                    f"alpha {alpha:g}; make the mappings' balance layers exactly those layers"
                )
        else:
            mappings, why = _llama_mappings(layers, names, mlp_norm)
            problems += why
        group = RECIPE_SMOOTH_GROUP if len(smooth) == 1 else f"smoothing_{i}_modifiers"
        stage[group] = {
            SMOOTH_MODIFIER: {
                "smoothing_strength": alpha,
                "mappings": [_Flow([_Flow(m[0]), m[1]]) for m in mappings],
            }
        }
    if problems:
        raise PlanError(_format("This plan's SmoothQuant cannot be written for llm-compressor", problems))
    kv = get_kv_format(kv_cache)
    kv_args = kv_cache_scheme(kv)
    gptq = [n for n in names if resolved[n].gptq]
    awq = [n for n in names if resolved[n].needs_awq]
    rtn = [n for n in names if not resolved[n].gptq and not resolved[n].is_identity]
    if groups:
        # GPTQ layers go to a GPTQModifier, the others to a QuantizationModifier: llm-compressor (0.8+) runs
        # several modifiers one after the other (its "independent" pipeline), each on its own targets
        mods: dict[str, dict[str, Any]] = {}
        if awq:  # a transform: it scales, the QuantizationModifier after it rounds
            mods[AWQ_MODIFIER] = {**AWQ_RECIPE_ARGS, "mappings": _awq_mappings(awq, names, mlp_norm)}
        for mod_type, mine in ((GPTQ_MODIFIER, [g for g in groups if g.gptq]),
                               (QUANT_MODIFIERS[0], [g for g in groups if not g.gptq])):
            if mine:
                mods[mod_type] = _quant_modifier(mine, unquantized, names, every_quantized=len(mine) == len(groups))
        if gptq:
            mods[GPTQ_MODIFIER].update(GPTQ_RECIPE_ARGS)
        if kv_args is not None:
            mods[list(mods)[-1]]["kv_cache_scheme"] = kv_args
        stage[RECIPE_QUANT_GROUP] = mods
    elif kv_args is not None:
        stage[RECIPE_QUANT_GROUP] = {QUANT_MODIFIERS[0]: {"kv_cache_scheme": kv_args}}
    summary = ", ".join(f"{s} x{n}" for s, n in scheme_counts(resolved).items())
    if not kv.is_identity:
        summary += f"; KV cache {kv.name}"
    header = (
        f"# quantplan plan export: llm-compressor recipe ({summary})\n"
        "# apply: from llmcompressor import oneshot; oneshot(model=..., recipe=<this file>, output_dir=...)\n"
    )
    if kv_args is not None:
        header += ("# the KV cache scales are calibrated: oneshot needs calibration data (dataset=..., "
                   "num_calibration_samples=...); serve with --kv-cache-dtype fp8\n")
        if kv.per_head:
            header += ("# one K and one V scale per KV head (strategy attn_head): vLLM reads them with its "
                       "FlashAttention backend only, whose FP8 path is FlashAttention 3 on Hopper\n")
        if kv.attention:
            header += ("# FP8 attention (Q at scale 1.0, softmax probabilities in E4M3) is what vLLM's "
                       "FlashAttention 3 backend does with that cache; nothing of it is in the recipe\n")
    elif not kv.is_identity:
        header += (f"# KV cache {kv.name} is not in the recipe: it is vLLM's --kv-cache-dtype {kv.vllm_dtype} "
                   "(scale 1.0)\n")
    if rotation is not None:
        header += rotation_header(rotation)
    if not groups and kv_args is None:
        header += "# every layer stays unquantized: there is nothing for llm-compressor to do\n"
    if gptq:
        header += ("# GPTQModifier rounds the weights with GPTQ on the calibration data: oneshot needs a dataset "
                   "(dataset=..., num_calibration_samples=...)\n")
    if awq:
        header += (f"# AWQModifier searches input scales for {len(awq)} layer(s) on the calibration data (oneshot "
                   "needs a dataset) and folds them into the norms and projections before them; the "
                   "QuantizationModifier then rounds to nearest\n")
    if gptq and rtn:
        header += (f"# two quantization modifiers, run one after the other: GPTQModifier rounds the {len(gptq)} GPTQ "
                   f"layer(s), QuantizationModifier the other {len(rtn)} to nearest, as scored\n")
    body = yaml.dump(
        {RECIPE_STAGE: stage},
        Dumper=_RecipeDumper,
        sort_keys=False,
        default_flow_style=None,
        width=100,
        allow_unicode=True,
    )
    return header + body


def kv_cache_of_recipe(text: str | bytes) -> str:
    """The KV cache format an llm-compressor recipe asks for (``FP8`` or ``AUTO``), read like
    :func:`from_llmcompressor_recipe`, which refuses what quantplan cannot represent."""
    try:
        data = load_yaml(text, RECIPE_SOURCE, PlanError)
    except PlanError:
        return KV_AUTO
    for _, mod_type, args in _recipe_modifiers(data, []):
        if mod_type in QUANT_MODIFIERS and isinstance(args, Mapping):
            return kv_cache_from_args(args.get("kv_cache_scheme"), "", [])
    return KV_AUTO


def _recipe_modifiers(data: Any, problems: list[str]) -> list[tuple[str, str, Mapping[str, Any]]]:
    """(where, modifier type, args) in recipe order, read the way llm-compressor's Recipe.from_dict does."""
    out: list[tuple[str, str, Mapping[str, Any]]] = []
    if not isinstance(data, Mapping):
        problems.append(f"a recipe must be a mapping of '<name>_stage' entries, got {type(data).__name__}")
        return out
    for stage_key, stage in data.items():
        if not (isinstance(stage_key, str) and stage_key.endswith("_stage") and isinstance(stage, Mapping)):
            continue
        for group_key, group in stage.items():
            if not (
                isinstance(group_key, str) and group_key.endswith("_modifiers") and isinstance(group, Mapping)
            ):
                continue
            for mod_type, args in group.items():
                out.append((f"{stage_key}.{group_key}.{mod_type}", str(mod_type), args or {}))
    if not any(
        isinstance(k, str) and k.endswith("_stage") and isinstance(v, Mapping) for k, v in data.items()
    ):
        # a stage without modifiers is an unquantized plan; no stage at all is a malformed file
        problems.append(
            "the recipe has no stage, so no modifiers: llm-compressor reads '<name>_stage: "
            "{<name>_modifiers: {ModifierType: {...}}}'"
        )
    return out


def _modifier_claim(where: str, mod_type: str, args: Any, problems: list[str]) -> Claim:
    """The layers one quantization modifier of a recipe quantizes, and with what."""
    groups: list[GroupArgs] = []
    if not isinstance(args, Mapping):
        problems.append(f"{where} must be a mapping of arguments")
        return Claim(where, groups, [], mod_type == GPTQ_MODIFIER)
    kv_cache_from_args(args.get("kv_cache_scheme"), where, problems)
    ignore = targets_list(args.get("ignore"), f"{where} ignore", problems)
    targets = targets_list(args.get("targets", [LINEAR_CLASS]), f"{where} targets", problems)
    scheme = args.get("scheme")
    if scheme is not None and args.get("config_groups") is not None:
        problems.append(f"{where}: give either 'scheme' or 'config_groups', not both (llm-compressor refuses both)")
    elif isinstance(scheme, str):
        preset = CT_PRESETS.get(scheme.upper())
        if preset is None:
            problems.append(f"{where}: unknown preset scheme {scheme!r}; presets: {', '.join(CT_PRESETS)}")
        else:
            groups.append((f"{where} scheme {scheme}", targets, preset["weights"], preset["input_activations"]))
    elif isinstance(scheme, Mapping):
        groups = ct_groups(scheme, f"{where} ", problems)
    elif scheme is not None:
        problems.append(f"{where}: scheme must be a preset name or {{preset: targets}}, got {scheme!r}")
    elif args.get("config_groups") is not None:
        groups = ct_groups(args["config_groups"], f"{where} ", problems)
    return Claim(where, groups, ignore, mod_type == GPTQ_MODIFIER)


def from_llmcompressor_recipe(text: str | bytes, *, layer_names: Sequence[str],
                              source: str = RECIPE_SOURCE) -> dict[str, Scheme]:
    """The per-layer plan an llm-compressor recipe (YAML or JSON text) applies to a model.

    Reads each ``QuantizationModifier`` and ``GPTQModifier`` (same formats, GPTQ rounding: its groups get
    quantplan's ``*_GPTQ`` presets where there is one; no layer may be targeted by two of them), an
    ``AWQModifier`` (the balance layers of its ``mappings``, llm-compressor's defaults when it gives none, get the
    ``*_AWQ`` preset of their format)
    with ``scheme`` (preset name, or ``{preset: targets}``) + ``targets``, or
    ``config_groups``; ``ignore``; and any ``SmoothQuantModifier`` (``smoothing_strength``,
    default 0.5; ``mappings``, default llm-compressor's q/k/v and gate/up mappings), whose
    balance layers get that alpha. Raises PlanError for anything it cannot represent,
    naming the modifier, group or layer. The text is read with the bounded loader
    (:func:`quantcore.safeload.load_yaml`); ``source`` names it in messages.
    """
    names = list(layer_names)
    problems: list[str] = []
    data = load_yaml(text, source, PlanError)
    modifiers = _recipe_modifiers(data, problems)
    quant = [(w, t, a) for w, t, a in modifiers if t in QUANT_MODIFIERS]
    alphas: dict[str, float] = {}
    awq: set[str] = set()
    for where, mod_type, args in modifiers:
        if mod_type == AWQ_MODIFIER:
            if not isinstance(args, Mapping):
                problems.append(f"{where} must be a mapping of arguments")
                continue
            differ = {k: args[k] for k, v in AWQ_RECIPE_ARGS.items() if k in args and args[k] != v}
            if differ:
                problems.append(f"{where}: quantplan's AWQ search runs with {AWQ_RECIPE_ARGS}, not {differ}")
            awq |= _awq_covered(args.get("mappings"), names, where, problems)
        elif mod_type == SMOOTH_MODIFIER:
            if not isinstance(args, Mapping):
                problems.append(f"{where} must be a mapping of arguments")
                continue
            strength = args.get("smoothing_strength", SQ_DEFAULT_STRENGTH)
            if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0 <= strength <= 1:
                problems.append(f"{where}: smoothing_strength must be a number in [0, 1], got {strength!r}")
                continue
            if args.get("ignore"):
                problems.append(
                    f"{where}: SmoothQuantModifier.ignore is not supported by the importer; list the "
                    "layers to smooth in its mappings instead"
                )
                continue
            mappings = args.get("mappings") or LLM_COMPRESSOR_DEFAULT_SQ_MAPPINGS
            try:
                covered = _expand_mappings(mappings, names)
            except PlanError as exc:
                problems.append(f"{where}: {exc}")
                continue
            for layer in names:
                if layer in covered:
                    if layer in alphas and alphas[layer] != float(strength):
                        problems.append(
                            f"layer {layer!r} is smoothed twice (alpha {alphas[layer]:g} and "
                            f"{float(strength):g})"
                        )
                    alphas[layer] = float(strength)
        elif mod_type not in QUANT_MODIFIERS:
            problems.append(
                f"{where}: modifier {mod_type} is not something quantplan plans; supported: "
                f"{', '.join(QUANT_MODIFIERS + (SMOOTH_MODIFIER, AWQ_MODIFIER))}"
            )
    claims = [_modifier_claim(where, mod_type, args, problems) for where, mod_type, args in quant]
    plan = assign_schemes(names, claims, alphas, problems, awq)
    if problems:
        raise PlanError(_format("This llm-compressor recipe cannot be imported", problems))
    return plan
