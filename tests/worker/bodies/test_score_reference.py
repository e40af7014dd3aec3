"""The score body's reference: full where it is small, the compact top-k record past ``reference_full_max_mb``,
computed in the job and not kept where the cache could not hold it; the job says which and the bound it carries."""

from __future__ import annotations

from pathlib import Path

from jobs.specs import ScoreSpec

TOKENS = {"samples": 2, "seq_len": 16, "cal_samples": 2, "cal_seq_len": 16}


def kept_references(settings) -> list[Path]:
    return sorted(Path(settings.reference_root).rglob("*.safetensors"))


def test_a_small_reference_is_kept_whole_and_exact(run_body, tiny_llama, qp_settings):
    job = run_body("score", ScoreSpec(scheme="FP8_DYNAMIC", **TOKENS), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    assert job.result["reference_kind"] == "full" and job.result["topk"] is None
    assert job.result["kl_tail_bound"] == 0.0 and "±" not in job.message


def test_past_the_size_setting_the_compact_reference_is_kept_and_its_bound_reported(run_body, tiny_llama,
                                                                                     qp_settings, monkeypatch):
    monkeypatch.setattr(qp_settings, "reference_full_max_mb", 0.0)
    monkeypatch.setattr(qp_settings, "reference_topk", 8)  # less than the 64 it keeps at least
    job = run_body("score", ScoreSpec(scheme="FP8_DYNAMIC", **TOKENS), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    r = job.result
    assert (r["reference_kind"], r["topk"]) == ("topk", 8)
    assert r["kl_mean"] > 0 and 0 < r["kl_tail_bound"] < r["kl_mean"]
    assert "(top-8 reference, tail bound " in job.message
    (kept,) = kept_references(qp_settings)
    from quantcore.evaluation.reference import ReferenceCache

    assert ReferenceCache.load(kept).kind == "topk"
    from quantplan.services import models as models_svc
    from quantplan.services import scoring as scoring_svc

    kind, size = scoring_svc.reference_cache_bytes(models_svc.get_model(tiny_llama), 2, 16)  # the Results page's
    assert kind == "top-8" and size <= kept.stat().st_size <= size + 8192  # + token ids, NLLs, the header
    identity = run_body("score", ScoreSpec(scheme="BF16", **TOKENS), model_id=tiny_llama)
    assert identity.result["kl_mean"] == 0.0 and identity.result["top1_agree"] == 1.0
    assert identity.result["reference_kind"] == "topk"
    assert kept_references(qp_settings) == [kept]  # read from the cache, not computed again


def test_a_reference_the_cache_cannot_hold_is_recomputed_in_the_job(run_body, tiny_llama, qp_settings, monkeypatch):
    monkeypatch.setattr(qp_settings, "cache_max_gib", 1e-9)  # about 1 byte
    job = run_body("score", ScoreSpec(scheme="FP8_DYNAMIC", **TOKENS), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    assert job.result["reference_kind"] == "recomputed" and job.result["kl_mean"] > 0
    assert kept_references(qp_settings) == []
