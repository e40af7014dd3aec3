"""quantcore.algorithms.smoothquant: the reference's worked example, exact folding on three architectures, restore."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from quantcore.algorithms.smoothquant import _gain_style, smooth_model, smoothing_factors
from quantcore.errors import PlanError
from quantcore.models.architectures import LLAMA_STYLE
from tests.factories import linear_input_channel_max as channel_max


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}  # fp32 tolerance: folds are exact up to rounding (seen: <= 2e-6)

BLOCK_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def block_linears(model):
    return [f"model.layers.{i}.{leaf}" for i in range(len(model.model.layers)) for leaf in BLOCK_LINEARS]


# ------------------------------------------------------------------ factors


def test_worked_example_three_channels():
    # fp8-fp4-smoothquant.txt, "Worked example": alpha 0.5, X max (1.3, 0.9, 58), W max (0.42, 0.55, 0.020)
    s = smoothing_factors(torch.tensor([1.3, 0.9, 58.0]), torch.tensor([0.42, 0.55, 0.020]), 0.5)
    assert [round(v, 3) for v in s.tolist()[:2]] == [1.759, 1.279]
    assert round(s[2].item(), 2) == 53.85
    # "after scaling both steps are about 0.154" (4-bit levels, 7)
    act_after = torch.tensor([1.3, 0.9, 58.0]) / s
    w_after = torch.tensor([0.42, 0.55, 0.020]) * s
    assert act_after.max().item() / 7 == pytest.approx(0.154, abs=5e-4)
    assert w_after.max().item() / 7 == pytest.approx(0.154, abs=5e-4)


def test_factors_balance_maxima_and_limits():
    a, w = torch.tensor([4.0, 100.0, 0.0]), torch.tensor([1.0, 0.01, 2.0])
    s = smoothing_factors(a, w, 0.5)
    assert torch.allclose(a[:2] / s[:2], w[:2] * s[:2])  # equal ranges at alpha 0.5
    assert torch.allclose(smoothing_factors(a, w, 1.0), a.clamp(min=1e-5))  # all difficulty to the weights
    assert torch.allclose(smoothing_factors(a, w, 0.0), 1 / w.clamp(min=1e-5))
    assert torch.isfinite(s).all() and (s > 0).all()  # dead channel clamped, not 0
    assert smoothing_factors(np.array([1.0]), np.array([1.0]), 0.5).dtype == torch.float32


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.ones(3), torch.ones(3), 1.5), r"\[0, 1\]"),
        ((torch.ones(3), torch.ones(4), 0.5), "one length"),
        ((torch.ones(3), -torch.ones(3), 0.5), ">= 0"),
        ((torch.tensor([1.0, float("nan")]), torch.ones(2), 0.5), "finite"),
    ],
)
def test_factor_validation(args, match):
    with pytest.raises(ValueError, match=match):
        smoothing_factors(*args)


# ------------------------------------------------------------------ exact folding


def test_gain_styles_are_detected(tiny_llama, tiny_qwen2, tiny_gemma3):
    assert _gain_style(tiny_llama.model.layers[0].input_layernorm) == "mul"
    assert _gain_style(tiny_qwen2.model.layers[0].post_attention_layernorm) == "mul"
    assert _gain_style(tiny_gemma3.model.layers[0].pre_feedforward_layernorm) == "one_plus"
    assert _gain_style(nn.LayerNorm(8)) == "layernorm"
    assert _gain_style(nn.Linear(4, 4)) is None


@pytest.mark.parametrize("alpha", [0.5, 0.85])
def test_folding_leaves_logits_unchanged(tiny_model, tiny_input_ids, alpha):
    model = tiny_model
    ref = logits(model, tiny_input_ids)
    before = snapshot(model)
    cmax = channel_max(model, tiny_input_ids)
    handle = smooth_model(model, {n: cmax[n] for n in block_linears(model)}, alpha)

    assert handle.skipped == {}
    assert set(handle.factors) == set(block_linears(model))
    assert torch.allclose(logits(model, tiny_input_ids), ref, **FP32_TOL)
    # the fold did real work: the planted outlier channel got a large factor, weights changed
    q0 = "model.layers.0.self_attn.q_proj"
    assert handle.factors[q0].max() / handle.factors[q0].median() > 3
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("input_layernorm" in k for k in changed) and any("down_proj" in k for k in changed)

    handle.restore()
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)  # bit-exact restore
    assert torch.equal(logits(model, tiny_input_ids), ref)


def test_rows_divided_by_names_the_linears_an_o_proj_or_down_proj_fold_changes(tiny_model, tiny_input_ids):
    # quantcore.algorithms.gptq.rounding_inputs keys a kept GPTQ rounding by the folds that reach a layer's rows: they
    # must be exactly the linears, besides the smoothed ones, whose weights smoothing o_proj and down_proj changes
    model = tiny_model
    before = snapshot(model)
    cmax = channel_max(model, tiny_input_ids)
    smoothed = [n for n in block_linears(model) if n.endswith(("o_proj", "down_proj"))]
    handle = smooth_model(model, {n: cmax[n] for n in smoothed}, 0.5)
    assert handle.skipped == {}
    changed = {k.rsplit(".", 1)[0] for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    reached = {n for n in block_linears(model) if LLAMA_STYLE.rows_divided_by(n) in smoothed}
    assert reached and changed - set(smoothed) == reached
    assert {LLAMA_STYLE.rows_divided_by(n) for n in reached} == set(smoothed)
    handle.restore()
    rows_divided_by = LLAMA_STYLE.rows_divided_by
    assert rows_divided_by("model.layers.3.mlp.experts.7.up_proj") == "model.layers.3.mlp.experts.7.down_proj"
    assert LLAMA_STYLE.rows_divided_by("model.layers.3.self_attn.q_proj") is None
    assert LLAMA_STYLE.rows_divided_by("model.layers.3.mlp.experts.7.gate_proj") is None


def test_smoothed_inputs_have_balanced_maxima(tiny_llama, tiny_input_ids):
    # SmoothQuant's defining property at alpha 0.5: max|X_j / s_j| == max|W_j * s_j| per channel
    cmax = channel_max(tiny_llama, tiny_input_ids)
    name = "model.layers.1.mlp.down_proj"
    handle = smooth_model(tiny_llama, {name: cmax[name]}, 0.5)
    after = channel_max(tiny_llama, tiny_input_ids)[name]
    wmax = tiny_llama.get_submodule(name).weight.abs().amax(0)
    assert torch.allclose(after, wmax, rtol=1e-4)
    assert handle.folded_into[name] == "model.layers.1.mlp.up_proj"


def test_gqa_o_proj_factors_are_tied_across_heads(tiny_llama, tiny_input_ids):
    cmax = channel_max(tiny_llama, tiny_input_ids)
    name = "model.layers.0.self_attn.o_proj"
    ref = logits(tiny_llama, tiny_input_ids)
    handle = smooth_model(tiny_llama, {name: cmax[name]}, 0.5)
    s = handle.factors[name].view(2, 2, 16)  # (kv heads, query heads per kv head, head_dim)
    assert torch.equal(s[:, 0], s[:, 1])
    assert not torch.equal(s[0], s[1])
    assert torch.allclose(logits(tiny_llama, tiny_input_ids), ref, **FP32_TOL)


def test_one_member_smooths_the_whole_fused_group(tiny_qwen2, tiny_input_ids):
    cmax = channel_max(tiny_qwen2, tiny_input_ids)
    ref = logits(tiny_qwen2, tiny_input_ids)
    handle = smooth_model(tiny_qwen2, cmax, 0.5, layers=["model.layers.0.self_attn.k_proj"])
    assert set(handle.factors) == {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"}
    assert torch.allclose(logits(tiny_qwen2, tiny_input_ids), ref, **FP32_TOL)


def test_layers_without_foldable_predecessor_are_skipped_with_reason(tiny_llama, tiny_input_ids):
    cmax = channel_max(tiny_llama, tiny_input_ids)
    handle = smooth_model(tiny_llama, {"lm_head": cmax["lm_head"]}, 0.5)
    assert "lm_head" in handle.skipped and "no foldable predecessor" in handle.skipped["lm_head"]
    assert handle.factors == {}


def test_bf16_model_folds_within_bf16_tolerance(tiny_model_factory, tiny_input_ids):
    model = tiny_model_factory("gemma3", dtype=torch.bfloat16)
    ref = logits(model, tiny_input_ids).float()
    cmax = channel_max(model, tiny_input_ids)
    before = snapshot(model)
    handle = smooth_model(model, {n: cmax[n] for n in block_linears(model)}, 0.5)
    assert torch.allclose(logits(model, tiny_input_ids).float(), ref, atol=0.05)
    handle.restore()
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)


def test_errors(tiny_llama, tiny_input_ids):
    cmax = channel_max(tiny_llama, tiny_input_ids)
    with pytest.raises(PlanError, match="not nn.Linear"):
        smooth_model(tiny_llama, cmax, 0.5, layers=["model.layers.0.input_layernorm", "nope"])
    with pytest.raises(ValueError, match="share one alpha"):
        q, k = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
        smooth_model(tiny_llama, cmax, {q: 0.5, k: 0.6}, layers=[q, k])
    with pytest.raises(ValueError, match="input channels"):
        smooth_model(tiny_llama, {"model.layers.0.mlp.down_proj": torch.ones(5)}, 0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        smooth_model(tiny_llama, cmax, 2.0)


def test_numpy_maxima_accepted(tiny_llama, tiny_input_ids):
    cmax = {k: v.numpy() for k, v in channel_max(tiny_llama, tiny_input_ids).items()}
    handle = smooth_model(tiny_llama, cmax, 0.5, layers=["model.layers.0.mlp.gate_proj"])
    assert set(handle.factors) == {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}


@pytest.mark.gpu
def test_folding_on_cuda(tiny_model_factory, tiny_input_ids):
    model = tiny_model_factory("llama").cuda()
    ids = tiny_input_ids.cuda()
    ref = logits(model, ids)
    cmax = channel_max(model, ids)
    handle = smooth_model(model, {n: cmax[n] for n in block_linears(model)}, 0.5)
    assert torch.allclose(logits(model, ids), ref, rtol=1e-3, atol=1e-3)
    handle.restore()
    assert torch.equal(logits(model, ids), ref)
