"""A streamed sensitivity sweep of a GPTQ or an AWQ scheme (quantcore.evaluation.streamed_sweep with the streamed
score's rounding and search: worker.bodies.streamed_rounding) stores the whole-model sweep's rows; its GPTQ
roundings are kept beside the model, and read again, as the whole-model job's are."""

from __future__ import annotations

from typing import Any

from jobs.specs import SensitivitySpec
from tests.worker.bodies.test_streamed_sweep_body import stored
from tests.worker.bodies.test_streaming import TOKENS


def sweep(run_body, tiny_llama, scheme: str, stream: bool):
    tokens: dict[str, Any] = TOKENS
    job = run_body("sensitivity", SensitivitySpec(scheme=scheme, stream=stream, **tokens), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    assert job.result["mode"] == ("streamed" if stream else "whole model")
    return job


def test_streamed_gptq_sweep_stores_the_whole_rows_and_keeps_its_roundings(run_body, tiny_llama, qp_settings,
                                                                             monkeypatch):
    monkeypatch.setattr(qp_settings, "cache_max_gib", 1e-9)  # nothing kept: each job rounds its own layers
    streamed = sweep(run_body, tiny_llama, "W4A16_GPTQ", True)
    whole = sweep(run_body, tiny_llama, "W4A16_GPTQ", False)
    rows = stored(qp_settings, whole)
    assert stored(qp_settings, streamed) == rows and len(rows) == 9 and all(r["kl_mean"] > 0 for r in rows)
    assert streamed.result["gptq"]["layers"] == whole.result["gptq"]["layers"] == 15  # the head too
    assert streamed.result["gptq"]["from_cache"] == whole.result["gptq"]["from_cache"] == 0
    assert "not kept" in streamed.result["gptq"]["not_kept"]
    assert not qp_settings.job_scratch_dir(streamed.id).exists()  # the spilled roundings are gone with the job

    monkeypatch.setattr(qp_settings, "cache_max_gib", 1.0)  # kept: a streamed job rounds, the next ones read them
    first = sweep(run_body, tiny_llama, "W4A16_GPTQ", True)
    assert first.result["gptq"] == {"layers": 15, "from_cache": 0}
    again = sweep(run_body, tiny_llama, "W4A16_GPTQ", True)
    assert again.result["gptq"] == {"layers": 15, "from_cache": 15} and "from the cache: GPTQ 15" in again.message
    assert stored(qp_settings, first) == stored(qp_settings, again) == rows
    whole = sweep(run_body, tiny_llama, "W4A16_GPTQ", False)  # the streamed job's roundings, read whole: same keys
    assert whole.result["gptq"] == {"layers": 15, "from_cache": 15} and stored(qp_settings, whole) == rows


def test_streamed_awq_sweep_stores_the_whole_rows(run_body, tiny_llama, qp_settings):
    """AWQ searched streamed, then (its kept factors removed) searched whole: the same factors, the same rows."""
    streamed = sweep(run_body, tiny_llama, "W4A16_AWQ", True)
    kept = list((qp_settings.reference_root / "reference").glob("*/awq-*.safetensors"))
    assert len(kept) == 1
    kept[0].unlink()  # the whole-model job searches anew rather than read the streamed job's factors
    whole = sweep(run_body, tiny_llama, "W4A16_AWQ", False)
    assert streamed.result["awq"] == whole.result["awq"] and streamed.result["awq"]["mappings"] > 0
    assert whole.result["awq"]["cached"] is False
    rows = stored(qp_settings, whole)
    assert stored(qp_settings, streamed) == rows and len(rows) == 9 and all(r["kl_mean"] > 0 for r in rows)
