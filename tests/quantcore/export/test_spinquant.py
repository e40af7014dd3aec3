"""A plan's rotation in the llm-compressor recipe (quantcore.export.spinquant): SpinQuantModifier first, with the
plan's block size; what llm-compressor cannot build as quantplan does is refused, naming the layers and the fix."""

from __future__ import annotations

import pytest

from quantcore.algorithms.rotation_spec import RotationSpec
from quantcore.errors import PlanError
from quantcore.export.llmcompressor import to_llmcompressor_recipe
from quantcore.export.spinquant import widths_from_linears
from quantcore.safeload import load_yaml
from tests.factories import smol_linears


def uniform(scheme: str) -> dict[str, str]:
    """``scheme`` on every SmolLM2 linear but lm_head."""
    return {lin["name"]: "BF16" if lin["name"] == "lm_head" else scheme for lin in smol_linears()}


def _smol():
    linears = smol_linears()
    return [lin["name"] for lin in linears], widths_from_linears(linears, 64)


def test_smollm2s_widths_come_from_its_linears():
    _, widths = _smol()
    assert (widths.hidden, widths.head_dim, widths.intermediate) == (576, 64, 1536)
    assert "lm_head" in widths.layers["R1"] and all(n.endswith("down_proj") for n in widths.layers["R4"])


def test_the_rotation_comes_first_with_the_plans_block_size():
    names, widths = _smol()
    text = to_llmcompressor_recipe(uniform("MXFP4"), layer_names=names, rotation=RotationSpec(block_size=64),
                                   rotation_widths=widths)
    stage = load_yaml(text, "recipe", PlanError)["quant_stage"]
    assert list(stage)[0] == "rotation_modifiers"
    assert stage["rotation_modifiers"] == {"SpinQuantModifier": {"rotations": ["R1", "R2", "R4"],
                                                                 "transform_type": "hadamard",
                                                                 "transform_block_size": 64}}
    assert "SpinQuantModifier rotates first" in text


def test_what_llm_compressor_cannot_build_is_refused_with_the_layers_and_the_fix():
    names, widths = _smol()
    with pytest.raises(PlanError) as err:  # 576 = 36 x 16: quantplan builds it, llm-compressor's hadamard does not
        to_llmcompressor_recipe(uniform("MXFP4"), layer_names=names, rotation=RotationSpec(), rotation_widths=widths)
    message = str(err.value)
    blocks = len(widths.layers["R4"])
    assert f"R1 on {7 * blocks + 1} layer(s)" in message and "a power of two that divides 576 (e.g. 64)" in message
    assert f"R4 on {blocks} layer(s)" in message and "divides 1536 (e.g. 512)" in message  # 1536 = 12 x 128
    assert "R2" not in message  # head_dim 64 is a power of two
    with pytest.raises(PlanError, match="draws its random signs from its own generator"):
        to_llmcompressor_recipe(uniform("MXFP4"), layer_names=names, rotation_widths=widths,
                                rotation=RotationSpec("random-hadamard", block_size=64, seed=3))


def test_smoothquant_on_a_down_proj_under_r4_is_refused_as_it_is_not_scored():
    names, widths = _smol()
    plan = {n: "INT8_W8A8" if n.endswith("o_proj") else s for n, s in uniform("INT8_W8A8_SQ").items()}
    with pytest.raises(PlanError, match="R4 rotates their input online"):
        to_llmcompressor_recipe(plan, layer_names=names, rotation=RotationSpec(block_size=64), rotation_widths=widths)
    text = to_llmcompressor_recipe(plan, layer_names=names, rotation_widths=widths,
                                   rotation=RotationSpec(rotations=("R1", "R2"), block_size=64))
    assert text.index("SpinQuantModifier") < text.index("SmoothQuantModifier") < text.index("QuantizationModifier")
