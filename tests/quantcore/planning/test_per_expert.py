"""Per-expert plans (issue 43, item 4): the experts of one MoE block in different schemes, where the target can hold
it (an llm-compressor recipe, a compressed-tensors config) and refused where it cannot (vLLM's fused MoE); scored
with each expert's own input scales; searched by the automatic planner on per-expert sensitivity units. A tiny
Qwen3-MoE from a config (tests/factories.py): 2 blocks of 4 experts."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from quantcore.algorithms.inputs import PlanInputs
from quantcore.errors import PlanError
from quantcore.planning.plans import PlanSpec, Rule, resolve_plan, spec_from_plan
from quantcore.schemes.fusion import expert_block, fusion_units
from tests.factories import tiny_moe

BLOCK0 = "model.layers.0.mlp.experts"
BLOCK1 = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def model() -> nn.Module:
    from quantcore.models.moe import split_experts

    m = tiny_moe()
    split_experts(m)
    return m


@pytest.fixture(scope="module")
def names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def mixed_spec(**kw: object) -> PlanSpec:
    """FP8_DYNAMIC everywhere, experts 1 and 3 of block 0 in W4A16, expert 2 of block 1 in NVFP4, the head BF16."""
    rules = [Rule(r"layers\.0\.mlp\.experts\.[13]\.", "W4A16"), Rule(r"layers\.1\.mlp\.experts\.2\.", "NVFP4"),
             Rule("lm_head$", "BF16")]
    return PlanSpec(default="FP8_DYNAMIC", rules=rules, **kw)  # type: ignore[arg-type]


def test_a_plan_mixes_a_blocks_experts_only_when_it_says_per_expert(names):
    with pytest.raises(PlanError) as err:
        resolve_plan(mixed_spec(), names)
    msg = str(err.value)
    assert f"the experts of {BLOCK0} mix schemes (FP8_DYNAMIC, W4A16)" in msg and "per_expert: true" in msg
    plan = resolve_plan(mixed_spec(per_expert=True), names)
    assert plan[f"{BLOCK0}.1.down_proj"].name == "W4A16" and plan[f"{BLOCK0}.0.gate_proj"].name == "FP8_DYNAMIC"
    assert plan[f"{BLOCK1}.2.up_proj"].name == "NVFP4"
    # one expert's gate/up/down still take one scheme: the per-expert unit
    spec = mixed_spec(per_expert=True)
    spec.layers[f"{BLOCK1}.0.down_proj"] = "W4A16"
    with pytest.raises(PlanError, match=rf"expert {BLOCK1}\.0 mixes schemes \(gate_proj=FP8_DYNAMIC, "
                                        r"up_proj=FP8_DYNAMIC, down_proj=W4A16\)"):
        resolve_plan(spec, names)


def test_per_expert_survives_the_plan_file_and_compaction(names):
    spec = mixed_spec(per_expert=True)
    data = spec.to_dict()
    assert data["per_expert"] is True and "per_expert" not in mixed_spec().to_dict()
    assert PlanSpec.from_yaml(spec.to_yaml()).per_expert is True
    with pytest.raises(PlanError, match="'per_expert' must be true or false, got 'yes'"):
        PlanSpec.from_dict({**data, "per_expert": "yes"})
    plan = resolve_plan(spec, names)
    back = spec_from_plan(plan)
    assert back.per_expert and resolve_plan(back, names) == plan
    assert not spec_from_plan(resolve_plan(PlanSpec(default="W4A16"), names)).per_expert


def test_per_expert_units_are_one_expert_each(names):
    units = fusion_units(names, per_expert=True)
    experts = [u for u in units if expert_block(u[0])]
    assert len(experts) == 2 * 4 and all(len(u) == 3 and len({m.rsplit(".", 1)[0] for m in u}) == 1 for u in experts)
    assert [u for u in units if not expert_block(u[0])] == [u for u in fusion_units(names) if not expert_block(u[0])]


def test_vllm_refuses_a_per_expert_plan_naming_the_block_and_its_experts(names):
    from quantcore.export.vllm import to_vllm_command
    from quantcore.planning.serving import moe_unserved, vllm_unloadable

    plan = resolve_plan(mixed_spec(per_expert=True), names)
    [msg] = moe_unserved(plan)
    assert f"{BLOCK0}: FP8_DYNAMIC on expert(s) 0, 2; W4A16 on expert(s) 1, 3" in msg
    assert f"{BLOCK1}: FP8_DYNAMIC on expert(s) 0, 1, 3; NVFP4 on expert(s) 2" in msg
    assert set(vllm_unloadable(plan)) == {n for n in names if expert_block(n)}
    with pytest.raises(PlanError, match=rf"cannot be served by vLLM.*2 MoE block\(s\).*{BLOCK0}: FP8_DYNAMIC on "):
        to_vllm_command(plan, model_path="m", layer_names=names)
    uniform = resolve_plan(PlanSpec(default="W4A16", per_expert=True), names)
    assert moe_unserved(uniform) == [] and to_vllm_command(uniform, model_path="m", layer_names=names)


def test_llm_compressor_and_compressed_tensors_hold_per_expert_schemes_and_import_them_back(names):
    from quantcore.export.compressed_tensors import from_compressed_tensors_config, to_compressed_tensors_config
    from quantcore.export.llmcompressor import from_llmcompressor_recipe, to_llmcompressor_recipe

    plan = resolve_plan(mixed_spec(per_expert=True), names)
    recipe = to_llmcompressor_recipe(plan, layer_names=names)
    assert f"{BLOCK0}.1.down_proj" in recipe and f"{BLOCK1}.2.gate_proj" in recipe
    back = from_llmcompressor_recipe(recipe, layer_names=names)
    assert {n: s.name for n, s in back.items()} == {n: s.name for n, s in plan.items()}
    assert spec_from_plan(back).per_expert
    config = to_compressed_tensors_config(plan, layer_names=names)
    again = from_compressed_tensors_config(json.loads(json.dumps(config)), layer_names=names)
    assert {n: s.name for n, s in again.items()} == {n: s.name for n, s in plan.items()}


def test_a_mixed_block_is_scored_with_each_experts_own_input_scales(model, names):
    """A fused MoE layer (one method a block) shares the experts' static input scale and takes a dynamic per-tensor
    one over the whole block; a block whose experts mix schemes has no fused layer, so each expert keeps its own
    (as the checkpoint stores them), while a block in one scheme is emulated as vLLM serves it."""
    from quantcore.algorithms.apply import apply_plan, quantized_model
    from quantcore.evaluation.calibrate import calibrate
    from quantcore.formats.scales import scale_from_amax

    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    amax = {n: s.amax for n, s in calibrate(model, ids).items()}
    plan = {n: "BF16" if n == "lm_head" else "W8A16" if n.startswith(f"{BLOCK0}.3.") else "FP8" for n in names}
    applied = apply_plan(model, plan, PlanInputs(act_amax=amax))
    try:
        scales = {n: applied._states[n].static_scale for n in names if n in applied._states}
    finally:
        applied.restore()
    down0 = [f"{BLOCK0}.{e}.down_proj" for e in range(3)]
    own = {n: float(scale_from_amax(amax[n], "fp8_e4m3")) for n in down0}
    assert len(set(own.values())) == 3 and {n: scales[n] for n in down0} == pytest.approx(own)
    down1 = [f"{BLOCK1}.{e}.down_proj" for e in range(4)]
    assert {scales[n] for n in down1} == {max(float(scale_from_amax(amax[n], "fp8_e4m3")) for n in down1)}

    dynamic = {n: "W8A16" if n.startswith(f"{BLOCK0}.3.") else "FP8_PER_TENSOR" for n in names if expert_block(n)}
    blocks = {b: model.get_submodule(b) for b in (BLOCK0, BLOCK1)}
    seen: dict[str, object] = {}
    def hook(block: str):  # what the block holds when it runs: None (own scales) or the block-wide amaxes' dict
        return lambda mod, _args: seen.update({block: mod.block_amax}) and None

    hooks = [m.register_forward_pre_hook(hook(b)) for b, m in blocks.items()]
    try:
        with torch.no_grad(), quantized_model(model, dynamic):
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    assert seen[BLOCK0] is None and seen[BLOCK1] == {}  # block 1 takes the block-wide scale, block 0 its own


def test_the_planner_gives_experts_their_own_schemes_from_per_expert_sensitivity(names):
    from quantcore.planning.autoplan import auto_plan, predicted_kl, sensitivity_from_rows, swept_per_expert
    from quantcore.planning.plans import group_label

    units = fusion_units(names, per_expert=True)
    rows = []
    for u in units:
        hot = u[0].startswith(f"{BLOCK0}.2.")  # one expert the 4-bit scheme hurts
        rows.append({"scheme": "W4A16", "unit": group_label(u), "layers": u, "kl_mean": 0.5 if hot else 1e-4})
        rows.append({"scheme": "FP8_DYNAMIC", "unit": group_label(u), "layers": u, "kl_mean": 2e-4})
    # a whole-block sweep's rows beside them are passed over, not refused
    for block in (BLOCK0, BLOCK1):
        members = [n for n in names if n.startswith(block + ".")]
        rows.append({"scheme": "W4A16", "unit": group_label(members), "layers": members, "kl_mean": 0.6})
    sens, unit_layers = sensitivity_from_rows(rows)
    assert swept_per_expert(unit_layers)
    shapes = {n: (256, 256) for n in names}  # K a multiple of W4A16's groups of 128
    res = auto_plan(names, sens, kl_budget=0.05, target="h100", candidates=["W4A16", "FP8_DYNAMIC"],
                    layer_shapes=shapes, unit_layers=unit_layers)
    assert res.per_expert and res.to_dict()["per_expert"] is True
    assert res.plan[f"{BLOCK0}.2.down_proj"] == "FP8_DYNAMIC"
    assert {res.plan[f"{BLOCK0}.{e}.up_proj"] for e in (0, 1, 3)} == {"W4A16"}
    assert any("per-expert units: 1 MoE block(s)" in n and "vLLM" in n for n in res.notes)
    assert predicted_kl(res.plan, sens, unit_layers=unit_layers) == pytest.approx(res.predicted_kl)
    # the plan saves as a per-expert plan file and resolves back
    assert resolve_plan(spec_from_plan(res.plan), names) == resolve_plan(spec_from_plan(res.plan), names)
    assert spec_from_plan(res.plan).per_expert
    # block-wide units (no per-expert rows): one scheme a block, as before
    whole = auto_plan(names, sens, kl_budget=0.05, target="h100", candidates=["W4A16", "FP8_DYNAMIC"],
                      layer_shapes=shapes, unit_layers=unit_layers, per_expert=False)
    assert not whole.per_expert
    assert len({whole.plan[n] for n in names if n.startswith(BLOCK0 + ".")}) == 1
