"""Hadamard rotations (quantcore.algorithms.hadamard, rotation, rotation_spec): the matrices are Hadamard, the folded
model computes the same logits as the original on the tiny Llama / Qwen2 / Gemma3 models, restore() is bit-exact, the
rotation really spreads an outlier channel, and a plan's rotation goes through plan_applied before its schemes."""

from __future__ import annotations

import pytest
import torch

from quantcore.algorithms.hadamard import hadamard_factors, hadamard_matrix, has_hadamard, rotation_matrix
from quantcore.algorithms.inputs import PlanInputs
from quantcore.algorithms.registry import calibration_needs, registered
from quantcore.algorithms.rotation import rotate_model, rotation_applied, rotation_widths
from quantcore.algorithms.rotation_spec import RotationSpec, rotation_from_dict, transforms_from_dict
from quantcore.errors import PlanError
from quantcore.evaluation.scoring import plan_applied
from quantcore.schemes.presets import get_scheme
from tests.factories import DOWN_OUTLIER_CHANNEL, OUTLIER_CHANNEL, TINY_ARCHS, build_tiny_model

LOGIT_ATOL = 1e-5  # float32 logits of ~1 after folding float64 rotations rounded once to float32


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 28, 36, 40, 44, 64, 96, 576, 1536, 144 * 4])
def test_hadamard_matrices_are_hadamard(n):
    h = hadamard_matrix(n)
    assert h.shape == (n, n) and bool((h.abs() == 1).all())
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


def test_orders_nothing_builds_are_refused_with_the_fix():
    assert hadamard_factors(576) == (36, 16) and hadamard_factors(1536) == (12, 128)
    assert not has_hadamard(6) and not has_hadamard(13 * 64)
    with pytest.raises(ValueError, match="block size"):
        hadamard_matrix(13 * 64)


def test_block_and_randomised_rotations_are_orthogonal_and_seeded():
    q = rotation_matrix(576, block_size=64, seed=3)
    assert torch.allclose(q @ q.T, torch.eye(576, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, rotation_matrix(576, block_size=64, seed=3))
    assert not torch.equal(q, rotation_matrix(576, block_size=64, seed=4))
    assert torch.count_nonzero(q[:64, 64:]) == 0  # block-diagonal
    with pytest.raises(ValueError, match="does not divide"):
        rotation_matrix(576, block_size=100)


SPECS = [RotationSpec(), RotationSpec(rotations=("R2", "R4")), RotationSpec("random-hadamard", block_size=16, seed=5),
         RotationSpec(rotations=("R1",), block_size=32)]


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_a_rotated_model_gives_the_same_logits_and_restores_bit_for_bit(arch, spec):
    model = build_tiny_model(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = _ids()
    ref = model(ids).logits
    if arch == "gemma3" and "R1" in spec.rotations:  # post-branch norms: refused, naming them, nothing changed
        with pytest.raises(PlanError, match="post_attention_layernorm"):
            rotate_model(model, spec)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        return
    with rotation_applied(model, spec) as handle:
        assert handle is not None
        out = model(ids).logits
        if "R1" in spec.rotations:  # it really changed the weights, and the outlier is gone from the stream
            assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight,
                                   before["model.layers.0.self_attn.q_proj.weight"])
        assert len(handle.online) == ("R4" in spec.rotations) * len(model.model.layers)
    torch.testing.assert_close(out, ref, atol=LOGIT_ATOL, rtol=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_tied_embeddings_are_untied_while_rotated_and_tied_again():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)  # the head gets this gain, the embedding must not
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = _ids(1)
    ref = model(ids).logits
    with rotation_applied(model, RotationSpec()):
        assert model.lm_head.weight is not model.model.embed_tokens.weight
        torch.testing.assert_close(model(ids).logits, ref, atol=LOGIT_ATOL, rtol=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.tie_word_embeddings


def test_rotation_spreads_the_planted_outliers():
    """The tiny model's planted outlier channels (a norm gain of 20 before q/k/v; an up_proj row x30 before down_proj)
    dominate the input's max; rotated, the max over channels is within a few times the median."""
    model = build_tiny_model("llama")
    ids = _ids()
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        return lambda mod, args: seen.__setitem__(name, args[0].detach().abs().flatten(0, -2).amax(0))

    layers = {"q": model.model.layers[1].self_attn.q_proj, "down": model.model.layers[1].mlp.down_proj}
    ratio = {}
    for label, spec in (("plain", None), ("rotated", RotationSpec())):
        with rotation_applied(model, spec):
            hooks = [m.register_forward_pre_hook(keep(k)) for k, m in layers.items()]  # after R4's: sees its output
            model(ids)
            for h in hooks:
                h.remove()
        ratio[label] = {k: float(v.max() / v.median()) for k, v in seen.items()}
        if spec is None:
            assert int(seen["q"].argmax()) == OUTLIER_CHANNEL and int(seen["down"].argmax()) == DOWN_OUTLIER_CHANNEL
    for k in layers:
        assert ratio["rotated"][k] < ratio["plain"][k] / 3, ratio


def test_widths_a_rotation_cannot_cover_are_refused_naming_the_layers():
    model = build_tiny_model("llama")
    widths = rotation_widths(model)
    assert (widths.hidden, widths.head_dim, widths.intermediate) == (64, 16, 128)
    with pytest.raises(PlanError, match=r"R1 on .*model\.embed_tokens.*block size 48 does not divide 64"):
        rotate_model(model, RotationSpec(rotations=("R1",), block_size=48))
    from transformers import LlamaConfig, LlamaForCausalLM

    odd = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=104, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2))  # 104 = 8 x 13
    with pytest.raises(PlanError, match=r"R4 on 1 layer\(s\) \('model\.layers\.0\.mlp\.down_proj'\), width 104: no "
                                        "Hadamard matrix of order 104.*block_size to a power of two"):
        rotate_model(odd, RotationSpec(rotations=("R4",)))
    rotate_model(odd, RotationSpec(rotations=("R4",), block_size=8)).restore()  # a block size that divides it does


def test_the_plan_section_is_validated_and_round_trips():
    spec = rotation_from_dict({"kind": "random-hadamard", "rotations": ["r4", "R1"], "block_size": 64})
    assert spec == RotationSpec("random-hadamard", ("R1", "R4"), 64, 0)
    assert rotation_from_dict(spec.to_dict()) == spec
    assert transforms_from_dict(None) is None and transforms_from_dict({}) is None
    with pytest.raises(PlanError) as err:
        rotation_from_dict({"kind": "givens", "rotations": ["R3", "R3"], "block_size": True, "seed": 2**64,
                            "extra": 1})
    for needle in ("unknown key(s) 'extra'", "'kind' must be one of", "R3, inside attention", "'block_size'",
                   "'seed' must be an integer"):
        assert needle in str(err.value)
    with pytest.raises(PlanError, match="'seed' is for kind random-hadamard"):
        rotation_from_dict({"kind": "hadamard", "seed": 1})
    with pytest.raises(PlanError, match="names one rotation twice"):
        rotation_from_dict({"rotations": ["R1", "r1"]})


def test_the_rotation_is_a_registered_plan_level_transform_that_reads_no_calibration():
    import quantcore.algorithms.apply  # noqa: F401 - registers RTN, GPTQ, AWQ
    assert "rotation" in registered()["transforms"]
    assert calibration_needs([get_scheme("MXFP4")]) == {}


def test_a_plan_with_a_rotation_is_rotated_before_it_is_quantized():
    """plan_applied with PlanInputs.rotation: an identity plan scores the original logits; MXFP4 activations score
    closer to the original rotated than not (the planted outliers are spread before the 4-bit quantizer); a
    SmoothQuant alpha on an R4 down_proj is dropped with a note; the model is restored bit for bit."""
    model = build_tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    ids = _ids()
    ref = torch.log_softmax(model(ids).logits, -1)
    rotated = PlanInputs(rotation=RotationSpec())

    def kl(plan, inputs):
        with plan_applied(model, plan, inputs) as ctx:
            logq = torch.log_softmax(model(ids).logits, -1)
        return float((ref.exp() * (ref - logq)).sum(-1).mean()), ctx.notes

    assert kl(dict.fromkeys(names, "BF16"), rotated)[0] < 1e-9
    plain, _ = kl(dict.fromkeys(names, "INT8_PER_TENSOR"), PlanInputs())
    spun, _ = kl(dict.fromkeys(names, "INT8_PER_TENSOR"), rotated)
    assert spun < plain / 2, (plain, spun)
    down = "model.layers.0.mlp.down_proj"
    _, notes = kl({down: "INT8_W8A8_SQ"}, rotated.replace(act_channel_max={down: torch.ones(128)}))
    assert any("R4 rotates their input online" in n for n in notes)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
