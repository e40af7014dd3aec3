"""The SmoothQuant mappings a recipe can carry (quantcore.models.mappings)."""

from __future__ import annotations

from quantcore.models.mappings import smoothquant_unexportable, smoothquant_unmapped

B = "model.layers.3"


def test_smoothquant_a_recipe_cannot_carry_is_o_proj_and_lm_head():
    assert smoothquant_unmapped(f"{B}.self_attn.o_proj") and smoothquant_unmapped("lm_head")
    assert not smoothquant_unmapped(f"{B}.self_attn.q_proj") and not smoothquant_unmapped(f"{B}.mlp.down_proj")
    plan = {f"{B}.self_attn.o_proj": "INT8_W8A8_SQ", f"{B}.mlp.down_proj": "INT8_W8A8_SQ", "lm_head": "BF16"}
    assert smoothquant_unexportable(plan) == [f"{B}.self_attn.o_proj"]
