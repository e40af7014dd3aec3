"""The Fisher estimate streamed (quantcore.evaluation.fisher_streamed: block-wise gradient checkpointing) against the
whole-model estimate (quantcore.evaluation.fisher): on a CPU every row (estimate, its error, local SQNR, notes) must be
bit-identical, with the same sampled tokens."""

from __future__ import annotations

import pytest

from quantcore.algorithms.inputs import PlanInputs
from quantcore.algorithms.rotation_spec import RotationSpec
from quantcore.errors import PlanError
from quantcore.evaluation.calibrate import calibrate
from quantcore.evaluation.fisher import fisher_sensitivity
from quantcore.evaluation.fisher_streamed import streamed_fisher_sensitivity
from quantcore.evaluation.reference import compute_reference
from quantcore.models.loading import load_model
from quantcore.models.streaming import StreamedModel
from tests.quantcore.evaluation.test_streamed import BATCH, eval_ids, save


def rows_of(result) -> dict[str, list[dict]]:
    return {k: [r.to_dict() for r in rows] for k, rows in result.items()}


@pytest.mark.parametrize("groups", [True, False])
def test_streamed_estimate_equals_whole(tmp_path, groups):
    """Three schemes at once (static activation scales, dynamic FP8, weight-only W4A16), fusion groups on and off,
    every unit from block 0 to the head, two batches and two passes: the same rows; the blocks back on meta."""
    folder = save(tmp_path / "m", "llama")
    whole, _ = load_model(folder)
    ids = eval_ids(3)  # two batches
    stats = calibrate(whole, ids, batch_size=BATCH)
    inputs = PlanInputs(act_amax={s.name: s.amax for s in stats.values()},
                        act_channel_max={s.name: s.channel_max for s in stats.values()})
    ref = compute_reference(whole, ids, batch_size=BATCH)
    schemes = ["INT8_PER_TENSOR", "FP8_DYNAMIC", "W4A16"]
    expected = rows_of(fisher_sensitivity(whole, schemes, ids, ref, groups=groups, inputs=inputs, seed=4))
    streamed = StreamedModel(folder)
    messages: list[str] = []
    got = rows_of(streamed_fisher_sensitivity(streamed, schemes, ids, ref, groups=groups, inputs=inputs, seed=4,
                                              progress=lambda f, m: messages.append(m)))
    assert got == expected
    assert all(any(r["layer"] == "lm_head" for r in rows) for rows in got.values())
    assert all(r["kl_mean"] > 0 for rows in got.values() for r in rows)
    assert any("backward: block 1/2" in m for m in messages)
    assert all(p.device.type == "meta" for b in streamed.stack.blocks for p in b.parameters())
    for name, m in streamed.model.named_modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, f"hook left on {name}"


def test_streamed_estimate_in_scratch_files_and_refusals(tmp_path):
    """A budget with room for no state beside one block: the states in scratch files, the rows unchanged, the folder
    empty afterwards; GPTQ without calibration tokens, no scheme and a rotation per scheme are refused."""
    folder = save(tmp_path / "m", "llama")
    whole, _ = load_model(folder)
    ids = eval_ids(3)
    ref = compute_reference(whole, ids, batch_size=BATCH)
    part = ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj", "lm_head"]
    expected = rows_of(fisher_sensitivity(whole, ["FP8_DYNAMIC"], ids, ref, layers=part))
    probe = StreamedModel(folder)
    scratch = tmp_path / "scratch"
    tight = StreamedModel(folder, budget=probe.resident_bytes() + probe.block_bytes(0) + 1024, scratch=scratch)
    files: list[int] = []
    got = rows_of(streamed_fisher_sensitivity(
        tight, ["FP8_DYNAMIC"], ids, ref, layers=part,
        progress=lambda f, m: files.append(sum(1 for d in scratch.iterdir() for _ in d.iterdir()))))
    assert got == expected and len(got["FP8_DYNAMIC"]) == 3
    assert max(files) >= 3  # the kept block inputs and gradients were files
    assert not any(scratch.iterdir())
    with pytest.raises(PlanError, match="calibration_ids"):
        streamed_fisher_sensitivity(probe, ["W4A16_GPTQ"], ids, ref, layers=part)
    with pytest.raises(PlanError, match="at least one scheme"):
        streamed_fisher_sensitivity(probe, [], ids, ref)
    with pytest.raises(PlanError, match="not one per scheme"):
        streamed_fisher_sensitivity(probe, ["FP8_DYNAMIC"], ids, ref,
                                    inputs={"FP8_DYNAMIC": PlanInputs(rotation=RotationSpec())})


def test_streamed_kv_estimate_equals_whole(tmp_path):
    """KV cache formats (FP8 with calibrated scales, FP8_ATTN with its FP8 attention) beside a linear scheme, and one
    format alone on some layers: the whole estimate's rows, two batches and two passes; the model's attention setting
    handed back and no hook left."""
    from quantcore.evaluation.scoring import calibrate_kv_cache

    folder = save(tmp_path / "m", "llama")
    whole, _ = load_model(folder)
    ids = eval_ids(3)
    ref = compute_reference(whole, ids, batch_size=BATCH)
    amax = calibrate_kv_cache(whole, {}, ids[:2])
    formats = ["FP8", "FP8_ATTN"]
    expected = rows_of(fisher_sensitivity(whole, ["FP8_DYNAMIC"], ids, ref, kv_caches=formats, kv_amax=amax, seed=2))
    streamed = StreamedModel(folder)
    attn = streamed.model.config._attn_implementation
    got = rows_of(streamed_fisher_sensitivity(streamed, ["FP8_DYNAMIC"], ids, ref, kv_caches=formats, kv_amax=amax,
                                              seed=2))
    assert sorted(got) == ["FP8_DYNAMIC", "KV FP8", "KV FP8_ATTN"]
    assert got == expected
    assert all(len(got[f"KV {f}"]) == 2 and all(r["kl_mean"] > 0 for r in got[f"KV {f}"]) for f in formats)
    assert streamed.model.config._attn_implementation == attn
    for name, m in streamed.model.named_modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, f"hook left on {name}"
    one = ["model.layers.1.self_attn"]
    alone = rows_of(fisher_sensitivity(whole, [], ids, ref, kv_caches=["FP8"], kv_amax=amax, kv_layers=one,
                                       passes=1))
    got = rows_of(streamed_fisher_sensitivity(streamed, [], ids, ref, kv_caches=["FP8"], kv_amax=amax, kv_layers=one,
                                              passes=1))
    assert got == alone and list(got) == ["KV FP8"] and [r["layer"] for r in got["KV FP8"]] == one


def test_rotated_streamed_estimate_equals_whole(tmp_path):
    """R1 + R2 + R4 (down_proj's input rotated online): the streamed model rotated block by block as it loads, in the
    forward and again in the backward, gives the rows of the whole model rotated once (a KV cache format in the same
    pass), differs from the unrotated estimate, and is handed back unrotated."""
    from tests.quantcore.algorithms.test_rotation_streamed import assert_left_as_it_was, resident_state

    folder = save(tmp_path / "m", "llama")
    whole, _ = load_model(folder)
    ids = eval_ids(3)
    ref = compute_reference(whole, ids, batch_size=BATCH)
    inputs = PlanInputs(rotation=RotationSpec())  # R1 + R2 + R4
    kv = {"kv_caches": ["FP8_E5M2"]}  # no calibrated scale: the same in the rotated model
    expected = rows_of(fisher_sensitivity(whole, ["FP8_DYNAMIC"], ids, ref, inputs=inputs, **kv))
    streamed = StreamedModel(folder)
    before = resident_state(streamed)
    got = rows_of(streamed_fisher_sensitivity(streamed, ["FP8_DYNAMIC"], ids, ref, inputs=inputs, **kv))
    assert got == expected and len(got["FP8_DYNAMIC"]) == 9
    assert_left_as_it_was(streamed, before)
    plain = rows_of(streamed_fisher_sensitivity(streamed, ["FP8_DYNAMIC"], ids, ref, **kv))
    assert {r["layer"]: r["kl_mean"] for r in plain["FP8_DYNAMIC"]} != {
        r["layer"]: r["kl_mean"] for r in got["FP8_DYNAMIC"]}


@pytest.mark.parametrize(("scheme", "groups"), [("W4A16_GPTQ", True), ("NVFP4A16_GPTQ", False)])
def test_streamed_gptq_estimate_equals_whole(tmp_path, scheme, groups):
    """GPTQ rounded block by block on the calibration tokens before the estimate (the streamed sweep's rounding): the
    whole estimate's rows with Hessians from collect_hessians on the whole model, and the same roundings."""
    from quantcore.algorithms.gptq import collect_hessians
    from quantcore.evaluation.sensitivity import linear_layer_names
    from tests.quantcore.evaluation.test_streamed_sweep import cal_ids

    folder = save(tmp_path / "m", "llama")
    whole, _ = load_model(folder)
    ids, cal = eval_ids(3), cal_ids()
    ref = compute_reference(whole, ids, batch_size=BATCH)
    hessians = collect_hessians(whole, linear_layer_names(whole), cal, batch_size=4)
    whole_cache: dict = {}
    expected = rows_of(fisher_sensitivity(whole, [scheme], ids, ref, groups=groups,
                                          inputs=PlanInputs(weight_hessians=hessians, gptq_cache=whole_cache)))
    cache: dict = {}
    got = rows_of(streamed_fisher_sensitivity(StreamedModel(folder), [scheme], ids, ref, groups=groups,
                                              calibration_ids=cal, inputs=PlanInputs(gptq_cache=cache)))
    assert got == expected and all(r["kl_mean"] > 0 for r in got[scheme])
    assert sorted(cache) == sorted(whole_cache) and len(cache) == 15
