"""The registry of rounding methods and transforms (quantcore.algorithms.registry): every scheme's rounding has one
handler, apply_plan rounds through it, and a plan's calibration needs come from what the methods registered."""

from __future__ import annotations

import pytest
import torch

import quantcore.algorithms.apply  # noqa: F401 - registers RTN, GPTQ and AWQ
from quantcore.algorithms import registry
from quantcore.algorithms.apply import quantized_model
from quantcore.algorithms.registry import (
    RoundingMethod,
    calibration_needs,
    register_rounding_handler,
    register_transform,
    rounding_method,
)
from quantcore.schemes.presets import get_scheme, list_schemes
from quantcore.schemes.specs import Rounding

LAYER = "model.layers.0.mlp.down_proj"


def test_every_rounding_has_a_handler_and_every_preset_finds_its_own():
    assert {rounding_method(r).rounding for r in Rounding} == set(Rounding)
    for name in list_schemes():
        scheme = get_scheme(name)
        assert rounding_method(scheme).rounding is scheme.rounding
    assert get_scheme("W4A16_GPTQ").rounding is Rounding.GPTQ and get_scheme("W4A16_AWQ").rounding is Rounding.AWQ
    assert get_scheme("W4A16").rounding is Rounding.RTN


def test_a_rounding_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="already registered"):
        register_rounding_handler(Rounding.GPTQ)(lambda layer: layer.weight)
    with pytest.raises(ValueError, match="already registered"):
        register_transform("smoothquant", applies_to=lambda s: False, needs="act_channel_max")


def test_a_plan_needs_the_calibration_its_methods_and_transforms_read():
    schemes = [get_scheme(n) for n in ("INT8_W8A8_SQ_GPTQ", "W4A16_AWQ", "FP8_DYNAMIC", "BF16")]
    assert calibration_needs(schemes) == {
        "weight_hessians": ["gptq"], "act_channel_max": ["smoothquant"], "awq": ["awq"]}
    assert calibration_needs([get_scheme("FP8_DYNAMIC"), get_scheme("BF16")]) == {}


def test_apply_plan_rounds_weights_through_the_registered_handler(tiny_llama, monkeypatch):
    seen = []

    def zeros(layer):
        seen.append((layer.name, layer.nearest is not None))
        return torch.zeros_like(layer.weight)

    monkeypatch.setitem(registry._ROUNDINGS, Rounding.RTN, RoundingMethod(Rounding.RTN, zeros))
    module = tiny_llama.get_submodule(LAYER)
    with quantized_model(tiny_llama, {LAYER: "W8A16"}):
        assert not bool(module.weight.any())
    assert seen == [(LAYER, True)] and bool(module.weight.any())
