"""Automatic plans: the cheapest scheme per layer whose predicted KL stays within a budget (torch-free).

The problem
    Units are the fusion groups of the model (q/k/v, gate/up of one block: one GEMM at
    serving time, so one scheme) and every other linear layer on its own. Unit ``u`` in
    scheme ``s`` has a KL ``kl[u][s]`` from the sensitivity sweep (KL of the whole model
    with only that unit quantized) and a cost ``cost[u][s]``. The plan's *predicted* KL is
    the sum of its units' KLs (additivity is the modelling assumption; the score job
    measures the real one). Choose one scheme per unit to

        minimise  sum_u cost[u][s_u]   subject to   sum_u kl[u][s_u] <= kl_budget

    — a multiple-choice knapsack. BF16 is always available at KL 0, so every budget >= 0
    is feasible.

Which schemes a unit may take
    A candidate scheme is dropped for the whole plan when the target GPU has no serving
    path for it (``hardware.support_on_target == "unsupported"``) or when no sensitivity
    result exists for it; the reason is returned in ``excluded``. A unit whose KL for a
    scheme is unknown cannot take that scheme.

Sensitivity input
    ``sensitivity`` maps a scheme name to ``{key: KL}``, where a key is a *unit label*
    (``model.layers.3.self_attn.{q,k,v}_proj``, as :func:`quantcore.planning.plans.group_label`
    writes it and the sensitivity sweep stores it) or a single layer name. Optionally
    ``unit_layers`` maps a label to its member layers (the sweep's ``layers`` column), for
    labels written some other way. A fusion group's KL is its own entry when present,
    otherwise the sum of its members' single-layer entries. :func:`sensitivity_from_rows`
    builds both maps from stored sweep rows.

Cost and solver
    What a unit costs in each scheme (a bits proxy or measured GEMM times) is
    :mod:`quantcore.planning.costs`; the multiple-choice knapsack is solved exactly on a discretised KL budget by
    :mod:`quantcore.planning.solver`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from quantcore.errors import PlanError
from quantcore.errors import format_problems as _format
from quantcore.errors import name_list as _cut
from quantcore.kernels.hardware import TARGETS, support_on_target, support_reason
from quantcore.models.mappings import smoothquant_unexportable
from quantcore.models.parallel import ONE_GPU, Parallelism
from quantcore.planning.costs import (
    BASELINE_SCHEME,
    COST_ESTIMATED,
    COST_MEASURED,
    UNIT_BITS,
    UNIT_MS,
    layer_costs,
)
from quantcore.planning.plans import group_label, scheme_label
from quantcore.planning.serving import (
    expert_mix,
    fp8_block_misfits,
    group_misfits,
    is_w4afp8,
    mixed_expert_blocks,
    regroup_reason,
    regrouped_preset,
    vllm_unloadable,
    w4afp8_misfits,
)
from quantcore.planning.solver import DEFAULT_KL_STEPS, solve_mck
from quantcore.schemes.fusion import expert_block, expert_blocks, expert_parts, fusion_units
from quantcore.schemes.presets import get_scheme, list_schemes
from quantcore.schemes.specs import Scheme

DEFAULT_CANDIDATES: tuple[str, ...] = (
    "BF16",
    "FP8_DYNAMIC",
    "FP8_BLOCK",
    "INT8_W8A8",
    "INT8_W8A8_SQ",
    "W8A16",
    "W8A16_GPTQ",
    "W4A16",
    "W4A16_GPTQ",
    "W4A16_AWQ",
    "W4A16_ASYM",
    "W4A16_ASYM_GPTQ",
    "W4A16_ASYM_AWQ",
    "W4A16_G64",
    "W4A16_G64_GPTQ",
    "W4A16_G64_AWQ",
    "W4A16_G64_ASYM",
    "W4A16_G64_ASYM_GPTQ",
    "W4A16_G64_ASYM_AWQ",
    "W4A16_G32",
    "W4A16_G32_GPTQ",
    "W4A16_G32_AWQ",
    "W4A16_G32_ASYM",
    "W4A16_G32_ASYM_GPTQ",
    "W4A16_G32_ASYM_AWQ",
    "W4A16_CHANNEL",
    "W4A16_CHANNEL_GPTQ",
    "W4A16_CHANNEL_AWQ",
    "W4AFP8",
    "W4AFP8_GPTQ",
    "NVFP4A16",
    "NVFP4A16_GPTQ",
    "NVFP4A16_AWQ",
    "NVFP4",
    "MXFP4",
    "MXFP4A16",
)


@dataclass(frozen=True)
class UnitChoice:
    """The scheme chosen for one unit, with its KL and cost.

    unit:          unit label (fusion-group label or layer name)
    layers:        member layers
    kl:            predicted KL of this unit in ``scheme`` (0 for BF16)
    cost:          cost of the unit in ``scheme`` (same unit as the plan's cost)
    baseline_cost: cost of the unit in BF16
    cost_source:   ``"measured"``, ``"ideal"``, ``"estimated"``, ``"bits"``, or ``"mixed"`` when members differ
    support:       ``"native"`` | ``"emulated"`` on the target
    options:       number of schemes this unit could take (BF16 included)
    """

    unit: str
    layers: tuple[str, ...]
    scheme: str
    kl: float
    cost: float
    baseline_cost: float
    cost_source: str
    support: str
    options: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict."""
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d


@dataclass
class AutoPlanResult:
    """What :func:`auto_plan` chose.

    plan:          {layer: scheme name} for every layer, in ``layer_names`` order
    predicted_kl:  sum of the chosen units' KLs (<= kl_budget)
    cost:          total cost of the plan (``cost_unit``)
    baseline_cost: total cost with every layer in BF16
    per_unit:      one :class:`UnitChoice` per unit, in model order
    excluded:      {candidate scheme: why it could not be chosen anywhere}
    kl_budget, target, cost_unit ("ms" | "weight bits"), resolution: the inputs, for the record
    """

    plan: dict[str, str]
    predicted_kl: float
    cost: float
    baseline_cost: float
    per_unit: list[UnitChoice]
    excluded: dict[str, str]
    kl_budget: float
    target: str
    cost_unit: str
    resolution: int
    notes: list[str] = field(default_factory=list)
    per_expert: bool = False  # units were single experts (their blocks may mix schemes)

    @property
    def saving(self) -> float:
        """1 - cost / baseline_cost: the share of the baseline cost the plan saves."""
        return 1.0 - self.cost / self.baseline_cost if self.baseline_cost > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (for ``quantplan plan auto --json`` and the jobs table)."""
        return {
            "plan": dict(self.plan),
            "predicted_kl": self.predicted_kl,
            "cost": self.cost,
            "baseline_cost": self.baseline_cost,
            "saving": self.saving,
            "cost_unit": self.cost_unit,
            "kl_budget": self.kl_budget,
            "target": self.target,
            "resolution": self.resolution,
            "per_unit": [u.to_dict() for u in self.per_unit],
            "excluded": dict(self.excluded),
            "notes": list(self.notes),
            "per_expert": self.per_expert,
        }


# ------------------------------------------------------------------ units and sensitivity


def plan_units(layer_names: Sequence[str], per_expert: bool = False) -> list[list[str]]:
    """The units of a model: fusion groups and single layers, in model order (first member's position); an MoE
    block's experts one unit (``per_expert``: one unit per expert, its gate/up/down)."""
    return fusion_units(layer_names, per_expert=per_expert)


def swept_per_expert(unit_layers: Mapping[str, Sequence[str]] | None) -> bool:
    """Whether sensitivity results hold per-expert units (``sensitivity --per-expert``: one routed expert's
    gate/up/down as one unit), so a plan may give the experts of a block different schemes."""
    for members in (unit_layers or {}).values():
        blocks = {expert_block(m) for m in members}
        if len(members) > 1 and len(blocks) == 1 and None not in blocks \
                and len({m.rsplit(".", 1)[0] for m in members}) == 1:
            return True
    return False


def sensitivity_from_rows(rows: Iterable[Any]) -> tuple[dict[str, dict[str, float]], dict[str, list[str]]]:
    """(sensitivity, unit_layers) from sensitivity-sweep rows.

    A row is a mapping or an object with ``scheme``, ``unit`` (or ``layer``), ``layers`` and
    ``kl_mean`` (``store.records.SensitivityRecord``, ``quantcore.evaluation.sensitivity.SensitivityRow``
    plus its scheme, or their dicts). A later row for the same scheme and unit replaces an
    earlier one.
    """
    sens: dict[str, dict[str, float]] = {}
    unit_layers: dict[str, list[str]] = {}

    def get(row: Any, *keys: str) -> Any:
        for k in keys:
            if isinstance(row, Mapping) and k in row:
                return row[k]
            if not isinstance(row, Mapping) and hasattr(row, k):
                return getattr(row, k)
        raise PlanError(f"sensitivity row {row!r} has no {' / '.join(keys)}")

    for row in rows:
        scheme = str(get(row, "scheme"))
        unit = str(get(row, "unit", "layer"))
        layers = [str(x) for x in (get(row, "layers") or [unit])]
        sens.setdefault(scheme, {})[unit] = float(get(row, "kl_mean", "kl"))
        unit_layers[unit] = layers
    return sens, unit_layers


def _unit_kls(
    units: Sequence[Sequence[str]],
    sensitivity: Mapping[str, Mapping[str, float]],
    unit_layers: Mapping[str, Sequence[str]] | None,
    schemes: Iterable[str],
) -> dict[str, dict[int, float]]:
    """{scheme: {unit index: KL}} for the units whose KL is known; PlanError for bad entries."""
    index_of_layer: dict[str, int] = {}
    index_of_members: dict[frozenset[str], int] = {}
    index_of_label: dict[str, int] = {}
    # per-expert units: a sweep's row for a whole MoE block (a sweep without --per-expert) fits none of them
    blocks = list(expert_blocks([m for u in units for m in u]).values())
    expert_rows = {frozenset(b) for b in blocks} | {frozenset(e) for b in blocks for e in expert_parts(b)}
    for i, u in enumerate(units):
        for m in u:
            index_of_layer[m] = i
        index_of_members[frozenset(u)] = i
        index_of_label[group_label(u)] = i
    problems: list[str] = []
    out: dict[str, dict[int, float]] = {}
    for scheme in schemes:
        entries = sensitivity.get(scheme)
        if not entries:
            continue
        whole: dict[int, float] = {}
        single: dict[str, float] = {}
        for key, value in entries.items():
            kl = _check_kl(value, f"sensitivity[{scheme!r}][{key!r}]", problems)
            if kl is None:
                continue
            members = list(unit_layers[key]) if unit_layers and key in unit_layers else None
            if members is not None and len(members) > 1:
                idx = index_of_members.get(frozenset(members))
                if idx is None and frozenset(members) in expert_rows:
                    continue  # a whole block's row beside per-expert units, or an expert's beside whole blocks
                if idx is None:
                    problems.append(
                        f"sensitivity unit {key!r} of {scheme} covers {members}, which is not a fusion "
                        "group of this model; sweep fusion groups whole or single layers"
                    )
                    continue
                whole[idx] = kl
            elif key in index_of_label and len(units[index_of_label[key]]) > 1:
                whole[index_of_label[key]] = kl
            else:
                layer = members[0] if members else key
                if layer not in index_of_layer:
                    problems.append(
                        f"sensitivity[{scheme!r}] names {key!r}, which is neither a layer of this model "
                        "nor one of its unit labels; was the sweep run on another model?"
                    )
                    continue
                single[layer] = kl
        known: dict[int, float] = {}
        for i, u in enumerate(units):
            if i in whole:
                known[i] = whole[i]
            elif all(m in single for m in u):
                known[i] = math.fsum(single[m] for m in u)
        out[scheme] = known
    if problems:
        raise PlanError(_format("The sensitivity results cannot be used", problems))
    return out


def _check_kl(value: Any, where: str, problems: list[str]) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        problems.append(f"{where} must be a number (KL in nats), got {value!r}")
        return None
    kl = float(value)
    if not math.isfinite(kl):
        problems.append(f"{where} is {kl}: rerun the sensitivity sweep for it (or leave the scheme out)")
        return None
    return max(kl, 0.0)  # KL >= 0; a tiny negative value is float noise of the sweep


# ------------------------------------------------------------------ the planner


def auto_plan(
    layer_names: Sequence[str],
    sensitivity: Mapping[str, Mapping[str, float]],
    *,
    kl_budget: float,
    target: str,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    cost: Mapping[str, Mapping[str, float]] | None = None,
    layer_shapes: Mapping[str, tuple[int, int]] | None = None,
    unit_layers: Mapping[str, Sequence[str]] | None = None,
    resolution: int = DEFAULT_KL_STEPS,
    estimate_missing: bool = True,
    cost_source: str = COST_MEASURED,
    tied: Sequence[str] = (),
    parallel: Parallelism = ONE_GPU,
    per_expert: bool | None = None,
) -> AutoPlanResult:
    """The cheapest plan whose predicted KL (sum of unit KLs) is <= ``kl_budget``.

    layer_names:  every linear layer of the model (names as in ``named_modules()``)
    sensitivity:  {scheme name: {unit label or layer name: KL}} (see the module docstring)
    kl_budget:    nats per token, >= 0
    target:       GPU key of ``quantcore.kernels.hardware.TARGETS``; schemes it cannot serve are never chosen
    candidates:   scheme names to consider; BF16 is always added
    cost:         {scheme: {layer: ms}} measured on the target (or its roofline bound, with
                  ``cost_source="ideal"``), or None for the bits proxy
    layer_shapes: {layer: (N, K)}, needed by the bits proxy
    unit_layers:  {unit label: member layers} for sensitivity keys that are not this module's labels
    resolution:   budget steps of the DP (conservative rounding, see the module docstring)
    tied:         layers whose weight is the input embedding's (lm_head under tie_word_embeddings): with the bits
                  proxy, quantizing one costs the embedding again (it stays 16-bit once llm-compressor unties them)
    parallel:     the GPUs the plan is served on (quantcore.models.parallel): a scheme is not offered to a unit whose
                  share on one GPU vLLM would refuse
    per_expert:   an MoE block's experts one unit each, so they may take different schemes (a per-expert plan, which
                  an llm-compressor recipe holds and vLLM cannot serve); None: when the sensitivity has per-expert
                  units (:func:`swept_per_expert`)

    Raises PlanError for a negative or non-finite budget, unknown schemes, an unknown target,
    sensitivity keys that name nothing in the model, and missing costs or shapes.
    """
    names = list(dict.fromkeys(layer_names))
    if not names:
        raise PlanError("the model has no linear layers to plan (layer_names is empty)")
    if (
        isinstance(kl_budget, bool)
        or not isinstance(kl_budget, (int, float))
        or not math.isfinite(kl_budget)
        or kl_budget < 0
    ):
        raise PlanError(
            f"the KL budget must be a finite number >= 0 (nats per token), got {kl_budget!r}; "
            "0 keeps every layer in BF16"
        )
    if target not in TARGETS:
        raise PlanError(f"unknown GPU target {target!r}; choose one of: {', '.join(TARGETS)}")
    valid = list_schemes()
    unknown = [c for c in candidates if c not in valid]
    if unknown:
        raise PlanError(f"unknown candidate scheme(s) {unknown}; valid schemes are: {', '.join(valid)}")
    schemes = list(dict.fromkeys([BASELINE_SCHEME, *candidates]))

    excluded: dict[str, str] = {}
    support: dict[str, str] = {}
    usable: list[str] = []
    for s in schemes:
        sch = get_scheme(s)
        w = sch.weights.format if sch.weights else None
        a = sch.activations.format if sch.activations else None
        verdict = support_on_target(target, w, a)
        if verdict == "unsupported":
            excluded[s] = support_reason(target, w, a)
            continue
        if s != BASELINE_SCHEME and not sensitivity.get(s):
            excluded[s] = (
                f"no sensitivity results for {s}: run a sensitivity sweep with it to let the planner use it"
            )
            continue
        support[s] = verdict
        usable.append(s)
    if per_expert is None:
        per_expert = swept_per_expert(unit_layers)
    units = plan_units(names, per_expert)
    kls = _unit_kls(units, sensitivity, unit_layers, [s for s in usable if s != BASELINE_SCHEME])
    kls[BASELINE_SCHEME] = {i: 0.0 for i in range(len(units))}
    costs = layer_costs(names, usable, cost, layer_shapes, estimate_missing, cost_source, tied)

    notes: list[str] = []
    misfit: dict[str, int] = {}  # scheme -> units it cannot take because its groups do not divide their K
    misfit_ks: dict[str, set[int]] = {}  # scheme -> the K of those units' layers
    untileable: dict[str, int] = {}  # scheme -> units whose N vLLM's W4AFP8 kernel cannot tile
    unsmoothable: dict[str, list[str]] = {}  # scheme -> layers whose SmoothQuant no llm-compressor recipe carries
    unloadable: dict[str, list[str]] = {}  # scheme -> layers vLLM's compressed-tensors loader has no kernel for
    unit_opts: list[list[tuple[str, float, float, str]]] = []  # (scheme, kl, cost, source)
    for i, u in enumerate(units):
        opts = []
        unit_shapes = {m: layer_shapes[m] for m in u} if layer_shapes else {}
        for s in usable:
            unit_plan = dict.fromkeys(u, s)
            # said first: a sweep of a SmoothQuant scheme leaves these units out, so they have no KL of it either
            if get_scheme(s).smoothquant_alpha is not None and (lost := smoothquant_unexportable(unit_plan)):
                unsmoothable.setdefault(s, []).extend(lost)
                continue
            if i not in kls.get(s, {}) or not all(m in costs[s] for m in u):
                continue
            if layer_shapes and group_misfits(unit_plan, unit_shapes, parallel):
                misfit[s] = misfit.get(s, 0) + 1
                misfit_ks.setdefault(s, set()).update(parallel.shard(m, *layer_shapes[m])[1] for m in u)
                continue
            if layer_shapes and (w4afp8_misfits(unit_plan, unit_shapes, parallel)
                                 or fp8_block_misfits(unit_plan, unit_shapes, parallel)):
                untileable[s] = untileable.get(s, 0) + 1
                continue
            if refused := vllm_unloadable(unit_plan):
                unloadable.setdefault(s, []).extend(refused)
                continue
            lc = [costs[s][m] for m in u]
            sources = {c.source for c in lc}
            opts.append(
                (s, kls[s][i], math.fsum(c.cost for c in lc), sources.pop() if len(sources) == 1 else "mixed")
            )
        unit_opts.append(opts)
    tp = parallel.tp
    per_gpu = f" on each of {tp} GPUs" if tp > 1 else ""
    for s, n_units in misfit.items():
        note = (f"{s} was not offered to {n_units} unit(s) whose K{per_gpu} its groups do not divide: group kernels "
                "cannot serve them (quantcore.planning.serving.group_misfits)")
        alt = regrouped_preset(s, misfit_ks[s])
        if alt is not None and alt.name not in usable:
            note += f"; {alt.name}, {regroup_reason(alt)}: sweep it to let the planner use it"
        notes.append(note)
    for s, n_units in untileable.items():
        why = ("vLLM's W4AFP8 kernel cannot serve them (quantcore.planning.serving.w4afp8_misfits)" if is_w4afp8(s) else
               "vLLM refuses block-scaled FP8 there (quantcore.planning.serving.fp8_block_misfits)")
        notes.append(f"{s} was not offered to {n_units} unit(s) whose output width N (q/k/v and gate/up "
                     f"fused){per_gpu} {'or K on each GPU ' if tp > 1 else ''}is not a multiple of 128: {why}")
    for s, lost in unsmoothable.items():
        notes.append(f"{s} was not offered to {len(lost)} layer(s) ({_cut(lost, 3)}): an llm-compressor recipe "
                     "cannot smooth them (quantcore.models.mappings.smoothquant_unmapped), so no served "
                     "checkpoint would hold the smoothing scored; they take another scheme (sweep one without "
                     "SmoothQuant, e.g. INT8_W8A8, if none is)")
    for s, refused in unloadable.items():
        notes.append(f"{s} was not offered to {len(refused)} layer(s) ({_cut(refused, 3)}): vLLM has no kernel for "
                     "them (dense INT8 with dynamic per-tensor activations; MoE experts in INT8 without per-token "
                     "activations, or in MXFP8), so the checkpoint would not load "
                     "(quantcore.planning.serving.vllm_unloadable); INT8_W8A8 (per-token scales) is the INT8 vLLM "
                     "serves")
    for s in usable:
        if s in unloadable:
            continue  # said just above (an unsmoothable scheme's note names only some layers: checked here too)
        if s != BASELINE_SCHEME and not any(o[0] == s for opts in unit_opts for o in opts):
            excluded[s] = (
                f"{s} has no unit with both a KL and a cost: its sensitivity keys match no unit, or no "
                "layer has a kernel time for it"
            )
    picked = solve_mck(
        [[(kl, c) for _, kl, c, _ in opts] for opts in unit_opts], float(kl_budget), resolution
    )

    plan: dict[str, str] = {}
    per_unit: list[UnitChoice] = []
    for u, opts, j in zip(units, unit_opts, picked, strict=True):
        s, kl, c, source = opts[j]
        base = next(o for o in opts if o[0] == BASELINE_SCHEME)
        for m in u:
            plan[m] = s
        per_unit.append(
            UnitChoice(
                unit=group_label(u),
                layers=tuple(u),
                scheme=s,
                kl=kl,
                cost=c,
                baseline_cost=base[2],
                cost_source=source,
                support=support[s],
                options=len(opts),
            )
        )
    plan = {n: plan[n] for n in names}
    emulated = sorted({p.scheme for p in per_unit if p.support == "emulated" and p.scheme != BASELINE_SCHEME})
    if emulated:
        notes.append(
            f"{', '.join(emulated)} run emulated on {target}: numerics as planned, without the speed-up "
            "of native kernels"
        )
    if per_expert:
        mixed = mixed_expert_blocks(plan)
        if mixed:
            first = next(iter(mixed))
            notes.append(f"per-expert units: {len(mixed)} MoE block(s) give their experts different schemes (e.g. "
                         f"{first}: {expert_mix(mixed[first])}); an llm-compressor recipe and its compressed-tensors "
                         "checkpoint hold that, vLLM's fused MoE (one method per block) cannot serve it")
    if any(p.cost_source in (COST_ESTIMATED, "mixed") for p in per_unit):
        notes.append(
            "some costs are estimated (BF16 time x weight bits / 16) where the benchmark has no kernel time"
        )
    return AutoPlanResult(
        plan=plan,
        predicted_kl=math.fsum(p.kl for p in per_unit),
        cost=math.fsum(p.cost for p in per_unit),
        baseline_cost=math.fsum(p.baseline_cost for p in per_unit),
        per_unit=per_unit,
        excluded=excluded,
        kl_budget=float(kl_budget),
        target=target,
        cost_unit=UNIT_BITS if cost is None else UNIT_MS,
        resolution=resolution,
        notes=notes,
        per_expert=bool(per_expert),
    )


def predicted_kl(
    plan: Mapping[str, Scheme | str],
    sensitivity: Mapping[str, Mapping[str, float]],
    *,
    unit_layers: Mapping[str, Sequence[str]] | None = None,
) -> float:
    """Predicted KL of a plan: the sum over its units of the unit's KL in its scheme (BF16: 0).

    Units are the fusion groups among the plan's layers and every other layer (an MoE block's experts one unit, or
    one unit per expert where the sensitivity has per-expert units, as :func:`auto_plan` searches then); a block
    whose experts differ is counted expert by expert, a fusion group whose members differ layer by layer. Only the
    scheme *name* is looked up (sensitivity is stored per name). Raises PlanError naming the units whose KL for their
    scheme is unknown.
    """
    names = list(plan)
    labels = {n: scheme_label(plan[n]) if not isinstance(plan[n], str) else plan[n] for n in names}
    scheme_of = {n: s if isinstance(s, str) else s.name for n, s in plan.items()}
    units: list[list[str]] = []
    per_expert = swept_per_expert(unit_layers)  # the units auto_plan searched on, when it found them
    for u in plan_units(names, per_expert):
        if len({labels[m] for m in u}) == 1:
            units.append(u)
            continue
        for part in expert_parts(u) if expert_block(u[0]) is not None else [u]:  # a per-expert plan's block
            if len({labels[m] for m in part}) == 1:
                units.append(part)
            else:
                units.extend([m] for m in part)
    need = {scheme_of[u[0]] for u in units if scheme_of[u[0]] != BASELINE_SCHEME}
    # unit indices refer to `units`, which may split groups: build the lookup per unit list
    kls = _kls_for_units(units, sensitivity, unit_layers, need)
    missing: list[str] = []
    total: list[float] = []
    for i, u in enumerate(units):
        s = scheme_of[u[0]]
        if s == BASELINE_SCHEME or get_scheme(s).is_identity:
            continue
        if i not in kls.get(s, {}):
            missing.append(f"{group_label(u)} in {s}")
            continue
        total.append(kls[s][i])
    if missing:
        raise PlanError(
            f"no sensitivity result for {_cut(missing)}; run a sensitivity sweep for these schemes"
        )
    return math.fsum(total)


def _kls_for_units(
    units: Sequence[Sequence[str]],
    sensitivity: Mapping[str, Mapping[str, float]],
    unit_layers: Mapping[str, Sequence[str]] | None,
    schemes: Iterable[str],
) -> dict[str, dict[int, float]]:
    """Like :func:`_unit_kls`, for a unit list that may split fusion groups into single layers.

    A whole-group entry can only serve a whole-group unit; a split group's layers need
    their single-layer entries.
    """
    names = [m for u in units for m in u]
    index_full: dict[frozenset[str], float] = {}  # per scheme below: {unit members: KL}, blocks whole or per expert
    whole_kls: list[tuple[list[list[str]], dict[str, dict[int, float]]]] = []
    for full in (plan_units(names), plan_units(names, per_expert=True)):
        whole_kls.append((full, _unit_kls(full, sensitivity, unit_layers, schemes)))
    singles: dict[str, dict[str, float]] = {}
    for s in schemes:
        for key, value in (sensitivity.get(s) or {}).items():
            members = list(unit_layers[key]) if unit_layers and key in unit_layers else [key]
            if len(members) == 1 and isinstance(value, (int, float)) and math.isfinite(value):
                singles.setdefault(s, {})[members[0]] = max(float(value), 0.0)
    out: dict[str, dict[int, float]] = {}
    for s in schemes:
        index_full = {frozenset(u): kls[s][j] for full, kls in whole_kls for j, u in enumerate(full)
                      if j in kls.get(s, {})}
        row: dict[int, float] = {}
        for i, u in enumerate(units):
            got = index_full.get(frozenset(u))
            if got is not None:
                row[i] = got
            elif len(u) == 1 and u[0] in singles.get(s, {}):
                row[i] = singles[s][u[0]]
        out[s] = row
    return out


# ------------------------------------------------------------------ the KV cache, layer by layer


@dataclass
class KvSkipChoice:
    """Which attention layers to keep out of a quantized KV cache (:func:`choose_kv_skip`).

    skip:          attention modules whose cache stays in the model's dtype
    predicted_kl:  the sum of the one-layer KLs of the layers left in the format (the sweep's additivity
                   assumption; a score measures the real one)
    cache_bytes:   the cache of one sequence at the context asked, with that choice
    """

    skip: list[str]
    predicted_kl: float
    cache_bytes: float


def choose_kv_skip(layer_kl: Mapping[str, float], format_bytes: Mapping[str, float],
                   keep_bytes: Mapping[str, float], kl_budget: float) -> KvSkipChoice:
    """The fewest cache bytes whose predicted KL fits ``kl_budget``: every attention layer either stays in the KV
    format (its one-layer KL from a KV cache sweep, ``format_bytes[layer]``) or keeps the model's dtype (KL 0,
    ``keep_bytes[layer]``): the same multiple-choice knapsack as the linears' (:func:`solve_mck`). Layers without
    a KL from the sweep cannot be judged: PlanError names them."""
    layers = sorted(format_bytes)
    missing = [n for n in layers if n not in layer_kl]
    if missing:
        raise PlanError(f"the KV cache sweep has no KL for {len(missing)} attention layer(s) ({_cut(missing)}); "
                        "sweep the format again on this model")
    picked = solve_mck([[(layer_kl[n], format_bytes[n]), (0.0, keep_bytes[n])] for n in layers], kl_budget)
    skip = [n for n, j in zip(layers, picked, strict=True) if j == 1]
    return KvSkipChoice(skip=skip, predicted_kl=sum(layer_kl[n] for n in layers if n not in skip),
                        cache_bytes=sum(keep_bytes[n] if n in skip else format_bytes[n] for n in layers))


@dataclass(frozen=True)
class BudgetCheck:
    """A verifying score's measured KL against the automatic plan's budget, within the measurement's error.

    within:          True when ``kl + z · err <= budget``, False when ``kl - z · err > budget``, None when the budget
                     lies inside the error (neither can be said at this sample size)
    more_sequences:  with ``within`` None, about how many more evaluation sequences would settle it (the error
                     shrinks as 1 / sqrt(sequences)); None when that cannot be estimated
    more_tokens:     the same in tokens (``more_sequences`` × tokens per sequence), None without a sequence length
    text:            what a person reads
    """

    kl: float
    err: float | None
    budget: float
    within: bool | None
    more_sequences: int | None
    more_tokens: int | None
    text: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_budget(kl: float, err: float | None, budget: float, *, sequences: int | None = None,
                 seq_len: int | None = None, z: float | None = None) -> BudgetCheck:
    """Whether a measured KL (± its standard error, :mod:`quantcore.evaluation.statistics`) is within ``budget``:
    "within the budget" only when ``kl + z · err <= budget`` (z = :data:`quantcore.evaluation.statistics.Z`), "over"
    when ``kl - z · err > budget``; otherwise the budget lies inside the error, and the text says how many more
    sequences (``sequences`` scored so far, ``seq_len`` tokens each) would settle it. Without an error (one
    sequence, or a score stored before errors were kept) the point estimate decides, and the text says so."""
    from quantcore.evaluation.statistics import Estimate, Z, sequences_to_settle, within

    zz = Z if z is None else z
    est = Estimate(float(kl), err)
    verdict = within(est, budget, zz)
    shown = f"measured KL {est.text('.4g')} against the budget {budget:g}"
    more = more_tokens = None
    if err is None:
        text = (f"measured KL {kl:.4g} {'within' if verdict else 'over'} the budget {budget:g} (no error estimate: "
                "one sequence, or a score stored before errors were kept)")
    elif verdict is True:
        text = f"{shown}: within the budget (by more than {zz:g} standard errors)"
    elif verdict is False:
        text = f"{shown}: over the budget (by more than {zz:g} standard errors)"
    else:
        total = sequences_to_settle(est, budget, sequences) if sequences else None
        more = None if total is None or sequences is None else total - sequences
        more_tokens = None if more is None or seq_len is None else more * seq_len
        text = (f"{shown}: the budget lies inside the error (± {zz:g} standard errors), so this score cannot say "
                "whether the plan is within it")
        if more is not None:
            text += (f"; about {more:,} more sequences" + (f" ({more_tokens:,} tokens)" if more_tokens else "")
                     + f", {total:,} in all, would settle it if the KL stays at {kl:.4g}")
    return BudgetCheck(kl=float(kl), err=err, budget=float(budget), within=verdict, more_sequences=more,
                       more_tokens=more_tokens, text=text)


__all__ = [
    "AutoPlanResult",
    "BudgetCheck",
    "DEFAULT_CANDIDATES",
    "KvSkipChoice",
    "UnitChoice",
    "auto_plan",
    "check_budget",
    "choose_kv_skip",
    "plan_units",
    "swept_per_expert",
    "predicted_kl",
    "sensitivity_from_rows",
]
