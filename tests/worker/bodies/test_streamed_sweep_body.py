"""The sensitivity job streamed (quantcore.evaluation.streamed_sweep): asked (``stream``) or chosen by the worker's
budget (QUANTPLAN_MODEL_MEMORY_GIB), alone or as a shard, it stores the rows the whole-model job stores (the Fisher
estimate streamed, of linear units, KV cache formats and rotated: test_streamed_fisher.py)."""

from __future__ import annotations

from jobs.specs import SensitivitySpec
from store import repo
from store.db import session_scope
from tests.worker.bodies.test_streaming import TOKENS, sizes

KEYS = ("unit", "kl_mean", "kl_mean_err", "top1_agree", "sqnr_db")


def stored(settings, job) -> list[dict]:
    with session_scope(settings) as s:
        return [{k: getattr(r, k) for k in KEYS} for r in repo.list_sensitivity(s, job.id)]


def test_a_streamed_sweep_stores_the_whole_sweeps_rows(run_body, tiny_llama, qp_settings, monkeypatch):
    """A linear sweep asked streamed; a KV sweep streamed because the model does not fit the budget; a shard of a
    streamed sweep: the same rows as whole-model."""
    whole = run_body("sensitivity", SensitivitySpec(scheme="FP8_DYNAMIC", stream=False, **TOKENS), model_id=tiny_llama)
    streamed = run_body("sensitivity", SensitivitySpec(scheme="FP8_DYNAMIC", stream=True, **TOKENS),
                        model_id=tiny_llama)
    assert whole.status == streamed.status == "succeeded", (whole.error, streamed.error)
    assert (whole.result["mode"], streamed.result["mode"]) == ("whole model", "streamed")
    assert stored(qp_settings, streamed) == stored(qp_settings, whole) and len(stored(qp_settings, whole)) == 9
    shard = run_body("sensitivity", {**SensitivitySpec(scheme="FP8_DYNAMIC", stream=True, **TOKENS).to_params(),
                                     "shards": 2, "shard": [1, 2]}, model_id=tiny_llama)
    assert shard.status == "succeeded", shard.error
    by_layer = {r["unit"]: r for r in stored(qp_settings, whole)}
    assert shard.result["rows"] and all(by_layer[r["layer"]]["kl_mean"] == r["kl_mean"] for r in shard.result["rows"])

    kv_whole = run_body("sensitivity", SensitivitySpec(kv_sweep="FP8", stream=False, **TOKENS), model_id=tiny_llama)
    resident, block, _weights = sizes(qp_settings, tiny_llama)
    monkeypatch.setattr(qp_settings, "model_memory_gib", (resident + block + 4096) / 2**30)
    kv_streamed = run_body("sensitivity", SensitivitySpec(kv_sweep="FP8", **TOKENS), model_id=tiny_llama)
    assert kv_streamed.status == "succeeded", kv_streamed.error
    assert kv_streamed.result["mode"] == "streamed"
    assert stored(qp_settings, kv_streamed) == stored(qp_settings, kv_whole) and kv_whole.result["units"] == 2
    assert not qp_settings.job_scratch_dir(kv_streamed.id).exists()

