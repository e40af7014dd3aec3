"""The score body: KL of a plan against the unquantized model, with what the plan needs computed (or read) first."""

from __future__ import annotations

from jobs.specs import ScoreSpec
from store import repo
from store.db import session_scope

TOKENS = {"samples": 2, "seq_len": 16, "cal_samples": 2, "cal_seq_len": 16}


def test_a_preset_is_scored_and_its_report_stored(run_body, tiny_llama, qp_settings):
    job = run_body("score", ScoreSpec(scheme="FP8_DYNAMIC", **TOKENS), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    r = job.result
    assert r["plan"] == "FP8_DYNAMIC" and r["kl_mean"] > 0 and 0 <= r["top1_agree"] <= 1 and r["tokens"] > 0
    assert r["calibration_job"] is None and "calibration_tokens" not in r  # a dynamic scheme reads no calibration
    assert job.message.startswith("FP8_DYNAMIC: KL ")
    with session_scope(qp_settings) as s:
        (score,) = repo.list_scores(s, tiny_llama)
    assert score.plan_label == "FP8_DYNAMIC" and score.job_id == job.id


def test_the_unquantized_plan_scores_exactly_zero(run_body, tiny_llama):
    job = run_body("score", ScoreSpec(scheme="BF16", **TOKENS), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    assert job.result["kl_mean"] == 0.0 and job.result["top1_agree"] == 1.0


def test_a_static_scheme_calibrates_first_on_the_jobs_calibration_tokens(run_body, tiny_llama, qp_settings):
    job = run_body("score", ScoreSpec(scheme="FP8", **TOKENS), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    with session_scope(qp_settings) as s:
        cal = repo.get_job(s, job.result["calibration_job"])
    assert cal.kind == "calibrate" and cal.status == "succeeded" and cal.queue == "local"
    assert cal.params == {"samples": 2, "seq_len": 16, "device": "cpu"}
    again = run_body("score", ScoreSpec(scheme="FP8", **TOKENS), model_id=tiny_llama)
    assert again.result["calibration_job"] == cal.id  # the newest calibration is read, not made again


def test_a_kv_cache_format_of_the_job_replaces_the_plans_and_names_itself_in_the_label(run_body, tiny_llama):
    job = run_body("score", ScoreSpec(scheme="FP8_DYNAMIC", kv_cache="FP8", **TOKENS), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    assert job.result["plan"] == "FP8_DYNAMIC + KV FP8" and job.result["kv_cache"] == "FP8"
    assert job.result["kv_calibration_text"].startswith("builtin:") and job.result["kv_amax_cached"] is False
    again = run_body("score", ScoreSpec(scheme="FP8_DYNAMIC", kv_cache="FP8", **TOKENS), model_id=tiny_llama)
    assert again.result["kv_amax_cached"] is True and "(from the cache: KV maxima)" in again.message


def test_gptq_roundings_are_kept_and_read_by_the_next_score(run_body, tiny_llama):
    first = run_body("score", ScoreSpec(scheme="W4A16_GPTQ", **TOKENS), model_id=tiny_llama)
    assert first.status == "succeeded", first.error
    assert first.result["gptq"] == {"layers": 15, "from_cache": 0}
    assert first.result["calibration_tokens"] == [2, 16]
    again = run_body("score", ScoreSpec(scheme="W4A16_GPTQ", **TOKENS), model_id=tiny_llama)
    assert again.result["gptq"]["from_cache"] == 15 and again.result["kl_mean"] == first.result["kl_mean"]


def test_a_stored_plan_is_scored_under_its_version_label(run_body, tiny_llama, qp_settings):
    with session_scope(qp_settings) as s:
        plan = repo.save_plan(s, model_id=tiny_llama, name="mine", body={"default": "W8A16"}, user="t")
    job = run_body("score", ScoreSpec(predicted_kl=0.01, **TOKENS), model_id=tiny_llama, plan_id=plan.id)
    assert job.status == "succeeded", job.error
    assert job.result["plan"] == "mine v1"
    with session_scope(qp_settings) as s:
        (score,) = repo.list_scores(s, tiny_llama)
    assert score.predicted_kl == 0.01


def test_a_score_of_nothing_fails_saying_what_it_needs(run_body, tiny_llama):
    job = run_body("score", ScoreSpec(**TOKENS), model_id=tiny_llama)
    assert job.status == "failed" and job.error == "a score job needs a scheme, a plan or a stored plan id"


def test_gpus_the_model_cannot_be_split_over_are_refused_with_vllms_reason(run_body, tiny_llama):
    job = run_body("score", ScoreSpec(scheme="FP8_DYNAMIC", tensor_parallel=3, **TOKENS), model_id=tiny_llama)
    assert job.status == "failed" and "4 attention heads" in job.error


def test_a_nameless_plan_of_rules_is_not_labelled_as_its_default_preset() -> None:
    from quantcore.planning.plans import PlanSpec, Rule
    from worker.bodies.score import base_label

    spec = PlanSpec(default="FP8_DYNAMIC", rules=[Rule(match="mlp", scheme="INT8_W8A8")])
    assert base_label(None, spec) == "FP8_DYNAMIC + 1 rule(s) / override(s)"
    assert base_label(None, PlanSpec(default="W8A16")) == "W8A16"
    assert base_label("auto v1", spec) == "auto v1"
