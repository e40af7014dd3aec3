"""AWQ (quantcore.algorithms.awq): the schemes it accepts, llm-compressor's candidate grid, the search and its folds."""

from __future__ import annotations

import pytest
import torch

from quantcore.algorithms.awq import awq_mappings, awq_search, candidates, weight_means
from quantcore.algorithms.inputs import PlanInputs
from quantcore.algorithms.smoothquant import fold_factors
from quantcore.errors import PlanError
from quantcore.evaluation.batches import forward_logits
from quantcore.evaluation.reference import compute_reference
from quantcore.evaluation.scoring import plan_applied, score_plan
from quantcore.evaluation.sensitivity import sensitivity_sweep
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import AWQ_N_GRID, Scheme, TensorSpec
from tests.factories import TINY_VOCAB

INT4_G = TensorSpec("int4", "group", dynamic=False, group_size=128)


def linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]


def calibration() -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(weights=INT4_G, activations=TensorSpec("int8", "token")), "weight-only"),
    (dict(weights=INT4_G, activations=None, gptq=True), "AWQ or GPTQ"),
    (dict(weights=TensorSpec("fp8_e4m3", "channel", dynamic=False), activations=None), "integer and NVFP4 weights"),
    (dict(weights=TensorSpec("int8", "tensor", dynamic=False), activations=None), "per row or per group"),
    (dict(weights=None, activations=None), "unquantized"),
])
def test_schemes_awq_cannot_scale_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scheme("X", awq=True, **kwargs)


def test_awq_presets_describe_and_round_trip():
    for name in ("W4A16_AWQ", "W8A16_AWQ"):
        s = get_scheme(name)
        assert s.awq and s.needs_awq and not s.needs_hessians and s.weight_only
        assert s.describe().endswith("AWQ")
        assert Scheme.from_dict(s.to_dict()) == s
        assert s.weights == get_scheme(name.removesuffix("_AWQ")).weights  # the same checkpoint layout
    assert not get_scheme("W4A16").needs_awq


def test_candidates_are_llm_compressors_grid():
    """duo scaling: the unscaled candidate first, then x̄^r / (w̄^(1-r) + 1e-4) for r = 0 … 1, each normalised so
    that max · min = 1; without duo scaling x̄^r for r = 0 … 1."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(64, generator=gen) * 5 + 0.01
    w = torch.rand(64, generator=gen) + 0.05
    grid = candidates(x, w)
    assert len(grid) == AWQ_N_GRID and grid[0][0] == -1.0
    assert torch.allclose(grid[0][1], torch.ones(64))
    assert [r for r, _ in grid[1:]] == [i / (AWQ_N_GRID - 2) for i in range(AWQ_N_GRID - 1)]
    for r, s in grid[1:]:
        raw = (x.pow(r) / (w.pow(1 - r) + 1e-4)).clamp(min=1e-4)
        torch.testing.assert_close(s, raw / (raw.max() * raw.min()).sqrt())
        assert float(s.max() * s.min()) == pytest.approx(1.0, rel=1e-5)
    plain = candidates(x, w, n_grid=5, duo_scaling=False)
    assert [r for r, _ in plain] == [0.0, 0.25, 0.5, 0.75, 1.0]
    with pytest.raises(ValueError, match="n_grid"):
        candidates(x, w, n_grid=1)


def test_weight_means_normalise_each_group_by_its_max():
    w = torch.tensor([[1.0, -2.0, 4.0, 0.0, 3.0], [2.0, 2.0, -1.0, 1.0, 0.0]])
    got = weight_means([w], TensorSpec("int4", "group", dynamic=False, group_size=2))
    # groups along K: [0:2], [2:4], [4:5] (a shorter last group); each |w| divided by its group's max
    rows = torch.tensor([[0.5, 1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(got, rows.mean(0).double(), atol=1e-5, rtol=1e-5)
    per_row = weight_means([w, 2 * w], TensorSpec("int8", "channel", dynamic=False))
    torch.testing.assert_close(per_row, (w.abs() / w.abs().amax(1, keepdim=True)).mean(0).double(), atol=1e-5,
                               rtol=1e-5)


def test_mappings_cover_fusion_groups_and_skip_gqa_o_proj(tiny_llama):
    names = linears(tiny_llama) + ["lm_head"]
    maps, skipped = awq_mappings(tiny_llama, names)
    parents = {m.balance: (m.smooth, m.parent) for m in maps}
    b = "model.layers.0"
    assert parents[(f"{b}.self_attn.q_proj", f"{b}.self_attn.k_proj", f"{b}.self_attn.v_proj")] == (
        f"{b}.input_layernorm", f"{b}.self_attn")
    assert parents[(f"{b}.mlp.gate_proj", f"{b}.mlp.up_proj")] == (f"{b}.post_attention_layernorm", f"{b}.mlp")
    assert parents[(f"{b}.mlp.down_proj",)] == (f"{b}.mlp.up_proj", f"{b}.mlp.down_proj")
    assert "grouped-query" in skipped[f"{b}.self_attn.o_proj"]  # 4 query heads, 2 kv heads
    assert "lm_head" in skipped
    with pytest.raises(PlanError, match="nn.Linear"):
        awq_mappings(tiny_llama, ["model.norm"])


def test_search_cuts_every_mappings_error_and_leaves_the_model_exact(tiny_model):
    """On each tiny architecture (Llama, Qwen2, Gemma3's (1 + w) norms): the best scales never do worse than no
    scaling, at least one mapping gains, and the model comes back bit for bit."""
    model = tiny_model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    found = awq_search(model, dict.fromkeys(linears(model), "W4A16_AWQ"), calibration())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert found.errors and all(best <= first for first, best, _ in found.errors.values())
    assert any(best < 0.95 * first for first, best, _ in found.errors.values())
    assert set(found.factors) == set(linears(model)) - set(found.skipped)


def test_folded_factors_change_nothing_before_rounding(tiny_llama, tiny_input_ids):
    model = tiny_llama
    found = awq_search(model, dict.fromkeys(linears(model), "W4A16_AWQ"), calibration())
    ref = forward_logits(model, tiny_input_ids)
    norm = model.model.layers[0].input_layernorm.weight
    gain = norm.detach().clone()
    handle = fold_factors(model, found.factors)
    try:
        torch.testing.assert_close(forward_logits(model, tiny_input_ids), ref, atol=1e-4, rtol=1e-4)
        s = found.factors["model.layers.0.self_attn.q_proj"]
        torch.testing.assert_close(norm.detach(), (gain / s).float())  # 1/s went into the norm's gain
        assert not torch.allclose(s, torch.ones_like(s))
    finally:
        handle.restore()
    assert torch.equal(forward_logits(model, tiny_input_ids), ref)


@pytest.mark.parametrize("base", ["W4A16", "NVFP4A16"])
def test_awq_scores_lower_kl_than_rounding_to_nearest(tiny_llama, tiny_input_ids, base):
    model = tiny_llama
    names = linears(model)
    ref = compute_reference(model, tiny_input_ids, batch_size=1)
    plan = dict.fromkeys(names, f"{base}_AWQ")
    with pytest.raises(PlanError, match="AWQ"):
        score_plan(model, plan, tiny_input_ids, ref)
    found = awq_search(model, plan, calibration())
    rtn = score_plan(model, dict.fromkeys(names, base), tiny_input_ids, ref)
    awq = score_plan(model, plan, tiny_input_ids, ref, inputs=PlanInputs(awq=found))
    assert awq.kl_mean < 0.9 * rtn.kl_mean
    # GQA: both o_proj rounded unscaled, and said so in one note
    (note,) = [n for n in awq.notes if "AWQ not applied" in n]
    assert note.startswith("AWQ not applied to 2 layer(s) ('model.layers.0.self_attn.o_proj', "
                           "'model.layers.1.self_attn.o_proj'): grouped-query attention")


def test_plan_applied_rounds_the_scaled_weight_and_restores(tiny_llama):
    """A down_proj with AWQ holds Q(W · s) and up_proj's rows are divided by s; restore brings both back."""
    from quantcore.formats.weights import fake_quantize_weight

    model = tiny_llama
    layer, up = "model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj"
    found = awq_search(model, {layer: "W4A16_AWQ"}, calibration())
    s = found.factors[layer]
    w0, u0 = model.get_submodule(layer).weight.clone(), model.get_submodule(up).weight.clone()
    with plan_applied(model, {layer: "W4A16_AWQ"}, inputs=PlanInputs(awq=found)):
        want, _ = fake_quantize_weight((w0 * s).float(), get_scheme("W4A16").weights, report=False)
        torch.testing.assert_close(model.get_submodule(layer).weight, want)
        torch.testing.assert_close(model.get_submodule(up).weight, (u0 / s[:, None]).float())
    assert torch.equal(model.get_submodule(layer).weight, w0) and torch.equal(model.get_submodule(up).weight, u0)


def test_sensitivity_sweep_with_awq(tiny_llama, tiny_input_ids):
    model = tiny_llama
    only = [n for n in linears(model) if ".layers.0." in n]
    ref = compute_reference(model, tiny_input_ids, batch_size=1)
    with pytest.raises(PlanError, match="AWQ"):
        sensitivity_sweep(model, "W4A16_AWQ", tiny_input_ids, ref, layers=only)
    found = awq_search(model, dict.fromkeys(only, "W4A16_AWQ"), calibration())
    rows = sensitivity_sweep(model, "W4A16_AWQ", tiny_input_ids, ref, layers=only, inputs=PlanInputs(awq=found))
    plain = {r.layer: r.kl_mean for r in sensitivity_sweep(model, "W4A16", tiny_input_ids, ref, layers=only)}
    assert {n for r in rows for n in r.layers} == set(only)
    assert sum(r.kl_mean for r in rows) < sum(plain.values())


def test_awq_and_gptq_in_one_plan(tiny_llama, tiny_input_ids):
    """AWQ where it can fold, GPTQ on the o_proj it cannot scale (grouped-query attention): both apply, and the
    model comes back bit for bit."""
    from quantcore.algorithms.gptq import collect_hessians

    model = tiny_llama
    names = linears(model)
    plan = {n: "W4A16_GPTQ" if n.endswith("o_proj") else "W4A16_AWQ" for n in names}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    found = awq_search(model, plan, calibration())
    hess = collect_hessians(model, [n for n in names if n.endswith("o_proj")], calibration())
    ref = compute_reference(model, tiny_input_ids, batch_size=1)
    both = score_plan(model, plan, tiny_input_ids, ref, inputs=PlanInputs(awq=found, weight_hessians=hess))
    awq_only = score_plan(model, dict.fromkeys(names, "W4A16_AWQ"), tiny_input_ids, ref, inputs=PlanInputs(awq=found))
    assert not [n for n in both.notes if "AWQ not applied" in n]  # every AWQ layer was scaled
    assert both.kl_mean != awq_only.kl_mean
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.gpu
def test_cuda_awq_search_matches_cpu():
    """The search on CUDA takes the CPU's candidate for every fold whose best candidate is clear (within 1 % the
    order of two candidates is float noise, on either device), and folds in place on the GPU's weights."""
    from tests.factories import build_tiny_model

    cpu = build_tiny_model("llama")
    gpu = build_tiny_model("llama").cuda()
    plan = dict.fromkeys(linears(cpu), "W4A16_AWQ")
    on_cpu = awq_search(cpu, plan, calibration())
    on_gpu = awq_search(gpu, plan, calibration().cuda())
    assert set(on_gpu.factors) == set(on_cpu.factors)
    assert all(s.device.type == "cuda" for s in on_gpu.factors.values())
    for label, history in on_cpu.history.items():
        losses = sorted(loss for _, loss in history)
        if losses[1] > 1.01 * losses[0]:
            assert on_gpu.errors[label][2] == on_cpu.errors[label][2], label
        assert on_gpu.errors[label][1] == pytest.approx(on_cpu.errors[label][1], rel=0.02)


def test_a_saved_search_reads_back_and_scores_the_same(tiny_llama, tiny_input_ids, tmp_path):
    from quantcore.algorithms.awq import load_awq, save_awq

    model = tiny_llama
    plan = dict.fromkeys(linears(model), "W4A16_AWQ")
    found = awq_search(model, plan, calibration())
    back = load_awq(save_awq(found, tmp_path / "awq" / "x.safetensors"))
    assert back.cached is False and [p.name for p in (tmp_path / "awq").iterdir()] == ["x.safetensors"]
    assert back.skipped == found.skipped and back.errors == found.errors and back.history == found.history
    assert set(back.factors) == set(found.factors)
    assert all(torch.equal(back.factors[n], found.factors[n].cpu()) for n in found.factors)
    ref = compute_reference(model, tiny_input_ids, batch_size=1)
    assert score_plan(model, plan, tiny_input_ids, ref, inputs=PlanInputs(awq=back)).kl_mean == score_plan(
        model, plan, tiny_input_ids, ref, inputs=PlanInputs(awq=found)).kl_mean
