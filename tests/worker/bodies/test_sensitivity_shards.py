"""The sensitivity body as a shard (``shard: [index, count]``): it sweeps its part of the units, the whole sweep's
own way, and the shards' rows merged (jobs.shards.merged_rows) are the unsharded sweep's rows exactly: linear units
(GPTQ's rounding and a SmoothQuant sweep's left-out layers included) and the KV cache sweep."""

from __future__ import annotations

import pytest

from jobs.shards import merged_rows
from jobs.specs import SensitivitySpec
from store import repo
from store.db import session_scope

TOKENS = {"samples": 3, "seq_len": 16, "cal_samples": 2, "cal_seq_len": 16}


def _stored(settings, job_id: int) -> list[tuple]:
    with session_scope(settings) as s:
        return sorted((r.unit, tuple(r.layers), r.kl_mean, r.top1_agree, r.sqnr_db, r.kl_mean_err)
                      for r in repo.list_sensitivity(s, job_id))


@pytest.mark.parametrize("asked", [{"scheme": "INT8_W8A8_GPTQ"}, {"scheme": "INT8_W8A8_SQ", "groups": False},
                                   {"kv_sweep": "FP8"}])
def test_shards_sweep_their_units_and_merge_into_the_unsharded_sweep(run_body, tiny_llama, qp_settings, asked):
    whole = run_body("sensitivity", SensitivitySpec(**asked, **TOKENS), model_id=tiny_llama)
    assert whole.status == "succeeded", whole.error
    parts = []
    for i in range(3):
        shard = run_body("sensitivity", SensitivitySpec(**asked, **TOKENS, shard=(i, 3)), model_id=tiny_llama)
        assert shard.status == "succeeded", shard.error
        assert shard.result["shard"] == [i, 3] and shard.message.startswith(f"shard {i + 1} of 3: ")
        assert _stored(qp_settings, shard.id) == []  # a shard's rows wait for the merge, in its result
        parts.append(shard.result["rows"])
    sizes = [len(p) for p in parts]
    assert sum(sizes) == whole.result["units"] and max(sizes) - min(sizes) <= 1  # dealt out evenly
    merged = merged_rows(parts)
    with session_scope(qp_settings) as s:
        repo.save_sensitivity(s, job_id=shard.id, model_id=tiny_llama, scheme=whole.result["scheme"], rows=merged)
    assert _stored(qp_settings, shard.id) == _stored(qp_settings, whole.id)  # bit for bit
    assert [r["layer"] for r in merged[:5]] == [t["layer"] for t in whole.result["top"]]
    assert shard.result.get("not_swept") == whole.result.get("not_swept")
