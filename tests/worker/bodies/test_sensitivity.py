"""The sensitivity body: one unit (or one attention layer's K and V) quantized at a time, most sensitive first."""

from __future__ import annotations

import pytest

from jobs.errors import InvalidJob
from jobs.specs import SensitivitySpec
from store import repo
from store.db import session_scope

TOKENS = {"samples": 2, "seq_len": 16, "cal_samples": 2, "cal_seq_len": 16}


def test_a_preset_is_swept_one_fusion_group_at_a_time(run_body, tiny_llama, qp_settings):
    job = run_body("sensitivity", SensitivitySpec(scheme="W8A16", **TOKENS), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    # per block: q/k/v together, o_proj, gate/up together, down_proj; and lm_head
    assert job.result["scheme"] == "W8A16" and job.result["units"] == 2 * 4 + 1
    assert job.result["tokens"] == [2, 16] and "tensor_parallel" not in job.result
    assert job.message == "W8A16: 9 units swept"
    with session_scope(qp_settings) as s:
        rows = repo.list_sensitivity(s, job.id)
    assert len(rows) == 9 and rows[0].kl_mean == max(r.kl_mean for r in rows)


def test_without_groups_each_layer_is_its_own_unit(run_body, tiny_llama):
    job = run_body("sensitivity", SensitivitySpec(scheme="W8A16", groups=False, **TOKENS), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    assert job.result["units"] == 15


def test_a_kv_cache_format_is_swept_one_attention_layer_at_a_time(run_body, tiny_llama):
    job = run_body("sensitivity", SensitivitySpec(kv_sweep="FP8", **TOKENS), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    assert job.result["scheme"] == repo.KV_SWEEP_PREFIX + "FP8" and job.result["units"] == 2
    assert job.result["calibration_tokens"] == [2, 16]  # FP8's K / V scales are calibrated


def test_a_scheme_whose_scales_are_the_same_on_any_gpus_is_swept_on_one(run_body, tiny_llama):
    job = run_body("sensitivity", SensitivitySpec(scheme="W8A16", tensor_parallel=2, **TOKENS), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    assert "tensor_parallel" not in job.result
    assert job.message.endswith("swept on one GPU (its scales are the same on any number)")


def test_a_dynamic_scheme_is_swept_on_the_gpus_asked_for(run_body, tiny_llama):
    job = run_body("sensitivity", SensitivitySpec(scheme="FP8_DYNAMIC", tensor_parallel=2, **TOKENS),
                   model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    assert (job.result["tensor_parallel"], job.result["expert_parallel"]) == (2, False)


def test_a_smoothquant_sweep_leaves_out_the_layers_no_recipe_can_smooth(run_body, tiny_llama):
    job = run_body("sensitivity", SensitivitySpec(scheme="INT8_W8A8_SQ", **TOKENS), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    assert job.result["not_swept"] == ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj",
                                       "lm_head"]
    assert "not swept: 3 layer(s) no llm-compressor recipe can smooth" in job.message


def test_a_sweep_of_nothing_is_refused_before_it_is_queued(run_body, tiny_llama):
    with pytest.raises(InvalidJob, match="scheme.*kv_sweep"):
        run_body("sensitivity", {"samples": 2}, model_id=tiny_llama)


def test_a_smoothquant_sweep_of_a_model_with_no_smoothable_layer_is_refused_clearly() -> None:
    from quantcore.errors import PlanError
    from quantcore.schemes.presets import get_scheme
    from worker.bodies.sensitivity import sweepable

    names = ["encoder.layer.0.attention.self.query", "encoder.layer.0.output.dense"]
    assert sweepable(names, get_scheme("INT8_W8A8")) == (names, [])
    with pytest.raises(PlanError, match="sweep a scheme without SmoothQuant, e.g. INT8_W8A8"):
        sweepable(names, get_scheme("INT8_W8A8_SQ"))
