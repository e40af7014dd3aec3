"""`quantplan score` / `scores` carry every figure with its error (issue #41): the JSON keys scripts read, the
llama.cpp-like block, and a comparison of two stored scores that says when it cannot tell them apart."""

from __future__ import annotations

import math

import pytest

from tests.factories import run_cli as run
from tests.factories import run_cli_json as run_json

STATISTICS_KEYS = ("kl_mean", "kl_mean_err", "kl_max", "kl_p999", "kl_p99", "kl_p95", "kl_p90", "kl_p50", "kl_p10",
                   "kl_p05", "kl_p01", "kl_p001", "kl_min", "dp_mean", "dp_mean_err", "dp_rms", "top1_agree",
                   "top1_agree_err", "ln_ppl_ratio", "ln_ppl_ratio_err")


def test_score_json_carries_the_figures_with_their_errors_and_scores_compare(tiny_model, capsys):
    from quantplan.services import models as models_svc
    from quantplan.services import scoring as scoring_svc

    args = ("--local", "--samples", "4", "--seq-len", "32", "--json")
    fp8 = run_json(capsys, "score", "tiny", "--scheme", "FP8_DYNAMIC", *args)
    for key in STATISTICS_KEYS:
        assert key in fp8, key
    assert fp8["sequences"] == 4 and fp8["tokens"] == 4 * 31
    assert fp8["kl_mean_err"] > 0 and fp8["top1_agree_err"] >= 0 and fp8["ln_ppl_ratio_err"] > 0
    order = [fp8[k] for k in ("kl_max", "kl_p999", "kl_p99", "kl_p95", "kl_p90", "kl_p50", "kl_p10", "kl_p05",
                              "kl_p01", "kl_p001", "kl_min")]
    assert order == sorted(order, reverse=True)
    assert fp8["ln_ppl_ratio"] == pytest.approx(math.log(fp8["ppl"] / fp8["ppl_ref"]), rel=1e-6, abs=1e-9)
    w4 = run_json(capsys, "score", "tiny", "--scheme", "W4A16", *args)
    code, out, _ = run(capsys, "score", "tiny", "--scheme", "FP8_DYNAMIC", "--local", "--samples", "4",
                       "--seq-len", "32")
    assert code == 0
    for line in ("Mean    KLD:", "Maximum KLD:", "99.9%   KLD:", "Median  KLD:", " 0.1%   KLD:", "Minimum KLD:",
                 "Same top p:", "Mean ln(PPL(Q)/PPL(base))"):
        assert line in out, line
    assert f"Mean    KLD: {fp8['kl_mean']:10.6g} ± {fp8['kl_mean_err']:10.6g}" in out  # the same tokens: same KL

    listed = run_json(capsys, "scores", "tiny", "--json")
    rows = {r["job"]: r for r in listed["plans"]}
    newest_fp8 = max(j for j, r in rows.items() if r["plan"] == "FP8_DYNAMIC")
    for key in STATISTICS_KEYS:
        assert key in rows[newest_fp8], key
    assert rows[w4["job"]]["kl_mean_err"] == w4["kl_mean_err"]

    scores = {s.job_id: s for s in scoring_svc.list_scores(models_svc.get_model("tiny").id)}
    a, b = scores[fp8["job"]], scores[w4["job"]]
    assert scoring_svc.paired(a, b)  # one reference cache: the same tokens, sequence by sequence
    diff = scoring_svc.kl_difference(b, a)
    by_hand = [x - y for x, y in zip(b.figure("kl_by_sequence"), a.figure("kl_by_sequence"), strict=True)]
    assert diff.value == pytest.approx(sum(by_hand) / 4)
    verdict = scoring_svc.compare_scores(a, b)
    assert (("is better by" in verdict.verdict) == (verdict.better is not None)
            and ("indistinguishable at this sample size" in verdict.verdict) == (verdict.better is None))
    same = scoring_svc.compare_scores(a, scores[newest_fp8])  # the same plan twice: exactly no difference
    assert same.better is None and same.verdict.startswith("indistinguishable at this sample size")


def test_plan_auto_calls_a_plan_within_budget_only_beyond_the_error(tiny_model, capsys):
    from quantplan.services import autoplan as autoplan_svc
    from quantplan.services import jobs as jobs_svc

    swept = run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", "--local", "--samples", "4",
                     "--seq-len", "32", "--json")
    assert all(r["kl_mean_err"] is not None and r["kl_mean_err"] >= 0 for r in swept["layers"])  # each unit ± error
    assert any(r["kl_mean_err"] > 0 for r in swept["layers"])
    out = run_json(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100", "--candidates",
                   "INT8_W8A8", "--local", "--json")
    assert out["within_budget"] is True and out["measured_kl_err"] > 0
    assert out["budget_check"].startswith(f"measured KL {out['measured_kl']:.4g} ± ")
    result = jobs_svc.get_job(out["verify_job"]).result
    # a budget half an error above the measured KL lies inside the error: no verdict, and what would settle it
    tight = autoplan_svc.budget_check(result, result["kl_mean"] + 0.5 * result["kl_mean_err"])
    assert tight.within is None and "the budget lies inside the error" in tight.text
    # (2 err / 0.5 err)² = 16 times the sequences: 4 × 16 = 64 in all, 60 more, of 32 tokens each
    assert tight.more_sequences == 60 and tight.more_tokens == 60 * 32
    assert autoplan_svc.budget_check(result, result["kl_mean"] - 3 * result["kl_mean_err"]).within is False
