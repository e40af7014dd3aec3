"""`quantplan sensitivity --method fisher`: the fast estimate keeps the sweep's JSON shape, says its method, prints its
rank correlation with the exact sweep of the same tokens (running that sweep once when there is none), and never
stands in for an exact sweep where the planner reads them."""

from __future__ import annotations

import pytest

from tests.factories import run_cli_json as run_json

ARGS = ("--local", "--samples", "4", "--seq-len", "32", "--json")


def test_a_fisher_sweep_reports_its_method_and_its_rank_correlation(tiny_model, capsys):
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from quantplan.services import sweeps as sweeps_svc

    model = models_svc.get_model("tiny")
    fast = run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", "--method", "fisher", *ARGS)
    assert fast["method"] == "fisher" and fast["scheme"] == "INT8_W8A8"
    assert len(fast["layers"]) == 9  # 4 fusion units a block, 2 blocks, the head: the exact sweep's units
    assert all(set(r) == {"layer", "layers", "kl_mean", "kl_mean_err", "top1_agree", "sqnr_db"}
               for r in fast["layers"])
    assert all(r["kl_mean"] > 0 and r["top1_agree"] is None and r["sqnr_db"] is not None for r in fast["layers"])
    compared = fast["rank_correlation"]
    exact_job = jobs_svc.get_job(compared["exact_job"])
    assert exact_job.params.get("method", "kl") == "kl" and exact_job.result["tokens"] == [4, 32]
    assert compared["units"] == 9 and -1.0 <= compared["spearman"] <= 1.0
    exact = {r.unit: r.kl_mean for r in sweeps_svc.sensitivity_rows(exact_job.id)}
    assert set(exact) == {r["layer"] for r in fast["layers"]}
    assert jobs_svc.get_job(fast["job"]).result["method"] == "fisher"
    assert sweeps_svc.sweep_label(jobs_svc.get_job(fast["job"])) == "INT8_W8A8 (Fisher estimate)"

    # again: the exact sweep is read, not run again
    jobs = len(jobs_svc.list_jobs(limit=100))
    again = run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", "--method", "fisher", *ARGS)
    assert again["rank_correlation"]["exact_job"] == exact_job.id
    assert len(jobs_svc.list_jobs(limit=100)) == jobs + 1
    # the planner reads the exact sweeps unless asked for the estimates; the two are never mixed
    assert sweeps_svc.sensitivity_map(model)[0]["INT8_W8A8"] == exact
    estimated = sweeps_svc.sensitivity_map(model, method="fisher")[0]["INT8_W8A8"]
    assert estimated == {r["layer"]: r["kl_mean"] for r in again["layers"]}
    # the exact sweep's own JSON says its method too
    plain = run_json(capsys, "sensitivity", "tiny", "--scheme", "FP8_DYNAMIC", *ARGS)
    assert plain["method"] == "kl" and "rank_correlation" not in plain


def test_the_estimate_is_refused_where_it_has_no_meaning(tiny_model, capsys):
    from jobs.errors import InvalidJob
    from jobs.specs import SensitivitySpec

    with pytest.raises(InvalidJob, match="method must be one of kl, fisher"):  # a job queued by another client
        SensitivitySpec.from_params({"scheme": "FP8", "method": "hessian"})
    # a KV cache format has its estimate too (quantcore.evaluation.fisher_kv; tests/.../test_sensitivity_fisher_kv.py)
    assert SensitivitySpec.from_params({"kv_sweep": "FP8", "method": "fisher"}).method == "fisher"
    assert "method" not in SensitivitySpec.from_params({"scheme": "FP8"}).to_params()  # old sweeps' params unchanged
