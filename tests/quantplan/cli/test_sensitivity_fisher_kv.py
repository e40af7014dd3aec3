"""`quantplan sensitivity MODEL --kv-cache FORMAT --method fisher` (issue 43): the KV cache estimated one attention
layer at a time, in the exact KV sweep's shape, checked against the exact sweep of the same tokens."""

from __future__ import annotations

import math

from tests.factories import run_cli_json as run_json

TOKENS = ("--samples", "4", "--seq-len", "32")


def test_a_kv_cache_format_is_estimated_per_attention_layer_and_compared_with_the_exact_sweep(tiny_model, capsys):
    got = run_json(capsys, "sensitivity", "tiny", "--kv-cache", "FP8_ATTN", "--method", "fisher", "--local",
                   *TOKENS, "--json")
    assert got["method"] == "fisher" and got["scheme"] == "KV FP8_ATTN"
    assert [r["layer"] for r in got["layers"]] and all(r["layer"].endswith("self_attn") for r in got["layers"])
    assert all(r["kl_mean"] > 0 and r["top1_agree"] is None for r in got["layers"])
    compared = got["rank_correlation"]  # the exact KV sweep of the same tokens, run once for it
    assert compared["units"] == len(got["layers"]) == 2 and not math.isnan(compared["spearman"])
    exact = run_json(capsys, "sensitivity", "tiny", "--kv-cache", "FP8_ATTN", "--local", *TOKENS, "--json")
    assert exact["method"] == "kl" and {r["layer"] for r in exact["layers"]} == {r["layer"] for r in got["layers"]}
    ex = {r["layer"]: r["kl_mean"] for r in exact["layers"]}
    for r in got["layers"]:
        assert 0.33 <= r["kl_mean"] / ex[r["layer"]] <= 3.0, (r, ex)
