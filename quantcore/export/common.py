"""What the export targets share: a plan checked and grouped by quantization args (export), and layers assigned
the quantplan preset of the config group that claims them (import). Torch-free."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quantcore.errors import PlanError
from quantcore.errors import format_problems as _format
from quantcore.errors import name_list as _cut
from quantcore.export.quant_args import (
    CT_PRESET_BY_KEY,
    CT_PRESETS,
    CT_SCHEME_KEYS,
    ct_format,
    scheme_args,
    scheme_args_key,
    scheme_for,
)
from quantcore.planning.plans import group_label, scheme_label
from quantcore.schemes.fusion import fusion_groups
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme
from quantcore.schemes.targets import TargetMatcher

# ------------------------------------------------------------------ plan checks and grouping


@dataclass
class ConfigGroup:
    """Layers sharing one set of quantization args (one config group)."""

    weights: dict[str, Any] | None
    acts: dict[str, Any] | None
    layers: list[str]
    schemes: list[str]  # scheme names, in order of appearance
    gptq: bool = False  # its weights are GPTQ-rounded (only when grouped with split_gptq)

    @property
    def preset(self) -> str | None:
        return CT_PRESET_BY_KEY.get(scheme_args_key(self.weights, self.acts))

    @property
    def format(self) -> str | None:
        return ct_format(self.weights, self.acts)


def checked_plan(plan: Mapping[str, Scheme | str], layer_names: Sequence[str]) -> dict[str, Scheme]:
    """Check that ``plan`` gives every layer of ``layer_names`` (and nothing else) a scheme."""
    names = list(layer_names)
    problems: list[str] = []
    out: dict[str, Scheme] = {}
    for layer in names:
        if layer not in plan:
            continue
        s = plan[layer]
        if isinstance(s, str):
            try:
                s = get_scheme(s)
            except ValueError as exc:
                problems.append(f"layer {layer!r}: {exc}")
                continue
        out[layer] = s
    missing = [n for n in names if n not in plan]
    known = set(names)
    extra = [n for n in plan if n not in known]
    if missing:
        problems.append(
            f"layer(s) without a scheme: {_cut(missing)}; give every linear layer a scheme "
            "(resolve_plan does) or BF16 to leave it unquantized"
        )
    if extra:
        problems.append(f"plan names layer(s) the model does not have: {_cut(extra)}")
    if not names:
        problems.append("the model has no linear layers (layer_names is empty)")
    if problems:
        raise PlanError(_format("This plan cannot be exported", problems))
    return out


def group_plan(
    plan: Mapping[str, Scheme], layer_names: Sequence[str], *, split_gptq: bool = False
) -> tuple[list[ConfigGroup], list[str]]:
    """Config groups (by quantization args; ``split_gptq``: and by GPTQ or round-to-nearest weights) and the
    BF16 layers; PlanError for what cannot be expressed."""
    problems: dict[str, list[str]] = {}
    groups: dict[tuple[Any, ...], ConfigGroup] = {}
    unquantized: list[str] = []
    for layer in layer_names:
        s = plan[layer]
        if s.is_identity:
            unquantized.append(layer)
            continue
        w, a, why = scheme_args(s)
        if why:
            problems.setdefault(f"{s.name}: {'; '.join(why)}", []).append(layer)
            continue
        gptq = split_gptq and s.gptq
        g = groups.setdefault((*scheme_args_key(w, a), gptq), ConfigGroup(w, a, [], [], gptq))
        g.layers.append(layer)
        if s.name not in g.schemes:
            g.schemes.append(s.name)
    msgs = [f"{reason} (layers: {_cut(layers)})" for reason, layers in problems.items()]
    for members in fusion_groups(layer_names):
        labels = {scheme_label(plan[m]) for m in members}
        if len(labels) > 1:
            msgs.append(
                f"fusion group {group_label(members)} mixes schemes "
                f"({', '.join(f'{m}={scheme_label(plan[m])}' for m in members)}); a serving engine runs it as "
                "one GEMM: give its members one scheme"
            )
    if msgs:
        raise PlanError(_format("This plan cannot be written for llm-compressor / compressed-tensors", msgs))
    return list(groups.values()), unquantized


# ------------------------------------------------------------------ import


GroupArgs = tuple[str, list[str], "Mapping[str, Any] | None", "Mapping[str, Any] | None"]  # label, targets, W, A


@dataclass
class Claim:
    """The config groups one quantization modifier (or one compressed-tensors config) applies, with its ignore."""

    label: str
    groups: list[GroupArgs]
    ignore: list[str]
    gptq: bool = False  # a GPTQModifier's: see :func:`scheme_for`


def assign_schemes(
    layer_names: Sequence[str],
    claims: Sequence[Claim],
    alphas: Mapping[str, float],
    problems: list[str],
    awq: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Scheme]:
    """Give every layer the scheme of the config group that claims it (compressed-tensors precedence within
    one claim); a layer two claims quantize is a problem, one no claim quantizes is BF16."""
    owners: list[dict[str, int]] = []
    for claim in claims:
        owner: dict[str, int] = {}
        for gi, (_, targets, _, _) in enumerate(claim.groups):
            for t in targets:
                owner.setdefault(t, gi)
        owners.append(owner)
    known = set(layer_names)
    for t in dict.fromkeys(t for owner in owners for t in owner):
        if "." in t and not t.startswith("re:") and t not in known:
            problems.append(
                f"target {t!r} names no linear layer of this model; layer names look like "
                f"{_cut(list(layer_names)[:3])}"
            )
    cache: dict[tuple[int, int, float | None, bool], Scheme | None] = {}
    out: dict[str, Scheme] = {}
    twice: dict[tuple[str, ...], list[str]] = {}
    bf16 = get_scheme("BF16")
    matchers = [(TargetMatcher.of(owner), TargetMatcher.of(claim.ignore))
                for claim, owner in zip(claims, owners, strict=True)]
    for layer in layer_names:
        found = []  # (claim index, group index)
        for ci, (wanted, ignore) in enumerate(matchers):
            hit = None if ignore.first(layer) is not None else wanted.first(layer)
            if hit is not None:
                found.append((ci, owners[ci][hit]))
        alpha = alphas.get(layer)
        if not found:
            if alpha is not None:
                problems.append(
                    f"layer {layer!r} is smoothed (alpha {alpha:g}) but not quantized; remove it from the "
                    "SmoothQuant mappings or quantize it"
                )
            out[layer] = bf16
            continue
        if len(found) > 1:
            twice.setdefault(tuple(claims[ci].label for ci, _ in found), []).append(layer)
            continue
        ci, gi = found[0]
        key = (ci, gi, alpha, layer in awq)
        if key not in cache:
            label, _, w, a = claims[ci].groups[gi]
            cache[key] = scheme_for(w, a, alpha, label, problems, claims[ci].gptq, layer in awq)
        scheme = cache[key]
        if scheme is not None:
            out[layer] = scheme
    for labels, layers in twice.items():
        problems.append(
            f"layer(s) {_cut(layers)} are quantized by {' and '.join(labels)}; target each layer from one "
            "quantization modifier"
        )
    if not problems:
        for members in fusion_groups(layer_names):
            member_labels = {scheme_label(out[m]) for m in members}
            if len(member_labels) > 1:
                problems.append(
                    f"fusion group {group_label(members)} gets mixed schemes "
                    f"({', '.join(f'{m}={scheme_label(out[m])}' for m in members)})"
                )
    return out


def targets_list(value: Any, where: str, problems: list[str]) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    problems.append(f"{where} must be a target name or a list of them, got {value!r}")
    return []


# ------------------------------------------------------------------ helpers


def scheme_counts(plan: Mapping[str, Scheme]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in plan.values():
        label = scheme_label(s)
        out[label] = out.get(label, 0) + 1
    return out


def config_group(g: ConfigGroup, targets: list[str], *, with_format: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {
        "targets": targets,
        "weights": dict(g.weights) if g.weights else None,
        "input_activations": dict(g.acts) if g.acts else None,
    }
    if with_format:
        d["output_activations"] = None
        d["format"] = g.format
    return d


def ct_groups(config_groups: Any, where: str, problems: list[str]) -> list[GroupArgs]:
    """(label, targets, weights args, activation args) for each compressed-tensors config group."""
    out: list[GroupArgs] = []
    if not isinstance(config_groups, Mapping):
        problems.append(
            f"{where}config_groups must be a mapping of group name -> scheme, got {config_groups!r}"
        )
        return out
    for name, g in config_groups.items():
        label = f"{where}config group {name!r}"
        if isinstance(g, (list, tuple, str)):  # {PRESET_NAME: targets}
            preset = CT_PRESETS.get(str(name).upper())
            if preset is None:
                problems.append(
                    f"{label}: a target list needs a preset name as group name; presets: "
                    f"{', '.join(CT_PRESETS)}"
                )
                continue
            out.append(
                (
                    label,
                    targets_list(g, f"{label} targets", problems),
                    preset["weights"],
                    preset["input_activations"],
                )
            )
            continue
        if not isinstance(g, Mapping):
            problems.append(
                f"{label} must be a mapping with targets / weights / input_activations, got {g!r}"
            )
            continue
        unknown = [k for k in g if k not in CT_SCHEME_KEYS]
        if unknown:
            problems.append(f"{label}: unknown key(s) {unknown}; valid: {list(CT_SCHEME_KEYS)}")
            continue
        if g.get("output_activations") is not None:
            problems.append(f"{label}: output activation quantization is not something quantplan plans")
            continue
        targets = targets_list(g.get("targets"), f"{label} targets", problems)
        if not targets:
            problems.append(f"{label} has no targets")
            continue
        out.append((label, targets, g.get("weights"), g.get("input_activations")))
    return out
