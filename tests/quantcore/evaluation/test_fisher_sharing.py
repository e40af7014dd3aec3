"""What the Fisher estimate shares to cost fewer passes (issue 43) changes none of its figures: the weights two schemes
round alike are rounded once (``apply_plan(rounded=...)``), a fusion group's input is fake-quantized once a scheme,
and the products are summed a block of rows at a time; every estimate is bit-identical to computing each on its own."""

from __future__ import annotations

import itertools

import pytest
import torch

import quantcore.evaluation.fisher as fisher
from quantcore.algorithms.apply import apply_plan
from quantcore.errors import PlanError
from quantcore.evaluation.fisher import fisher_sensitivity
from quantcore.evaluation.reference import compute_reference

SCHEMES = ("INT8_PER_TENSOR", "INT8_W8A8", "FP8_DYNAMIC", "W4A16", "MXFP4")


def _rows(result):
    return {s: [(r.layer, r.kl_mean, r.kl_mean_err, r.sqnr_db) for r in rows] for s, rows in result.items()}


def test_shared_rounding_inputs_and_row_blocks_leave_every_estimate_bit_identical(tiny_model_factory, monkeypatch):
    model = tiny_model_factory("llama", seed=2)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(7))
    ref = compute_reference(model, ids, batch_size=2)
    shared = _rows(fisher_sensitivity(model, SCHEMES, ids, ref, samples=2, batch_size=2))
    alone = _rows(fisher_sensitivity(model, ["INT8_W8A8"], ids, ref, samples=2, batch_size=2))
    assert alone["INT8_W8A8"] == shared["INT8_W8A8"]  # its weights rounded on its own, not taken from INT8_PER_TENSOR

    fresh = itertools.count()
    monkeypatch.setattr(fisher, "_tensor_key", lambda x: (next(fresh),))  # no two members share a quantized input
    monkeypatch.setattr(fisher, "ROW_DOT_ELEMENTS", 64)  # every product summed in blocks of rows
    assert _rows(fisher_sensitivity(model, SCHEMES, ids, ref, samples=2, batch_size=2)) == shared


def test_fusion_group_members_take_one_quantized_input(tiny_model_factory, monkeypatch):
    """q/k/v and gate/up read one tensor: under a scheme with activations it is fake-quantized once for them."""
    model = tiny_model_factory("llama", seed=2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(7))
    ref = compute_reference(model, ids)
    calls = []
    quantized_input = fisher._Member.quantized_input
    monkeypatch.setattr(fisher._Member, "quantized_input",
                        lambda self, module, x: calls.append(module) or quantized_input(self, module, x))
    rows = fisher_sensitivity(model, ["INT8_W8A8"], ids, ref, samples=1)["INT8_W8A8"]
    linears = [n for r in rows for n in r.layers]
    blocks = sum(1 for n in linears if n.endswith(".q_proj"))
    # per block: q/k/v once, o once, gate/up once, down once; the head once
    assert len(calls) == 4 * blocks + (len(linears) - 7 * blocks)


def test_pre_rounded_weights_are_taken_as_they_are(tiny_model_factory):
    model = tiny_model_factory("llama", seed=3)
    name = "model.layers.0.mlp.down_proj"
    layer = model.get_submodule(name)
    original = layer.weight
    with torch.no_grad():
        first = apply_plan(model, {name: "INT8_PER_TENSOR"})
        rounded = layer.weight.detach()
        first.restore()
        second = apply_plan(model, {name: "INT8_W8A8"}, rounded={name: rounded})
        assert layer.weight.detach().data_ptr() == rounded.data_ptr()  # not copied, not rounded again
        second.restore()
    assert layer.weight is original
    with pytest.raises(PlanError, match="pre-rounded weight is"):
        apply_plan(model, {name: "INT8_W8A8"}, rounded={name: rounded[:, :4]})
    with pytest.raises(PlanError, match="beside the originals"):
        apply_plan(model, {name: "INT8_W8A8"}, rounded={name: rounded}, keep_originals=False)
    assert layer.weight is original and not layer._forward_pre_hooks
