"""Rotations on a block-streamed model (quantcore.algorithms.rotation on a quantcore.models.streaming.StreamedModel):
the resident part rotated once, each decoder block as it loads by the whole model's own per-block folds, and every
rotated result (calibration, score, KV cache calibration, GPTQ rounding, sensitivity sweep) bit-identical on a CPU to
the whole rotated model's; the streamed model is left as it was, and what cannot be rotated is refused alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantcore.algorithms.inputs import PlanInputs
from quantcore.algorithms.rotation import rotate_model, rotation_applied
from quantcore.algorithms.rotation_spec import RotationSpec
from quantcore.errors import PlanError
from quantcore.evaluation.calibrate import calibrate
from quantcore.evaluation.reference import compute_reference
from quantcore.evaluation.scoring import calibrate_kv_cache, score_plan
from quantcore.evaluation.streamed import calibrate_kv_cache_streamed, calibrate_streamed, score_streamed
from quantcore.models.loading import load_model
from quantcore.models.streaming import StreamedModel
from tests.quantcore.evaluation.test_streamed import assert_same_stats, eval_ids, save

BATCH = 2
SPINQUANT = RotationSpec()  # R1 + R2 + R4
SPECS = [SPINQUANT, RotationSpec("random-hadamard", block_size=16, seed=5), RotationSpec(rotations=("V",))]


def resident_state(streamed: StreamedModel) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in streamed.model.state_dict().items() if v.device.type != "meta"}


def assert_left_as_it_was(streamed: StreamedModel, before: dict[str, torch.Tensor]) -> None:
    after = resident_state(streamed)
    assert list(after) == list(before) and all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.device.type == "meta" for b in streamed.stack.blocks for p in b.parameters())  # every block freed
    assert all(not m._forward_pre_hooks for m in streamed.model.modules())  # R4's online hooks gone
    assert streamed._transform is None and not streamed._entered


@pytest.mark.parametrize(("arch", "spec"), [("llama", SPECS[0]), ("llama", SPECS[1]), ("qwen2", SPECS[0]),
                                            ("qwen2", SPECS[2])], ids=lambda x: getattr(x, "label", lambda: x)())
def test_a_rotated_streamed_calibration_is_the_whole_rotated_one(tmp_path, arch, spec):
    folder = save(tmp_path / arch, arch)
    whole, _ = load_model(folder)
    ids = eval_ids()
    with rotation_applied(whole, spec):
        expected = calibrate(whole, ids, batch_size=BATCH)
    streamed = StreamedModel(folder)
    before = resident_state(streamed)
    with rotation_applied(streamed.model, spec) as handle:
        assert handle is not None
        got = calibrate_streamed(streamed, ids, batch_size=BATCH)
        with rotation_applied(whole, spec) as whole_handle:  # the same layers listed, before any block ran
            assert whole_handle is not None
            assert sorted(handle.online) == sorted(whole_handle.online)
            assert sorted(handle.folded_norms) == sorted(whole_handle.folded_norms)
    assert_same_stats(expected, got)
    plain = calibrate_streamed(streamed, ids, batch_size=BATCH)  # the rotation really reached the blocks
    name = "model.layers.1.mlp.down_proj"
    assert not np.array_equal(plain[name].channel_max, got[name].channel_max)
    assert_left_as_it_was(streamed, before)


@pytest.mark.parametrize(("scheme", "kv"), [("INT8_W8A8_SQ", "FP8"), ("W4A16_GPTQ", None)])
def test_a_rotated_streamed_score_is_the_whole_rotated_one(tmp_path, scheme, kv):
    """A rotated plan with SmoothQuant (down_proj left unsmoothed under R4, said in the notes) and a calibrated FP8
    KV cache, and a GPTQ plan rounded block by block in the rotated blocks: every number of the report is the
    same streamed and whole."""
    from quantcore.algorithms.gptq import collect_hessians
    from quantcore.algorithms.streamed_rounding import round_gptq_streamed
    from quantcore.evaluation.streamed import rotated_plan

    folder = save(tmp_path / "m", "llama")
    whole, _ = load_model(folder)
    ids, cal = eval_ids(), eval_ids(4, 16, seed=9)
    with rotation_applied(whole, SPINQUANT):
        stats = calibrate(whole, cal, batch_size=BATCH)
    plan = dict.fromkeys(stats, scheme)
    inputs = PlanInputs(act_amax={s.name: s.amax for s in stats.values()},
                        act_channel_max={s.name: s.channel_max for s in stats.values()}, rotation=SPINQUANT)
    streamed = StreamedModel(folder)
    before = resident_state(streamed)
    whole_inputs = streamed_inputs = inputs
    if scheme.endswith("GPTQ"):
        with rotation_applied(whole, SPINQUANT):
            hessians = collect_hessians(whole, list(plan), cal, batch_size=4)
        whole_inputs = inputs.replace(weight_hessians=hessians, gptq_cache={})
        cache: dict[str, torch.Tensor] = {}
        with rotation_applied(streamed.model, SPINQUANT):
            round_gptq_streamed(streamed, rotated_plan(streamed.model, plan, SPINQUANT), cal, cache=cache,
                                inputs=inputs.replace(rotation=None), batch_size=4)
        streamed_inputs = inputs.replace(gptq_cache=cache)
    if kv:
        expected_amax = calibrate_kv_cache(whole, plan, cal, inputs=inputs, batch_size=BATCH)
        amax = calibrate_kv_cache_streamed(streamed, plan, cal, inputs=inputs, batch_size=BATCH)
        assert amax.to_dict() == expected_amax.to_dict() and amax.to_dict()["k"]
        whole_inputs = whole_inputs.replace(kv_amax=expected_amax)
        streamed_inputs = streamed_inputs.replace(kv_amax=amax)
    ref = compute_reference(whole, ids, batch_size=BATCH)
    expected = score_plan(whole, plan, ids, ref, inputs=whole_inputs, kv_cache=kv).to_dict()
    got = score_streamed(streamed, plan, ids, ref, inputs=streamed_inputs, kv_cache=kv).to_dict()
    if scheme.endswith("_SQ"):
        assert any("SmoothQuant not applied (R4 rotates their input online" in n for n in got["notes"])
        assert set(got.pop("notes")) == set(expected.pop("notes"))  # SQ notes may come in another order
    assert got == expected and expected["kl_mean"] > 0
    unrotated = score_streamed(streamed, plan, ids, ref, inputs=streamed_inputs.replace(rotation=None),
                               kv_cache=kv)
    assert unrotated.kl_mean != got["kl_mean"]  # the rotation reached the quantized blocks
    assert_left_as_it_was(streamed, before)
    assert score_streamed(streamed, {}, ids, ref, inputs=PlanInputs(rotation=SPINQUANT)).kl_mean < 1e-6


def test_a_rotated_streamed_sweep_is_the_whole_rotated_one(tmp_path):
    from quantcore.evaluation.sensitivity import sensitivity_sweep
    from quantcore.evaluation.streamed_sweep import streamed_sensitivity_sweep

    folder = save(tmp_path / "m", "llama")
    whole, _ = load_model(folder)
    ids = eval_ids()
    ref = compute_reference(whole, ids, batch_size=BATCH)
    inputs = PlanInputs(rotation=SPINQUANT)
    expected = [r.to_dict() for r in sensitivity_sweep(whole, "INT8_PER_TENSOR", ids, ref, inputs=inputs)]
    streamed = StreamedModel(folder)
    before = resident_state(streamed)
    got = [r.to_dict() for r in streamed_sensitivity_sweep(streamed, "INT8_PER_TENSOR", ids, ref, inputs=inputs)]
    assert got == expected and len(got) == 9  # q/k/v, o, gate/up, down in 2 blocks, and the head
    plain = [r.to_dict() for r in streamed_sensitivity_sweep(streamed, "INT8_PER_TENSOR", ids, ref)]
    assert {r["layer"]: r["kl_mean"] for r in plain} != {r["layer"]: r["kl_mean"] for r in got}
    assert_left_as_it_was(streamed, before)
    with pytest.raises(PlanError, match="cannot be swept with SmoothQuant"):  # down_proj under R4, as whole
        streamed_sensitivity_sweep(streamed, "INT8_W8A8_SQ", ids, ref, layers=["model.layers.0.mlp.down_proj"],
                                   inputs=inputs.replace(act_channel_max={}))
    assert_left_as_it_was(streamed, before)


def test_a_rotated_streamed_gptq_sweep_is_the_whole_rotated_one(tmp_path):
    """The whole sweep's Hessians from the rotated model; streamed, the swept layers rounded in the rotated blocks
    first: the same roundings, the same rows."""
    from quantcore.algorithms.gptq import collect_hessians
    from quantcore.evaluation.sensitivity import linear_layer_names, sensitivity_sweep
    from quantcore.evaluation.streamed_sweep import streamed_sensitivity_sweep

    folder = save(tmp_path / "m", "llama")
    whole, _ = load_model(folder)
    ids = eval_ids(3)
    ref = compute_reference(whole, ids, batch_size=BATCH)
    inputs = PlanInputs(rotation=SPINQUANT)
    streamed = StreamedModel(folder)
    before = resident_state(streamed)
    cal = eval_ids(4, 16, seed=9)
    with rotation_applied(whole, SPINQUANT):
        hessians = collect_hessians(whole, linear_layer_names(whole), cal, batch_size=4)
    whole_cache: dict[str, torch.Tensor] = {}
    expected = [r.to_dict() for r in sensitivity_sweep(
        whole, "W4A16_GPTQ", ids, ref, inputs=inputs.replace(weight_hessians=hessians, gptq_cache=whole_cache))]
    cache: dict[str, torch.Tensor] = {}
    got = [r.to_dict() for r in streamed_sensitivity_sweep(streamed, "W4A16_GPTQ", ids, ref, calibration_ids=cal,
                                                           inputs=inputs.replace(gptq_cache=cache))]
    assert got == expected and sorted(cache) == sorted(whole_cache) and len(cache) == 15
    assert all(torch.equal(cache[n], whole_cache[n]) for n in cache)
    assert_left_as_it_was(streamed, before)


def test_what_cannot_be_rotated_streamed_is_refused_and_nothing_changes(tmp_path):
    from quantcore.algorithms import rotation
    from quantcore.models import streaming

    assert rotation.TRANSFORM_BLOCKS == streaming.TRANSFORM_BLOCKS  # one hook, named in both (no import cycle)
    gemma = StreamedModel(save(tmp_path / "g", "gemma3"))
    before = resident_state(gemma)
    with pytest.raises(PlanError, match="post_attention_layernorm"):  # Gemma 3's post-branch norms, as whole
        rotate_model(gemma.model, SPINQUANT)
    assert_left_as_it_was(gemma, before)
    streamed = StreamedModel(save(tmp_path / "m", "llama"))
    before = resident_state(streamed)
    with rotation_applied(streamed.model, SPINQUANT), pytest.raises(PlanError, match="one rotation at a time"):
        rotate_model(streamed.model, SPINQUANT)
    streamed.load_block(0)
    with pytest.raises(PlanError, match="block 0 of the streamed model is loaded"):
        rotate_model(streamed.model, SPINQUANT)
    streamed.free_block(0)
    assert_left_as_it_was(streamed, before)


@pytest.mark.slow
def test_smollm2_rotated_streamed_equals_whole():
    """The demo model (tied embeddings, 30 blocks, hidden 576 = 36 x 16): the rotated calibration and a rotated
    static INT8 score, streamed and whole, bit for bit on a CPU."""
    from quantcore.evaluation.text import default_eval_text, load_documents, token_batches
    from quantcore.models.intake import converted_gguf_folder, demo_gguf_path
    from quantcore.models.validation import default_cache_dir

    folder = converted_gguf_folder(demo_gguf_path(), cache_dir=default_cache_dir())
    whole, tok = load_model(folder)
    ids = token_batches(tok, load_documents(default_eval_text()), n_samples=4, seq_len=64)
    streamed = StreamedModel(folder)
    with rotation_applied(whole, SPINQUANT):
        expected = calibrate(whole, ids, batch_size=BATCH)
    with rotation_applied(streamed.model, SPINQUANT):
        got = calibrate_streamed(streamed, ids, batch_size=BATCH)
    assert_same_stats(expected, got)
    ref = compute_reference(whole, ids, batch_size=BATCH)
    plan = dict.fromkeys(expected, "INT8_PER_TENSOR")
    inputs = PlanInputs(act_amax={s.name: s.amax for s in expected.values()}, rotation=SPINQUANT)
    assert score_streamed(streamed, plan, ids, ref, inputs=inputs).to_dict() == \
        score_plan(whole, plan, ids, ref, inputs=inputs).to_dict()
    assert streamed.model.config.tie_word_embeddings  # tied again once the rotation is undone
