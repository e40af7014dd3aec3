"""A streamed score job with GPTQ or AWQ (worker.bodies.streamed_rounding): the same report as the whole-model job,
its GPTQ roundings kept on disk in the job's scratch folder, which is gone when the job ends."""

from __future__ import annotations

from jobs.specs import ScoreSpec

TOKENS = {"samples": 3, "seq_len": 16, "cal_samples": 2, "cal_seq_len": 16, "batch_size": 2}
KEYS = ("kl_mean", "kl_p99", "kl_max", "top1_agree", "ppl", "ppl_ref", "tokens")


def test_streamed_gptq_and_awq_scores_equal_the_whole_ones(run_body, tiny_llama, qp_settings, monkeypatch):
    monkeypatch.setattr(qp_settings, "cache_max_gib", 1e-9)  # no rounding kept: each job rounds its own GPTQ layers
    streamed = run_body("score", ScoreSpec(scheme="W4A16_GPTQ", stream=True, **TOKENS), model_id=tiny_llama)
    whole = run_body("score", ScoreSpec(scheme="W4A16_GPTQ", stream=False, **TOKENS), model_id=tiny_llama)
    assert streamed.status == whole.status == "succeeded", (streamed.error, whole.error)
    assert streamed.result["gptq"]["from_cache"] == whole.result["gptq"]["from_cache"] == 0
    assert streamed.result["gptq"]["layers"] == 15  # the head too
    assert {k: streamed.result[k] for k in KEYS} == {k: whole.result[k] for k in KEYS}
    assert streamed.result["kl_mean"] > 0
    assert not qp_settings.job_scratch_dir(streamed.id).exists()
    # AWQ: searched streamed (kept in the model's cache), then read by the whole-model job: the same factors fold
    # into the same weights either way
    streamed = run_body("score", ScoreSpec(scheme="W4A16_AWQ", stream=True, **TOKENS), model_id=tiny_llama)
    whole = run_body("score", ScoreSpec(scheme="W4A16_AWQ", stream=False, **TOKENS), model_id=tiny_llama)
    assert streamed.status == whole.status == "succeeded", (streamed.error, whole.error)
    assert streamed.result["awq"] == whole.result["awq"] and streamed.result["awq"]["mappings"] > 0
    assert {k: streamed.result[k] for k in KEYS} == {k: whole.result[k] for k in KEYS}
