"""The Plans page's editing use cases: setting schemes on layers and their fusion groups, mending fixes, the KV cache
skip, the layer table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quantplan.services.calibration import calibrations, stats_overview
from quantplan.services.errors import Refused
from quantplan.services.models import layer_names, layer_shapes
from quantplan.services.plans import parallelism, resolve
from quantplan.services.sweeps import kv_sensitivity, sensitivity_map
from store.records import ModelRecord

if TYPE_CHECKING:
    import pandas as pd


ROTATION_CHOICES = ("none", "hadamard", "random-hadamard")  # the Plans page's rotation control


def with_rotation(body: dict[str, Any], kind: str, block_size: int) -> dict[str, Any]:
    """``body`` with its ``transforms.rotation`` set to a Hadamard rotation of ``kind`` (``none`` removes it) in blocks
    of ``block_size`` (0: the whole width), its rotations (R1, R2, R4 unless the plan names fewer) and seed kept. The
    plan file's checks (quantcore.algorithms.rotation_spec) run when the plan is resolved."""
    from quantcore.algorithms.rotation_spec import ROTATIONS

    out = {k: v for k, v in body.items() if k != "transforms"}
    if kind == "none":
        return out
    current = (body.get("transforms") or {}).get("rotation") or {}
    entry: dict[str, Any] = {"kind": kind, "rotations": list(current.get("rotations") or ROTATIONS)}
    if block_size:
        entry["block_size"] = int(block_size)
    if kind == "random-hadamard":
        entry["seed"] = int(current.get("seed") or 0)
    return {**out, "transforms": {"rotation": entry}}


def kv_skip_options(model: ModelRecord) -> list[str]:
    """What a plan may keep out of its quantized KV cache: ``sliding_window`` when the model has such layers,
    then every attention layer's decoder index (empty when the cache cannot be counted)."""
    from quantcore.evaluation.kvcache import SKIP_SLIDING, kv_layer_elements, layer_index

    indices = sorted({i for n in kv_layer_elements(model.linears) if (i := layer_index(n)) is not None})
    return ([SKIP_SLIDING] if model.attention_windows else []) + [str(i) for i in indices]


def choose_kv_skip(model: ModelRecord, kv_cache: str, kl_budget: float, context: int) -> dict[str, Any]:
    """The layers to keep in BF16 so that the cache's predicted KL (the newest KV cache sweep of ``kv_cache``:
    the sum of the one-layer KLs left in the format) fits ``kl_budget`` with the least cache for one sequence of
    ``context`` tokens (quantcore.planning.autoplan.choose_kv_skip); sliding-window layers hold only their window, so
    they are the cheap ones at a long context. ValueError without a sweep. Returns the plan's ``kv_cache_skip``
    entries ("sliding_window" when every windowed layer is kept), the predicted KL and the cache bytes of one
    sequence with that choice, in the format everywhere and in BF16."""
    from quantcore.evaluation.kvcache import (
        SKIP_SLIDING,
        get_kv_format,
        kv_sequence_bytes_by_layer,
        layer_index,
    )
    from quantcore.planning.autoplan import choose_kv_skip as choose

    kv = get_kv_format(kv_cache)
    if kv.is_identity:
        raise Refused("AUTO quantizes nothing: there is no layer to keep out of it; choose a quantized format")
    if context < 1:
        raise Refused(f"the context must be at least one token, got {context}")
    sweep = kv_sensitivity(model, kv.name)
    if sweep is None:
        raise Refused(f"no KV cache sweep of {kv.name} for {model.name}: run one first (Results page, or "
                         f"quantplan sensitivity {model.name} --kv-cache {kv.name})")
    job, by_index = sweep
    windows = model.attention_windows
    fmt_bytes = kv_sequence_bytes_by_layer(model.linears, kv, context, windows=windows)
    keep_bytes = kv_sequence_bytes_by_layer(model.linears, "AUTO", context, windows=windows)
    if fmt_bytes is None or keep_bytes is None:
        raise Refused(f"{model.name} has no separate k_proj / v_proj: its cache cannot be counted per layer")
    layer_kl = {n: by_index[str(layer_index(n))] for n in fmt_bytes if str(layer_index(n)) in by_index}
    choice = choose(layer_kl, fmt_bytes, keep_bytes, kl_budget)
    kept = set(choice.skip)
    sliding = bool(windows) and set(windows) <= kept
    entries = ([SKIP_SLIDING] if sliding else []) + [
        str(layer_index(n)) for n in sorted(kept, key=lambda n: layer_index(n) or 0) if not (sliding and n in windows)]
    return {"sweep_job": job, "kv_cache": kv.name, "kv_cache_skip": entries, "predicted_kl": choice.predicted_kl,
            "context": context, "sequence_bytes": choice.cache_bytes, "format_sequence_bytes": sum(fmt_bytes.values()),
            "bf16_sequence_bytes": sum(keep_bytes.values())}


def plan_units(model: ModelRecord, body: dict[str, Any]) -> list[list[str]]:
    """The units of the plan ``body`` on ``model``: the layers that must share a scheme (quantcore.schemes.fusion's
    fusion_units: every fusion group, and every routed expert of an MoE block together, or with the plan's
    ``per_expert: true`` each expert's gate/up/down on its own), every other layer alone."""
    from quantcore.schemes.fusion import fusion_units

    return fusion_units(layer_names(model), per_expert=body.get("per_expert") is True)


def with_layer_scheme(model: ModelRecord, body: dict[str, Any], layer: str, scheme: str) -> tuple[dict, list]:
    """The plan body with `scheme` set on `layer` and on every layer that must share it (its unit of
    :func:`plan_units`: its fusion group, every routed expert of its MoE block, or in a per-expert plan its own
    expert's gate/up/down), and that unit."""
    group = next((u for u in plan_units(model, body) if layer in u), [layer])
    return with_schemes(model, body, {scheme: group}), group


def with_schemes(model: ModelRecord, body: dict[str, Any], choices: dict[str, list[str]], *,
                 clear_alpha: bool = False) -> dict[str, Any]:
    """The plan body with each scheme of `choices` ({scheme: layers}) set on its layers as per-layer choices, and on
    every layer that must share a scheme with one of them (its unit of :func:`plan_units`: fusion group, an MoE
    block's experts, or one expert's gate/up/down in a per-expert plan); ``clear_alpha``: their own SmoothQuant alphas
    go too (a per-layer alpha would smooth an unsmoothed scheme again)."""
    from quantcore.planning.plans import PlanSpec

    spec = PlanSpec.from_dict(body)
    unit_of = {member: unit for unit in plan_units(model, {"per_expert": spec.per_expert}) for member in unit}
    for scheme, layers in choices.items():
        for layer in layers:
            for member in unit_of.get(layer, [layer]):
                spec.layers[member] = scheme
                if clear_alpha:
                    spec.layer_alpha.pop(member, None)
    return spec.to_dict()


def unsmoothed_fixes(model: ModelRecord, body: dict[str, Any]) -> dict[str, list[str]]:
    """{preset without SmoothQuant: layers} for the plan's layers whose SmoothQuant no llm-compressor recipe can carry
    (quantcore.export.targets.smoothquant_unexportable): INT8_W8A8 where INT8_W8A8_SQ was, and so on; {} for a plan that
    does not resolve or has none."""
    from quantcore.models.mappings import smoothquant_unexportable
    from quantcore.schemes.presets import list_schemes

    resolved, problem = resolve(model, body)
    if problem:
        return {}
    assert resolved is not None  # resolve answers a plan or a problem
    presets = set(list_schemes())
    out: dict[str, list[str]] = {}
    for layer in smoothquant_unexportable(resolved):
        plain = resolved[layer].name.replace("_SQ", "", 1)
        if plain in presets and plain != resolved[layer].name:
            out.setdefault(plain, []).append(layer)
    return out


def regroup_fixes(model: ModelRecord, body: dict[str, Any]) -> dict[str, list[str]]:
    """{preset: layers} that mends the plan's groups that do not divide a layer's K (or each GPU's share of it at the
    plan's tensor_parallel): quantcore.planning.serving.regroup_fixes; {} for a plan that does not resolve."""
    from quantcore.planning.serving import regroup_fixes as fixes

    resolved, problem = resolve(model, body)
    if problem:
        return {}
    assert resolved is not None  # resolve answers a plan or a problem
    return fixes(resolved, layer_shapes(model), parallelism(model, body))


# why a layer table's row reads "refused: ...": what llm-compressor or vLLM would not make or load
REFUSED_PARTIAL = "groups do not divide K"  # quantcore.planning.serving.group_misfits
REFUSED_UNTILED = "N not a multiple of 128"  # quantcore.planning.serving.w4afp8_misfits: vLLM's one W4AFP8 kernel
REFUSED_BLOCKS = "FP8 blocks do not fit"  # quantcore.planning.serving.fp8_block_misfits: validate_fp8_block_shape
REFUSED_KERNEL = "no vLLM kernel"  # quantcore.planning.serving.vllm_unloadable: dynamic per-tensor INT8, MoE experts


def layer_table(model: ModelRecord, body: dict[str, Any], target: str | None) -> pd.DataFrame:
    """Every linear: name, N, K (and each GPU's share, "N / GPU" and "K / GPU", when the plan's tensor_parallel is above
    1: quantcore.models.parallel), outlier ratio (newest calibration), the sensitivity KL of the layer's own scheme
    (newest sweep of that scheme; None without one; 0 for a layer left in BF16), scheme, support on the target GPU
    ("refused: ..." where llm-compressor or vLLM would not make or load the layer: "no vLLM kernel",
    quantcore.planning.serving.vllm_unloadable; "groups do not divide K" (or each GPU's K),
    quantcore.planning.serving.group_misfits; "N not a multiple of 128" where vLLM's W4AFP8 kernel cannot tile the fused
    layer, quantcore.planning.serving.w4afp8_misfits; "FP8 blocks do not fit",
    quantcore.planning.serving.fp8_block_misfits; else the GPU's support, with ", off Marlin tiles" where a weight-only
    layer fits neither of Marlin's thread tiles: quantcore.planning.serving.marlin_misfits)."""
    import pandas as pd

    from quantcore.kernels.hardware import support_on_target
    from quantcore.planning.serving import (
        fp8_block_untileable,
        group_misfit_layers,
        marlin_untiled,
        vllm_unloadable,
        w4afp8_untileable,
    )

    resolved, _ = resolve(model, body)
    shapes = layer_shapes(model)
    par = parallelism(model, body)
    shards = par.shards(shapes) if par.split else {}
    ratios: dict[str, float] = {}
    cals = calibrations(model.id)
    if cals:
        ratios = {r["name"]: r["outlier_ratio"] for r in stats_overview(cals[0].id)}
    units = plan_units(model, body)
    # {scheme: {layer: KL}}: a layer's KL depends on its scheme (and, for a dynamic scale, on the GPU count)
    layer_kl = _layer_kls(*sensitivity_map(model, par.tp, par.expert_parallel), units)
    shared = {m: len(unit) - 1 for unit in units for m in unit}
    untileable = w4afp8_untileable(resolved, shapes, par) if resolved and target else set()
    partial = group_misfit_layers(resolved, shapes, par) if resolved and target else set()
    blocks = fp8_block_untileable(resolved, shapes, par) if resolved and target else set()
    no_kernel = set(vllm_unloadable(resolved)) if resolved and target else set()
    off_marlin = ({m for unit, _, _ in marlin_untiled(resolved, shapes, par) for m in unit}
                  if resolved and target else set())
    rows = []
    for lin in model.linears:
        name = lin["name"]
        scheme = resolved[name] if resolved else None
        support = ""
        if scheme is not None and target:
            w = scheme.weights.format if scheme.weights else None
            a = scheme.activations.format if scheme.activations else None
            support = support_on_target(target, w, a)
            # a layer the serving stack would refuse says so first, whatever the GPU's units
            refused = [why for why, hit in ((REFUSED_KERNEL, name in no_kernel), (REFUSED_PARTIAL, name in partial),
                                             (REFUSED_UNTILED, name in untileable), (REFUSED_BLOCKS, name in blocks))
                       if hit]
            if refused:
                support = "refused: " + ", ".join(refused)
            elif name in off_marlin:
                support += ", off Marlin tiles"
        scheme_name = scheme.name if scheme else body.get("default")
        per_gpu = dict(zip(("N / GPU", "K / GPU"), shards[name], strict=True)) if shards else {}
        rows.append({"layer": name, "N": lin["out_features"], "K": lin["in_features"], **per_gpu,
                     "outlier_ratio": ratios.get(name),
                     # a layer left unquantized adds no KL: 0 without a sweep, as the automatic plan counts it
                     "sensitivity_kl": (0.0 if scheme is not None and scheme.is_identity
                                        else layer_kl.get(str(scheme_name), {}).get(name)),
                     "scheme": scheme_name,
                     "alpha": scheme.smoothquant_alpha if scheme else None,
                     "on_target": support, "fused_with": shared.get(name, 0)})
    return pd.DataFrame(rows)


def _layer_kls(sens: dict[str, dict[str, float]], unit_layers: dict[str, list[str]], units: list[list[str]]
               ) -> dict[str, dict[str, float]]:
    """{scheme: {layer: KL}} from the sweeps' {scheme: {unit: KL}} and {unit: layers}: each layer reads the KL of
    the swept unit holding it, that of its own plan unit (``units``) first. An MoE expert's layer thus reads its
    expert's KL from a per-expert sweep in a per-expert plan and its block's from a whole-block sweep otherwise, and
    the other where only that one was swept."""
    unit_of = {m: frozenset(u) for u in units for m in u}
    out: dict[str, dict[str, float]] = {}
    for scheme, kls in sens.items():
        other: dict[str, float] = {}
        own: dict[str, float] = {}
        for unit, kl in kls.items():
            members = unit_layers.get(unit) or [unit]
            fits = all(unit_of.get(m) == frozenset(members) for m in members)
            for m in members:
                (own if fits else other)[m] = kl
        out[scheme] = {**other, **own}
    return out
