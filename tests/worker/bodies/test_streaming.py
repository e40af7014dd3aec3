"""Whole or streamed: the calibrate and score bodies run the model block by block when asked (``stream``) or when it
does not fit the worker's budget (QUANTPLAN_MODEL_MEMORY_GIB), store the same results, and refuse what cannot run
streamed with a message that says so; a streamed job's scratch folder does not outlive it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jobs.specs import CalibrateSpec, ScoreSpec
from store import repo
from store.db import session_scope

TOKENS = {"samples": 3, "seq_len": 16, "cal_samples": 2, "cal_seq_len": 16, "batch_size": 2}


def stored_stats(settings, job_id: int) -> dict:
    with session_scope(settings) as s:
        return {r.name: r for r in repo.load_activation_stats(s, job_id)}


def sizes(settings, model_id: int) -> tuple[int, int, int]:
    """(resident bytes, largest block's bytes, all weights) of the registered model, streamed in float32."""
    from quantcore.models.streaming import StreamedModel

    with session_scope(settings) as s:
        rec = repo.get_model(s, model_id)
    probe = StreamedModel(Path(str(settings.artifact_dir)) / rec.path)
    return probe.resident_bytes(), max(probe.block_bytes(i) for i in range(2)), probe.model_bytes()


def test_a_streamed_calibration_stores_what_a_whole_one_does(run_body, tiny_llama, qp_settings):
    whole = run_body("calibrate", CalibrateSpec(samples=3, seq_len=16, batch_size=2, stream=False),
                     model_id=tiny_llama)
    streamed = run_body("calibrate", CalibrateSpec(samples=3, seq_len=16, batch_size=2, stream=True),
                        model_id=tiny_llama)
    assert whole.status == streamed.status == "succeeded", (whole.error, streamed.error)
    assert (whole.result["mode"], streamed.result["mode"]) == ("whole model", "streamed")
    assert streamed.result["kv_amax"] == whole.result["kv_amax"] and streamed.result["top"] == whole.result["top"]
    a, b = stored_stats(qp_settings, whole.id), stored_stats(qp_settings, streamed.id)
    assert list(a) == list(b) and len(a) == 15
    for name in a:
        assert np.array_equal(np.asarray(a[name].channel_max), np.asarray(b[name].channel_max)), name
        assert np.array_equal(a[name].hist_counts, b[name].hist_counts) and a[name].token_max == b[name].token_max, name


def test_a_model_larger_than_the_budget_streams_and_one_block_too_large_fails(run_body, tiny_llama, qp_settings,
                                                                              monkeypatch):
    resident, block, weights = sizes(qp_settings, tiny_llama)
    monkeypatch.setattr(qp_settings, "model_memory_gib", (resident + block + 4096) / 2**30)
    assert resident + block + 4096 < weights  # the whole model does not fit, one block does
    job = run_body("calibrate", CalibrateSpec(samples=2, seq_len=16), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    assert job.result["mode"] == "streamed"
    monkeypatch.setattr(qp_settings, "model_memory_gib", (resident + block - 1) / 2**30)
    failed = run_body("calibrate", CalibrateSpec(samples=2, seq_len=16), model_id=tiny_llama)
    assert failed.status == "failed"
    assert "block 0 (model.layers.0) needs" in failed.error and "more than the budget of" in failed.error
    assert stored_stats(qp_settings, failed.id) == {}
    assert not qp_settings.job_scratch_dir(failed.id).exists()


def test_a_streamed_score_equals_the_whole_one(run_body, tiny_llama, qp_settings):
    """The streamed job computes the reference (kept in the cache); the whole-model jobs read it: the unquantized
    plan scores exactly 0 either way, and a quantized plan the same KL, top-1 and perplexity."""
    identity = run_body("score", ScoreSpec(scheme="BF16", stream=True, **TOKENS), model_id=tiny_llama)
    assert identity.status == "succeeded", identity.error
    assert identity.result["kl_mean"] == 0.0 and identity.result["top1_agree"] == 1.0
    again = run_body("score", ScoreSpec(scheme="BF16", stream=False, **TOKENS), model_id=tiny_llama)
    assert again.result["kl_mean"] == 0.0  # the whole model on the streamed reference: the same logits
    for scheme in ("FP8_DYNAMIC", "FP8"):  # dynamic scales; static ones from a calibration job
        if scheme == "FP8":  # and a calibrated KV cache, its K/V maxima calibrated streamed then read from the cache
            streamed_kv = run_body("score", ScoreSpec(scheme=scheme, kv_cache="FP8", stream=True, **TOKENS),
                                   model_id=tiny_llama)
            whole_kv = run_body("score", ScoreSpec(scheme=scheme, kv_cache="FP8", stream=False, **TOKENS),
                                model_id=tiny_llama)
            assert streamed_kv.status == whole_kv.status == "succeeded", (streamed_kv.error, whole_kv.error)
            assert streamed_kv.result["kv_amax_cached"] is False and whole_kv.result["kv_amax_cached"] is True
            assert streamed_kv.result["kl_mean"] == whole_kv.result["kl_mean"] > 0
        streamed = run_body("score", ScoreSpec(scheme=scheme, stream=True, **TOKENS), model_id=tiny_llama)
        whole = run_body("score", ScoreSpec(scheme=scheme, stream=False, **TOKENS), model_id=tiny_llama)
        assert streamed.status == whole.status == "succeeded", (streamed.error, whole.error)
        keys = ("kl_mean", "kl_p99", "kl_max", "top1_agree", "ppl", "ppl_ref", "tokens")
        assert {k: streamed.result[k] for k in keys} == {k: whole.result[k] for k in keys}
        assert streamed.result["kl_mean"] > 0


def test_what_runs_whole_model_only_is_refused_streamed_before_anything_runs(run_body, tiny_llama, qp_settings):
    job = run_body("score", ScoreSpec(scheme="W4A16_GPTQ", stream=True, rollouts=2, **TOKENS), model_id=tiny_llama)
    assert job.status == "failed"
    assert "rollouts run whole-model only" in job.error and "--no-stream" in job.error
    with session_scope(qp_settings) as s:
        assert repo.list_scores(s, tiny_llama) == []


def test_the_sweep_removes_scratch_folders_of_jobs_no_longer_running(run_body, tiny_llama, qp_settings):
    from worker.runner import sweep_scratch

    done = run_body("calibrate", CalibrateSpec(samples=2, seq_len=16), model_id=tiny_llama)
    with session_scope(qp_settings) as s:
        running = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None, model_id=tiny_llama)
        repo.mark_running(s, running.id, worker_host="here", device="cpu", torch_version="x")
    left, live = qp_settings.job_scratch_dir(done.id), qp_settings.job_scratch_dir(running.id)
    for folder in (left, live):
        folder.mkdir(parents=True)
        (folder / "block0.bin").write_bytes(b"\0" * 64)
    assert sweep_scratch(qp_settings) == [left]
    assert not left.exists() and live.exists()
