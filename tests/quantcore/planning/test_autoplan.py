"""Automatic plans under a KL budget: exactness against brute force, fusion groups, targets, costs."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantcore.errors import PlanError
from quantcore.models.parallel import Parallelism
from quantcore.planning.autoplan import auto_plan, plan_units, predicted_kl, sensitivity_from_rows
from quantcore.planning.costs import cost_from_kernel_records
from quantcore.planning.plans import group_label, resolve_plan, spec_from_plan
from quantcore.planning.solver import DEFAULT_KL_STEPS, solve_mck
from quantcore.schemes.fusion import fusion_groups
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.storage import weight_storage_bits
from tests.factories import kernel_record

BLOCK = (
    [f"model.layers.0.self_attn.{x}_proj" for x in "qkvo"]
    + [f"model.layers.0.mlp.{x}_proj" for x in ("gate", "up", "down")]
    + ["lm_head"]
)
UNITS = plan_units(BLOCK)  # qkv, o, gate_up, down, lm_head
LABELS = [group_label(u) for u in UNITS]
SHAPES = {n: (64 * (i + 1), 128) for i, n in enumerate(BLOCK)}  # K a whole number of W4A16 groups
SCHEMES = ("FP8_DYNAMIC", "INT8_W8A8", "W4A16")


def brute_force(options, budget):
    """Cheapest sum of costs over all choices whose KLs sum to <= budget (exact enumeration)."""
    best = math.inf
    for combo in itertools.product(*options):
        if math.fsum(kl for kl, _ in combo) <= budget:
            best = min(best, math.fsum(c for _, c in combo))
    return best


def bits_cost(scheme, layer):
    return weight_storage_bits(scheme, *SHAPES[layer])


# ----------------------------------------------------------------- the knapsack


option = st.tuples(st.floats(0, 1, allow_nan=False), st.floats(0, 100, allow_nan=False))
instance = st.lists(st.lists(option, min_size=1, max_size=4), min_size=1, max_size=5).map(
    lambda units: [[(0.0, 100.0 + max(c for _, c in u)), *u] for u in units]
)  # a KL-0 option per unit


@settings(max_examples=150, deadline=None)
@given(instance, st.floats(0.01, 2.0), st.sampled_from([16, 64, 1000]))
def test_dp_is_feasible_and_within_its_rounding_of_brute_force(options, budget, resolution) -> None:
    picked = solve_mck(options, budget, resolution)
    kl = math.fsum(options[u][j][0] for u, j in enumerate(picked))
    cost = math.fsum(options[u][j][1] for u, j in enumerate(picked))
    assert kl <= budget  # conservative: never over the budget
    assert cost >= brute_force(options, budget) - 1e-9  # cannot beat the true optimum
    # and at least as good as the optimum with one rounding step of slack per unit
    tightened = budget - len(options) * budget / resolution
    if tightened >= 0:
        assert cost <= brute_force(options, tightened) + 1e-9


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 64), st.integers(0, 50)), min_size=1, max_size=4),
        min_size=1,
        max_size=5,
    ),
    st.integers(0, 128),
)
def test_dp_is_exact_when_kls_sit_on_the_grid(raw, budget_steps) -> None:
    """KL = k / 64 with budget b / 64 and 64 steps per unit of budget: no rounding, so exactly optimal."""
    options = [[(0.0, 1000.0), *[(k / 64, float(c)) for k, c in u]] for u in raw]
    budget = budget_steps / 64
    resolution = max(budget_steps, 1)
    picked = solve_mck(options, budget, resolution)
    cost = math.fsum(options[u][j][1] for u, j in enumerate(picked))
    assert cost == pytest.approx(brute_force(options, budget), abs=1e-9)


def test_dp_breaks_cost_ties_towards_lower_kl() -> None:
    options = [[(0.0, 10.0), (0.3, 5.0), (0.1, 5.0)]]
    assert solve_mck(options, 1.0, 100) == [2]


@pytest.mark.parametrize("budget", [-0.1, float("nan"), float("inf")])
def test_bad_budget_is_refused(budget) -> None:
    with pytest.raises(PlanError, match="KL budget"):
        solve_mck([[(0.0, 1.0)]], budget)
    with pytest.raises(PlanError, match="KL budget"):
        auto_plan(BLOCK, {}, kl_budget=budget, target="h100", layer_shapes=SHAPES)


# ----------------------------------------------------------------- the planner


@st.composite
def sensitivities(draw):
    """Unit-level KLs on a 1/64 grid for each scheme; some entries missing (unknown KL)."""
    sens = {}
    for s in SCHEMES:
        row = {}
        for label in LABELS:
            if draw(st.booleans()) or s == "FP8_DYNAMIC":
                row[label] = draw(st.integers(0, 32)) / 64
        sens[s] = row
    return sens


@settings(max_examples=80, deadline=None)
@given(sensitivities(), st.integers(0, 96))
def test_auto_plan_matches_brute_force_over_every_plan(sens, budget_steps) -> None:
    budget = budget_steps / 64
    result = auto_plan(
        BLOCK,
        sens,
        kl_budget=budget,
        target="h100",
        candidates=SCHEMES,
        layer_shapes=SHAPES,
        resolution=max(budget_steps, 1),
    )
    # brute force over fusion-respecting plans: one scheme per unit, only where the KL is known
    per_unit = []
    for unit, label in zip(UNITS, LABELS, strict=True):
        opts = [(0.0, math.fsum(bits_cost("BF16", m) for m in unit))]
        opts += [
            (sens[s][label], math.fsum(bits_cost(s, m) for m in unit)) for s in SCHEMES if label in sens[s]
        ]
        per_unit.append(opts)
    assert result.cost == pytest.approx(brute_force(per_unit, budget))
    assert result.predicted_kl <= budget
    assert result.predicted_kl == pytest.approx(predicted_kl(result.plan, sens))
    assert result.baseline_cost == sum(bits_cost("BF16", m) for m in BLOCK)
    for unit, choice in zip(UNITS, result.per_unit, strict=True):  # fusion groups share one scheme
        assert {result.plan[m] for m in unit} == {choice.scheme}
        assert choice.scheme == "BF16" or choice.unit in sens[choice.scheme]
    # the plan is a valid plan file
    assert resolve_plan(spec_from_plan(result.plan), BLOCK) == {
        n: get_scheme(s) for n, s in result.plan.items()
    }


@settings(max_examples=40, deadline=None)
@given(sensitivities(), st.integers(0, 60), st.integers(1, 60))
def test_more_budget_never_costs_more(sens, b1, extra) -> None:
    kw = dict(target="h100", candidates=SCHEMES, layer_shapes=SHAPES, resolution=64)
    small = auto_plan(BLOCK, sens, kl_budget=b1 / 64 + 1e-3, **kw)
    large = auto_plan(BLOCK, sens, kl_budget=(b1 + extra) / 64 + 1e-3, **kw)
    assert large.cost <= small.cost


def test_zero_budget_keeps_everything_in_bf16_unless_free() -> None:
    sens = {"FP8_DYNAMIC": {label: 0.01 for label in LABELS}}
    sens["FP8_DYNAMIC"]["lm_head"] = 0.0
    r = auto_plan(BLOCK, sens, kl_budget=0, target="h100", layer_shapes=SHAPES)
    assert r.plan["lm_head"] == "FP8_DYNAMIC"
    assert all(s == "BF16" for n, s in r.plan.items() if n != "lm_head")
    assert r.predicted_kl == 0.0


def test_scheme_unsupported_on_target_is_never_chosen() -> None:
    # W4AFP8 has one kernel, built for Hopper alone: none on an L40S (test_hardware)
    sens = {"W4AFP8": {label: 0.0 for label in LABELS}, "FP8_DYNAMIC": {label: 0.5 for label in LABELS}}
    l40s = auto_plan(
        BLOCK, sens, kl_budget=10.0, target="l40s", candidates=("W4AFP8", "FP8_DYNAMIC"), layer_shapes=SHAPES
    )
    assert "W4AFP8" not in l40s.plan.values()
    assert "Hopper" in l40s.excluded["W4AFP8"]
    h100 = auto_plan(
        BLOCK, sens, kl_budget=10.0, target="h100", candidates=("W4AFP8", "FP8_DYNAMIC"), layer_shapes=SHAPES
    )
    assert "W4AFP8" in h100.plan.values()


def test_unknown_kl_forbids_the_scheme_for_that_unit_only() -> None:
    sens = {"W4A16": {label: 0.0 for label in LABELS if label != "lm_head"}}
    r = auto_plan(BLOCK, sens, kl_budget=1.0, target="h100", candidates=("W4A16",), layer_shapes=SHAPES)
    assert r.plan["lm_head"] == "BF16"
    assert all(s == "W4A16" for n, s in r.plan.items() if n != "lm_head")


def test_per_layer_sensitivity_sums_over_a_fusion_group() -> None:
    per_layer = {n: 0.01 for n in BLOCK}
    sens = {"FP8_DYNAMIC": per_layer}
    r = auto_plan(BLOCK, sens, kl_budget=1.0, target="h100", candidates=("FP8_DYNAMIC",), layer_shapes=SHAPES)
    qkv = next(u for u in r.per_unit if len(u.layers) == 3)
    assert qkv.kl == pytest.approx(0.03)
    assert r.predicted_kl == pytest.approx(0.01 * len(BLOCK))
    # a budget that fits q+k+v only as a whole: a split group is never produced
    r = auto_plan(
        BLOCK, sens, kl_budget=0.025, target="h100", candidates=("FP8_DYNAMIC",), layer_shapes=SHAPES
    )
    for g in fusion_groups(BLOCK):
        assert len({r.plan[m] for m in g}) == 1


def test_sensitivity_rows_with_unit_layers() -> None:
    rows = [{"scheme": "INT8_W8A8", "unit": "qkv@0", "layers": UNITS[0], "kl_mean": 0.2}]
    rows += [{"scheme": "INT8_W8A8", "unit": n, "layers": [n], "kl_mean": 0.01} for n in BLOCK[3:]]
    sens, unit_layers = sensitivity_from_rows(rows)
    r = auto_plan(
        BLOCK,
        sens,
        kl_budget=0.5,
        target="a100",
        candidates=("INT8_W8A8",),
        layer_shapes=SHAPES,
        unit_layers=unit_layers,
    )
    assert set(r.plan.values()) == {"INT8_W8A8"}
    assert r.predicted_kl == pytest.approx(0.2 + 0.01 * 5)
    assert predicted_kl(r.plan, sens, unit_layers=unit_layers) == pytest.approx(r.predicted_kl)


@pytest.mark.parametrize(
    ("sens", "words"),
    [
        ({"FP8_DYNAMIC": {"model.layers.9.mlp.down_proj": 0.1}}, "'model.layers.9.mlp.down_proj'"),
        ({"FP8_DYNAMIC": {"lm_head": float("nan")}}, "rerun the sensitivity sweep"),
        ({"FP8_DYNAMIC": {"lm_head": "high"}}, "must be a number"),
    ],
)
def test_bad_sensitivity_is_refused_naming_the_entry(sens, words) -> None:
    with pytest.raises(PlanError, match=words):
        auto_plan(BLOCK, sens, kl_budget=0.1, target="h100", layer_shapes=SHAPES)


def test_unknown_names_are_refused() -> None:
    with pytest.raises(PlanError, match="FP7"):
        auto_plan(BLOCK, {}, kl_budget=0.1, target="h100", candidates=("FP7",), layer_shapes=SHAPES)
    with pytest.raises(PlanError, match="h900"):
        auto_plan(BLOCK, {}, kl_budget=0.1, target="h900", layer_shapes=SHAPES)
    with pytest.raises(PlanError, match="lm_head"):
        auto_plan(BLOCK, {}, kl_budget=0.1, target="h100", layer_shapes={n: SHAPES[n] for n in BLOCK[:-1]})


def test_excluded_lists_schemes_without_sensitivity() -> None:
    r = auto_plan(
        BLOCK,
        {"FP8_DYNAMIC": {label: 0.0 for label in LABELS}},
        kl_budget=0.1,
        target="h100",
        layer_shapes=SHAPES,
    )
    assert "sensitivity sweep" in r.excluded["W4A16"]
    assert "FP8_DYNAMIC" not in r.excluded
    assert r.cost_unit == "weight bits"
    assert r.to_dict()["per_unit"][0]["layers"] == UNITS[0]


def test_predicted_kl_names_missing_units() -> None:
    plan = {n: "BF16" for n in BLOCK}
    plan["lm_head"] = "W4A16"
    with pytest.raises(PlanError, match="lm_head in W4A16"):
        predicted_kl(plan, {"W4A16": {"model.layers.0.mlp.down_proj": 0.1}})
    assert predicted_kl(plan, {"W4A16": {"lm_head": 0.25}}) == 0.25


def test_predicted_kl_of_a_split_group_uses_layer_entries() -> None:
    plan = {n: "BF16" for n in BLOCK}
    plan["model.layers.0.self_attn.q_proj"] = "FP8_DYNAMIC"
    sens = {"FP8_DYNAMIC": {LABELS[0]: 0.5, "model.layers.0.self_attn.q_proj": 0.125}}
    assert predicted_kl(plan, sens) == 0.125


# ----------------------------------------------------------------- measured costs


def record(m, n, k, path, ms, device_name="NVIDIA H100 80GB HBM3"):
    return kernel_record(m, n, k, path, ms, name=device_name)


def measured_records(m=2048):
    recs = []
    for n, k in set(SHAPES.values()):
        base = n * k / 1e4
        recs += [
            record(m, n, k, "baseline", base),
            record(m, n, k, "fp8_row+q", base * 0.55),
            record(m, n, k, "fp8_row", base * 0.5),
            record(m, n, k, "int8_row+q", base * 0.7),
        ]
    return recs


def test_cost_from_kernel_records_picks_the_serving_path() -> None:
    cost = cost_from_kernel_records(
        measured_records(), SHAPES, ("BF16", "FP8_DYNAMIC", "INT8_W8A8", "W4A16"), m=2048, target="h100"
    )
    n, k = SHAPES["lm_head"]
    assert cost["BF16"]["lm_head"] == pytest.approx(n * k / 1e4)
    assert cost["FP8_DYNAMIC"]["lm_head"] == pytest.approx(
        n * k / 1e4 * 0.55
    )  # +q: activation quantization paid
    assert cost["INT8_W8A8"]["lm_head"] == pytest.approx(n * k / 1e4 * 0.7)
    assert "W4A16" not in cost  # no kernel path: left to estimation
    assert cost_from_kernel_records(measured_records(), SHAPES, ("BF16",), m=16) == {}


def test_kernel_times_from_another_gpu_are_refused() -> None:
    with pytest.raises(PlanError, match="not on target 'a100'"):
        cost_from_kernel_records(measured_records(), SHAPES, ("BF16",), m=2048, target="a100")
    mixed = measured_records() + [record(1, 64, 32, "baseline", 1.0, device_name="NVIDIA A100-SXM4-80GB")]
    with pytest.raises(PlanError, match="several devices"):
        cost_from_kernel_records(mixed, SHAPES, ("BF16",), m=2048)


def test_measured_costs_drive_the_plan_and_missing_ones_are_estimated() -> None:
    cost = cost_from_kernel_records(measured_records(), SHAPES, ("BF16", "FP8_DYNAMIC", "INT8_W8A8"), m=2048)
    sens = {s: {label: 0.001 for label in LABELS} for s in ("FP8_DYNAMIC", "INT8_W8A8", "W4A16")}
    r = auto_plan(
        BLOCK, sens, kl_budget=1.0, target="h100", candidates=("FP8_DYNAMIC", "INT8_W8A8"), cost=cost
    )
    assert set(r.plan.values()) == {"FP8_DYNAMIC"}  # measured fastest
    assert r.cost_unit == "ms" and r.cost == pytest.approx(0.55 * r.baseline_cost)
    assert all(u.cost_source == "measured" for u in r.per_unit)
    est = auto_plan(BLOCK, sens, kl_budget=1.0, target="h100", candidates=("W4A16",), cost=cost)
    assert set(est.plan.values()) == {"W4A16"}
    assert all(u.cost_source == "estimated" for u in est.per_unit)
    assert est.cost == pytest.approx(est.baseline_cost * 4 / 16)
    none = auto_plan(
        BLOCK, sens, kl_budget=1.0, target="h100", candidates=("W4A16",), cost=cost, estimate_missing=False
    )
    assert set(none.plan.values()) == {"BF16"}
    assert "kernel time" in none.excluded["W4A16"]
    # a SmoothQuant scheme with no time anywhere: said so, beside the note on the layers it cannot smooth
    sq = auto_plan(BLOCK, {"INT8_W8A8_SQ": sens["W4A16"]}, kl_budget=1.0, target="h100", candidates=("INT8_W8A8_SQ",),
                   cost=cost, estimate_missing=False)
    assert set(sq.plan.values()) == {"BF16"} and "kernel time" in sq.excluded["INT8_W8A8_SQ"]
    assert any(n.startswith("INT8_W8A8_SQ was not offered to 2 layer(s)") for n in sq.notes)


def test_measured_costs_need_a_baseline_for_every_layer() -> None:
    cost = {"BF16": {n: 1.0 for n in BLOCK[:-1]}}
    with pytest.raises(PlanError, match="lm_head"):
        auto_plan(BLOCK, {}, kl_budget=0.1, target="h100", cost=cost)


def test_default_resolution_is_documented_value() -> None:
    assert DEFAULT_KL_STEPS == 10_000


def test_realistic_size_runs_fast() -> None:
    """A 32-block Llama (129 units, 10 candidates) at the default resolution."""
    import time

    names = [
        f"model.layers.{b}.{p}"
        for b in range(32)
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ] + ["lm_head"]
    units = plan_units(names)
    shapes = {n: (4096, 4096) for n in names}
    sens = {
        s: {group_label(u): 0.001 * (1 + i % 7) * (j + 1) for i, u in enumerate(units)}
        for j, s in enumerate(("FP8_DYNAMIC", "INT8_W8A8", "W4A16"))
    }
    t0 = time.perf_counter()
    r = auto_plan(names, sens, kl_budget=0.2, target="h100", layer_shapes=shapes)
    assert time.perf_counter() - t0 < 30
    assert r.predicted_kl <= 0.2 and len(r.per_unit) == len(units)


def test_an_ideal_cost_plans_decode_and_prefill_differently_on_a_gpu_nobody_measured() -> None:
    """With the roofline of an H100 as the cost and the same KL for FP8 W8A8 and INT4 weights, a decode step
    (M=1, bound by the weight read) takes W4A16 and a prefill (M=2048, bound by the math) takes FP8."""
    from quantcore.kernels.roofline import cost_from_roofline
    from quantcore.planning.costs import COST_IDEAL

    shapes = {n: (4096, 4096) for n in BLOCK}
    sens = {s: {label: 1e-4 for label in LABELS} for s in ("FP8_DYNAMIC", "W4A16")}
    chosen = {}
    for m in (1, 2048):
        cost = cost_from_roofline(["BF16", "FP8_DYNAMIC", "W4A16"], shapes, "h100", m)
        res = auto_plan(BLOCK, sens, kl_budget=1.0, target="h100", candidates=["FP8_DYNAMIC", "W4A16"], cost=cost,
                        layer_shapes=shapes, cost_source=COST_IDEAL)
        assert res.cost_unit == "ms" and {p.cost_source for p in res.per_unit} == {COST_IDEAL}
        assert res.cost == pytest.approx(sum(cost[res.plan[n]][n] for n in BLOCK))
        chosen[m] = set(res.plan.values())
    assert chosen == {1: {"W4A16"}, 2048: {"FP8_DYNAMIC"}}
    with pytest.raises(ValueError, match="positive"):
        cost_from_roofline(["BF16"], shapes, "h100", 0)


def test_a_scheme_whose_groups_do_not_divide_k_is_not_offered_to_that_unit() -> None:
    """W4A16 (groups of 128) cannot be served on K = 576: the planner keeps those units in another scheme and
    says so, and still uses W4A16 where K = 1536 fits."""
    shapes = {n: (576, 1536) if n.endswith("down_proj") else (576, 576) for n in BLOCK}
    sens = {"W4A16": {label: 1e-6 for label in LABELS}, "FP8_DYNAMIC": {label: 1e-3 for label in LABELS}}
    res = auto_plan(BLOCK, sens, kl_budget=1.0, target="h100", candidates=["W4A16", "FP8_DYNAMIC"],
                    layer_shapes=shapes)
    assert res.plan["model.layers.0.mlp.down_proj"] == "W4A16"  # the cheapest, and its groups fit
    assert {s for n, s in res.plan.items() if not n.endswith("down_proj")} == {"FP8_DYNAMIC"}
    [note] = [n for n in res.notes if n.startswith("W4A16 was not offered to 4 unit(s)")]
    assert note.endswith("; W4A16_G64, whose groups of 64 divide them: sweep it to let the planner use it")
    # with a sweep of W4A16_G64 the planner takes it there, and says nothing more about it
    sens["W4A16_G64"] = {label: 2e-6 for label in LABELS}
    res = auto_plan(BLOCK, sens, kl_budget=1.0, target="h100", candidates=["W4A16", "W4A16_G64", "FP8_DYNAMIC"],
                    layer_shapes=shapes)
    assert {s for n, s in res.plan.items() if not n.endswith("down_proj")} == {"W4A16_G64"}
    [note] = [n for n in res.notes if n.startswith("W4A16 was not offered")]
    assert "sweep it" not in note


def test_a_scheme_whose_groups_would_straddle_two_gpus_is_not_offered_there() -> None:
    """At tensor parallelism 4 down_proj's K = 2,816 (22 groups of 128) is 704 inputs a GPU, 5.5 groups: vLLM
    refuses it, so the planner keeps down_proj in another scheme (and names the smaller group that fits)."""
    shapes = {n: (1024, 2816) if n.endswith("down_proj") else (1024, 1024) for n in BLOCK}
    sens = {"W4A16": {label: 1e-6 for label in LABELS}, "FP8_DYNAMIC": {label: 1e-3 for label in LABELS}}
    kwargs = dict(kl_budget=1.0, target="h100", candidates=["W4A16", "FP8_DYNAMIC"], layer_shapes=shapes)
    assert set(auto_plan(BLOCK, sens, **kwargs, parallel=Parallelism(2)).plan.values()) == {"W4A16"}  # 1,408 = 11 x 128
    res = auto_plan(BLOCK, sens, **kwargs, parallel=Parallelism(4))
    assert res.plan["model.layers.0.mlp.down_proj"] == "FP8_DYNAMIC"
    assert {s for n, s in res.plan.items() if not n.endswith("down_proj")} == {"W4A16"}
    [note] = [n for n in res.notes if n.startswith("W4A16 was not offered to 1 unit(s) whose K on each of 4 GPUs")]
    assert note.endswith("; W4A16_G64, whose groups of 64 divide them: sweep it to let the planner use it")


def test_w4afp8_is_offered_only_where_vllms_kernel_can_tile_the_fused_layer() -> None:
    """On an H100 W4AFP8 reads 4-bit weights and does FP8 math; its kernel needs N a multiple of 128 for the layer
    vLLM loads (q/k/v fused), so a unit whose fused N is not gets another scheme, with a note; on a B200 it has no
    kernel at all."""
    shapes = {n: (128, 256) for n in BLOCK}
    shapes["model.layers.0.self_attn.k_proj"] = shapes["model.layers.0.self_attn.v_proj"] = (64, 256)  # qkv N = 256
    shapes["model.layers.0.mlp.down_proj"] = (192, 256)
    sens = {"W4AFP8": {label: 1e-6 for label in LABELS}, "FP8_DYNAMIC": {label: 1e-3 for label in LABELS}}
    res = auto_plan(BLOCK, sens, kl_budget=1.0, target="h100", candidates=["W4AFP8", "FP8_DYNAMIC"],
                    layer_shapes=shapes)
    assert res.plan["model.layers.0.mlp.down_proj"] == "FP8_DYNAMIC"
    assert {s for n, s in res.plan.items() if not n.endswith("down_proj")} == {"W4AFP8"}
    [note] = [n for n in res.notes if n.startswith("W4AFP8 was not offered to 1 unit(s)")]
    assert "multiple of 128" in note
    res = auto_plan(BLOCK, sens, kl_budget=1.0, target="b200", candidates=["W4AFP8", "FP8_DYNAMIC"],
                    layer_shapes=shapes)
    assert set(res.plan.values()) == {"FP8_DYNAMIC"} and "Hopper" in res.excluded["W4AFP8"]
    # block-scaled FP8 on the same shapes: the merged q/k/v has a 64-row k_proj, which vLLM refuses
    sens["FP8_BLOCK"] = {label: 1e-6 for label in LABELS}
    res = auto_plan(BLOCK, sens, kl_budget=1.0, target="h100", candidates=["FP8_BLOCK", "FP8_DYNAMIC"],
                    layer_shapes=shapes)
    assert res.plan["model.layers.0.self_attn.q_proj"] == "FP8_DYNAMIC" and res.plan["lm_head"] == "FP8_BLOCK"
    [note] = [n for n in res.notes if n.startswith("FP8_BLOCK was not offered to 1 unit(s)")]
    assert "fp8_block_misfits" in note


def test_kv_skip_keeps_the_cheapest_layers_that_bring_the_cache_within_budget():
    from quantcore.planning.autoplan import choose_kv_skip

    # a global layer holds every token (200 bytes kept, 100 in the format); a windowed one only its window
    kl = {"global": 0.010, "windowed": 0.020, "other": 0.001}
    fmt = {"global": 100.0, "windowed": 10.0, "other": 100.0}
    keep = {"global": 200.0, "windowed": 20.0, "other": 200.0}
    choice = choose_kv_skip(kl, fmt, keep, 0.012)
    assert choice.skip == ["windowed"]  # 0.011 left for +10 bytes: keeping "global" would cost +100
    assert choice.predicted_kl == pytest.approx(0.011) and choice.cache_bytes == 220.0
    assert choose_kv_skip(kl, fmt, keep, 1.0).skip == []  # everything fits in the format
    assert sorted(choose_kv_skip(kl, fmt, keep, 0.0).skip) == sorted(kl)  # nothing may cost KL: keep all
    with pytest.raises(PlanError, match=r"no KL for 1 attention layer\(s\) \('other'\)"):
        choose_kv_skip({"global": 0.01, "windowed": 0.02}, fmt, keep, 0.01)


def test_with_the_bits_proxy_a_tied_head_stays_in_bf16() -> None:
    """Quantizing a head tied to the input embeddings saves no memory: llm-compressor unties them and keeps the
    embedding in 16 bits. With the bits proxy the planner counts that, so it quantizes the untied head and keeps a
    tied one in BF16."""
    names = [*BLOCK, "lm_head"]
    shapes = {n: (576, 1536) if n.endswith("down_proj") else (576, 576) for n in BLOCK} | {"lm_head": (49152, 576)}
    sens = {"W4A16_G64": {**{label: 1e-6 for label in LABELS}, "lm_head": 1e-6}}
    free = auto_plan(names, sens, kl_budget=1.0, target="h100", candidates=["W4A16_G64"], layer_shapes=shapes)
    tied = auto_plan(names, sens, kl_budget=1.0, target="h100", candidates=["W4A16_G64"], layer_shapes=shapes,
                     tied=["lm_head"])
    assert free.plan["lm_head"] == "W4A16_G64" and tied.plan["lm_head"] == "BF16"
    assert {s for n, s in tied.plan.items() if n != "lm_head"} == {"W4A16_G64"}


def test_smoothquant_is_not_offered_where_no_llm_compressor_recipe_can_carry_it() -> None:
    """INT8_W8A8_SQ is the cheapest everywhere by its KL, but an llm-compressor recipe smooths neither o_proj nor
    lm_head: the planner gives those the unsmoothed INT8_W8A8, says so, and the plan it returns exports."""
    import yaml

    from quantcore.export.llmcompressor import to_llmcompressor_recipe

    sens = {"INT8_W8A8_SQ": {label: 1e-6 for label in LABELS}, "INT8_W8A8": {label: 1e-3 for label in LABELS}}
    res = auto_plan(BLOCK, sens, kl_budget=1.0, target="h100", candidates=["INT8_W8A8_SQ", "INT8_W8A8"],
                    layer_shapes=SHAPES)
    assert {n: s for n, s in res.plan.items() if s == "INT8_W8A8"} == {
        "model.layers.0.self_attn.o_proj": "INT8_W8A8", "lm_head": "INT8_W8A8"}
    assert {s for n, s in res.plan.items() if n not in ("model.layers.0.self_attn.o_proj", "lm_head")} == {
        "INT8_W8A8_SQ"}
    [note] = [n for n in res.notes if n.startswith("INT8_W8A8_SQ was not offered to 2 layer(s)")]
    assert "'model.layers.0.self_attn.o_proj', 'lm_head'" in note and "llm-compressor" in note
    stage = yaml.safe_load(to_llmcompressor_recipe(res.plan, layer_names=BLOCK))["quant_stage"]
    assert "smoothing_modifiers" in stage
    # with nothing but the smoothed scheme swept, those two stay in BF16
    res = auto_plan(BLOCK, {"INT8_W8A8_SQ": sens["INT8_W8A8_SQ"]}, kl_budget=1.0, target="h100",
                    candidates=["INT8_W8A8_SQ"], layer_shapes=SHAPES)
    assert res.plan["model.layers.0.self_attn.o_proj"] == res.plan["lm_head"] == "BF16"
    # a sweep that left those two out (as the worker's SmoothQuant sweeps do) plans the same and says the same
    swept = {k: v for k, v in sens["INT8_W8A8_SQ"].items() if not k.endswith(("o_proj", "lm_head"))}
    assert len(swept) == len(LABELS) - 2
    res = auto_plan(BLOCK, {**sens, "INT8_W8A8_SQ": swept}, kl_budget=1.0, target="h100",
                    candidates=["INT8_W8A8_SQ", "INT8_W8A8"], layer_shapes=SHAPES)
    assert {n for n, s in res.plan.items() if s == "INT8_W8A8"} == {"model.layers.0.self_attn.o_proj", "lm_head"}
    assert any(n.startswith("INT8_W8A8_SQ was not offered to 2 layer(s)") for n in res.notes)


def test_int8_with_dynamic_per_tensor_activations_is_not_offered_to_a_layer_vllm_would_not_load() -> None:
    """INT8_PER_TENSOR has the lowest KL and cost, but vLLM's compressed-tensors loader has no kernel for dense INT8
    layers with dynamic per-tensor activation scales: the planner takes INT8_W8A8 (per-token) instead and says why,
    without calling INT8_PER_TENSOR a scheme with no KL or cost."""
    sens = {"INT8_PER_TENSOR": {label: 1e-7 for label in LABELS}, "INT8_W8A8": {label: 1e-3 for label in LABELS}}
    res = auto_plan(BLOCK, sens, kl_budget=1.0, target="h100", candidates=["INT8_PER_TENSOR", "INT8_W8A8"],
                    layer_shapes=SHAPES)
    assert set(res.plan.values()) == {"INT8_W8A8"}
    [note] = [n for n in res.notes if n.startswith(f"INT8_PER_TENSOR was not offered to {len(BLOCK)} layer(s)")]
    assert "vLLM" in note and "INT8_W8A8" in note
    assert "INT8_PER_TENSOR" not in res.excluded


def test_moe_experts_in_a_scheme_vllms_fused_moe_cannot_run_are_not_offered() -> None:
    """A block's experts take one scheme; INT8_PER_TENSOR there is something vLLM's fused MoE has no method for
    (quantcore.planning.serving.moe_unserved), however low its KL: the planner puts INT8_W8A8 on them, and the plan it
    returns has nothing moe_unserved or vllm_unloadable would refuse."""
    from quantcore.planning.serving import moe_unserved, vllm_unloadable

    experts = [f"model.layers.0.mlp.experts.{e}.{p}_proj" for e in range(4) for p in ("gate", "up", "down")]
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"] + experts + ["lm_head"]
    shapes = {n: (64, 128) for n in names}
    units = plan_units(names)
    sens = {"INT8_PER_TENSOR": {group_label(u): 1e-7 for u in units},
            "INT8_W8A8": {group_label(u): 1e-3 for u in units}}
    res = auto_plan(names, sens, kl_budget=1.0, target="h100", candidates=["INT8_PER_TENSOR", "INT8_W8A8"],
                    layer_shapes=shapes)
    assert {res.plan[n] for n in experts} == {"INT8_W8A8"}
    assert moe_unserved(res.plan) == [] and vllm_unloadable(res.plan) == []
    assert sorted(vllm_unloadable(dict.fromkeys(names, "INT8_PER_TENSOR"))) == sorted(names)  # dense, experts alike
