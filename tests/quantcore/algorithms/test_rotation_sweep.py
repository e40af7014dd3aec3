"""Sensitivity under a plan's rotation (issue #46): the exact sweep and the Fisher estimate quantize every unit in
the model rotated once, which must give what a score of that unit alone, rotated, gives; SmoothQuant is refused where
R4 rotates down_proj's input online."""

from __future__ import annotations

import pytest
import torch

from quantcore.algorithms.inputs import PlanInputs
from quantcore.algorithms.rotation import rotation_applied
from quantcore.algorithms.rotation_spec import RotationSpec
from quantcore.errors import PlanError
from quantcore.evaluation.fisher import fisher_sensitivity
from quantcore.evaluation.reference import compute_reference
from quantcore.evaluation.scoring import score_plan
from quantcore.evaluation.sensitivity import sensitivity_sweep
from tests.factories import build_tiny_model, linear_input_channel_max

ROTATION = RotationSpec()  # hadamard R1 + R2 + R4
UNITS = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"]


def _setup():
    model = build_tiny_model("llama")
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    return model, ids, compute_reference(model, ids, batch_size=4)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_rotated_sweep_is_each_unit_scored_rotated():
    model, ids, ref = _setup()
    before = _state(model)
    inputs = PlanInputs(rotation=ROTATION)
    rows = {r.layer: r.kl_mean for r in sensitivity_sweep(model, "MXFP4", ids, ref, layers=UNITS, inputs=inputs)}
    plain = {r.layer: r.kl_mean for r in sensitivity_sweep(model, "MXFP4", ids, ref, layers=UNITS)}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any(m._forward_pre_hooks for m in model.modules())  # R4's online hook gone
    for unit in UNITS:
        alone = score_plan(model, {unit: "MXFP4"}, ids, ref, inputs=inputs).kl_mean
        # the sweep's KL and a score's differ by ~2 % unrotated too (the score's batches and position buckets);
        # the rotation moves both by 40 % and more here
        assert rows[unit] == pytest.approx(alone, rel=0.03), unit
        assert abs(rows[unit] / plain[unit] - 1) > 0.3, unit  # the rotation reached the sweep


def test_the_fisher_estimate_quantizes_each_unit_in_the_rotated_model():
    model, ids, ref = _setup()
    before = _state(model)
    with rotation_applied(model, ROTATION):  # statistics of the rotated model, as a rotated sweep calibrates
        cm = linear_input_channel_max(model, ids[:2])
    inputs = PlanInputs(act_amax={k: float(v.max()) for k, v in cm.items()}, act_channel_max=cm, rotation=ROTATION)
    est = {r.layer: r for r in fisher_sensitivity(model, ["INT8_PER_TENSOR"], ids, ref, inputs=inputs, samples=2,
                                                   passes=1)["INT8_PER_TENSOR"]}
    exact = sensitivity_sweep(model, "INT8_PER_TENSOR", ids, ref, inputs=inputs)
    unrotated = {r.layer: r for r in fisher_sensitivity(model, ["INT8_PER_TENSOR"], ids, ref, samples=2,
                                                         passes=1)["INT8_PER_TENSOR"]}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    for row in exact:  # the local SQNR is exact in both: the same quantized unit, rotated
        assert est[row.layer].sqnr_db == pytest.approx(row.sqnr_db, abs=0.05), row.layer
    assert any(abs(est[u].sqnr_db - unrotated[u].sqnr_db) > 0.5 for u in est)


def test_smoothquant_under_r4_is_refused_naming_the_down_projs():
    model, ids, ref = _setup()
    before = _state(model)
    cm = linear_input_channel_max(model, ids[:2])
    inputs = PlanInputs(act_amax={k: float(v.max()) for k, v in cm.items()}, act_channel_max=cm, rotation=ROTATION)
    with pytest.raises(PlanError, match=r"down_proj.*cannot be swept with SmoothQuant under hadamard R1\+R2\+R4"):
        sensitivity_sweep(model, "INT8_W8A8_SQ", ids, ref, inputs=inputs)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    rows = sensitivity_sweep(model, "INT8_W8A8_SQ", ids, ref, layers=["model.layers.0.self_attn.q_proj"],
                             inputs=PlanInputs(act_amax=inputs.act_amax, act_channel_max=cm,
                                               rotation=RotationSpec(rotations=("R1", "R2"))))
    assert len(rows) == 1  # without R4 nothing is online: q/k/v smoothed in the rotated model
