"""QuIP-style rotation (transforms.rotation.rotations: [V], issue #46): exact in full precision on the tiny
architectures, and written as llm-compressor's QuIPModifier first in the recipe; what QuIPModifier cannot build as
quantplan does is refused, naming the layers."""

from __future__ import annotations

import pytest
import torch

from quantcore.algorithms.rotation import rotation_applied
from quantcore.algorithms.rotation_spec import RotationSpec, rotation_from_dict
from quantcore.errors import PlanError
from quantcore.export.llmcompressor import to_llmcompressor_recipe
from quantcore.export.spinquant import widths_from_linears
from quantcore.safeload import load_yaml
from tests.factories import build_tiny_model, smol_linears

QUIP = RotationSpec(rotations=("V",), block_size=64)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # Gemma too: V folds nothing into a norm
def test_v_rotates_every_decoder_linear_online_and_changes_nothing_in_full_precision(arch):
    model = build_tiny_model(arch)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(ids).logits
        with rotation_applied(model, RotationSpec(rotations=("V",))) as handle:
            assert handle is not None and len(handle.online) == 7 * model.config.num_hidden_layers
            assert "lm_head" not in handle.online
            torch.testing.assert_close(model(ids).logits, ref, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_v_goes_alone():
    with pytest.raises(PlanError, match="V .* goes alone"):
        rotation_from_dict({"kind": "hadamard", "rotations": ["R1", "V"]})
    assert rotation_from_dict({"rotations": ["v"], "block_size": 64}) == QUIP


def _smol():
    linears = smol_linears()
    return [lin["name"] for lin in linears], widths_from_linears(linears, 64)


def _uniform(scheme: str) -> dict[str, str]:
    return {lin["name"]: "BF16" if lin["name"] == "lm_head" else scheme for lin in smol_linears()}


def test_a_quip_rotation_is_written_as_quipmodifier_first():
    names, widths = _smol()
    text = to_llmcompressor_recipe(_uniform("MXFP4"), layer_names=names, rotation=QUIP, rotation_widths=widths)
    stage = load_yaml(text, "recipe", PlanError)["quant_stage"]
    assert list(stage)[0] == "rotation_modifiers"
    assert stage["rotation_modifiers"] == {"QuIPModifier": {"rotations": ["v"], "transform_type": "hadamard",
                                                            "ignore": "lm_head", "transform_block_size": 64}}
    assert "QuIPModifier rotates first" in text


def test_what_quipmodifier_cannot_build_is_refused_naming_the_layers():
    names, widths = _smol()
    with pytest.raises(PlanError) as err:  # no block size: 576 and 1536 are not powers of two
        to_llmcompressor_recipe(_uniform("MXFP4"), layer_names=names, rotation=RotationSpec(rotations=("V",)),
                                rotation_widths=widths)
    message = str(err.value)
    assert "over width 576" in message and "over width 1536" in message and "(e.g. 64)" in message
    assert "down_proj" in message and "q_proj" in message
    with pytest.raises(PlanError, match="SmoothQuant on .*V rotates every decoder linear's input online"):
        plan = {n: "INT8_W8A8" if n.endswith("o_proj") else s for n, s in _uniform("INT8_W8A8_SQ").items()}
        to_llmcompressor_recipe(plan, layer_names=names, rotation=QUIP, rotation_widths=widths)
    extra = [*smol_linears(), {"name": "model.router", "in_features": 576, "out_features": 8}]
    with pytest.raises(PlanError, match=r"1 Linear layer\(s\) outside the decoder blocks \('model.router'\)"):
        to_llmcompressor_recipe({**_uniform("MXFP4"), "model.router": "BF16"}, layer_names=[*names, "model.router"],
                                rotation=QUIP, rotation_widths=widths_from_linears(extra, 64))
