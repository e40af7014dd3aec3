"""A plan applied without keeping the original weights (a score job's last use of its model): the rounded weights go
over the originals in their own memory, a block of rows at a time where the scales allow, with figures bit-equal to
a plan that keeps them; the model then refuses to serve as a reference or take another plan."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import quantcore.algorithms.apply as apply_mod
from quantcore.algorithms.apply import apply_plan, check_intact, round_rows_in_place, rows_independent
from quantcore.algorithms.inputs import PlanInputs
from quantcore.errors import PlanError
from quantcore.evaluation.batches import embedding_rows, tied_head
from quantcore.evaluation.reference import compute_reference
from quantcore.evaluation.scoring import score_plan
from quantcore.evaluation.sensitivity import linear_layer_names
from quantcore.formats.weights import fake_quantize_weight
from quantcore.schemes.presets import get_scheme
from tests.factories import TINY_VOCAB, build_tiny_model

# per channel (FP8, INT8), per group (INT4, MXFP4: rows independent) and two that round the whole weight
# (per-tensor FP8 with a fused group's shared scale; NVFP4 with its tensor-wide scale)
SCHEMES = ["FP8_DYNAMIC", "INT8_W8A8", "W4A16", "MXFP4", "FP8_PER_TENSOR", "NVFP4"]


def tied_gemma(seed: int = 0) -> Gemma3ForCausalLM:
    """A 2-layer Gemma 3 whose lm_head is its input embedding, as gemma-3-270m's is."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                           sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                           tie_word_embeddings=True)
    model = Gemma3ForCausalLM(cfg).eval()
    model.requires_grad_(False)
    return model


def _ids(vocab: int, seqs: int = 3, length: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (seqs, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "INT8_W8A8", "W4A16", "MXFP4", "W4A16_ASYM"])
def test_rows_rounded_a_block_at_a_time_equal_the_whole_weight_rounded(scheme, monkeypatch):
    spec = get_scheme(scheme).weight_spec()
    assert rows_independent(spec)
    monkeypatch.setattr(apply_mod, "ROW_BLOCK_ELEMENTS", 3 * 256)  # 3 rows a block: 40 rows end in a partial block
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    w[7, 3] = 4.0  # an outlier row: its own scale, whichever block it falls in
    whole, rep = fake_quantize_weight(w, spec, report=True)
    in_place = w.clone()
    ptr = in_place.data_ptr()
    got = round_rows_in_place(in_place, spec, report=True)
    assert torch.equal(in_place, whole) and in_place.data_ptr() == ptr
    assert (got.n_elements, got.n_nonzero, got.n_saturated, got.n_underflow, got.n_nan) == \
        (rep.n_elements, rep.n_nonzero, rep.n_saturated, rep.n_underflow, rep.n_nan)
    assert got.scale is not None and torch.equal(got.scale, rep.scale)


def test_tensor_wide_scales_are_not_rounded_by_rows_unless_given():
    assert not rows_independent(get_scheme("FP8_PER_TENSOR").weight_spec())
    nvfp4 = get_scheme("NVFP4").weight_spec()
    assert not rows_independent(nvfp4)  # its fp32 tensor scale spans every row
    assert rows_independent(nvfp4, tensor_scale=True)  # once it is computed, its block scales are per row


def test_nvfp4_rows_on_the_whole_weights_tensor_scale_equal_the_whole_weight_rounded(monkeypatch):
    spec = get_scheme("NVFP4").weight_spec()
    monkeypatch.setattr(apply_mod, "ROW_BLOCK_ELEMENTS", 5 * 64)
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(2)) * 0.02
    w[30, 5] = -3.0  # the tensor's amax, in a late block: every earlier block must use it too
    whole, rep = fake_quantize_weight(w, spec, report=True)
    in_place = w.clone()
    got = round_rows_in_place(in_place, spec, tensor_scale=apply_mod.own_tensor_scale(in_place, spec))
    assert torch.equal(in_place, whole) and got.n_saturated == rep.n_saturated


@pytest.mark.parametrize("scheme", SCHEMES)
def test_rounding_in_place_gives_the_same_logits_and_keeps_no_copy(scheme, monkeypatch):
    monkeypatch.setattr(apply_mod, "ROW_BLOCK_ELEMENTS", 4 * 64)  # several blocks even on a tiny model
    ids = _ids(TINY_VOCAB)
    kept_model = build_tiny_model("llama")
    plan = dict.fromkeys(linear_layer_names(kept_model), scheme)
    inputs = PlanInputs(act_amax=dict.fromkeys(plan, 4.0))  # NVFP4's static activation scales: any, the same twice
    with torch.no_grad():
        applied = apply_plan(kept_model, plan, inputs)
        want = kept_model(ids).logits
        applied.restore()
    model = build_tiny_model("llama")
    params = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    applied = apply_plan(model, plan, inputs, keep_originals=False)
    after = dict(model.named_parameters())
    for name, (p, ptr) in params.items():  # every weight rounded where it lay: no second copy of any
        assert after[name] is p and p.data_ptr() == ptr
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    applied.restore()  # only the hooks go
    with pytest.raises(PlanError, match="rounded in place"):
        apply_plan(model, plan, inputs)
    with pytest.raises(PlanError, match="load the model again"):
        compute_reference(model, ids)
    check_intact(kept_model)  # restored exactly: still a reference


def test_the_tied_embedding_reads_only_the_evaluation_rows_bit_for_bit():
    model = tied_gemma()
    assert tied_head(model) and not tied_head(build_tiny_model("llama"))
    ids = _ids(512)
    with torch.no_grad():
        want = model(ids).logits
        table = model.get_input_embeddings().weight
        with embedding_rows(model, ids):
            assert model.get_input_embeddings().weight.shape[0] == torch.unique(ids).numel()
            assert torch.equal(model(ids).logits, want)
            outside = int(torch.isin(torch.arange(512), ids, invert=True).nonzero()[0])
            with pytest.raises(PlanError, match="outside the evaluation"):
                model(torch.tensor([[outside]]))
        assert model.get_input_embeddings().weight is table and tied_head(model)  # tied again


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "NVFP4"])
def test_a_score_that_keeps_no_originals_equals_one_that_does_under_a_tied_head(scheme):
    ids = _ids(512, seqs=4, length=20)
    model = tied_gemma()
    plan = dict.fromkeys(linear_layer_names(model), scheme)  # lm_head, the embedding's own weight, quantized too
    assert "lm_head" in plan
    ref = compute_reference(model, ids, batch_size=2)
    amax = None
    if scheme == "NVFP4":  # static activation scales: any calibrated maxima, the same for both scores
        amax = {n: 4.0 for n in plan}
    kept = score_plan(model, plan, ids, ref, inputs=PlanInputs(act_amax=amax))
    lean = score_plan(model, plan, ids, ref, inputs=PlanInputs(act_amax=amax), keep_originals=False)
    assert kept.kl_mean > 0
    assert (lean.kl_mean, lean.kl_p99, lean.top1_agree, lean.ppl) == (kept.kl_mean, kept.kl_p99, kept.top1_agree,
                                                                      kept.ppl)
    with pytest.raises(PlanError, match="rounded in place"):
        score_plan(model, plan, ids, ref)
