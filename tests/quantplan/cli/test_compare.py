"""`quantplan compare JOB JOB [...]`: the comparison as text and as --json, and its refusals (issue 44, item 5)."""

from __future__ import annotations

import numpy as np

from quantcore.evaluation.stats import HIST_BINS, LayerStats
from store import repo
from store.db import session_scope
from tests.factories import run_cli, run_cli_json, stored_model

LAYER = "model.layers.0.self_attn.q_proj"


def _finished(s, model_id, kind, params):
    job = repo.create_job(s, kind=kind, params=params, queue="cpu", user="ann", model_id=model_id)
    repo.mark_running(s, job.id, worker_host="box", device="cpu", torch_version="2.x")
    return job


def _calibration(s, model_id, outlier_channel):
    job = _finished(s, model_id, "calibrate", {"samples": 4})
    cm = np.ones(32, dtype=np.float32)
    cm[outlier_channel] = 50.0
    st = LayerStats(name=LAYER, in_features=32, out_features=32, n_tokens=64, channel_max=cm,
                    weight_channel_max=np.full(32, 0.1, np.float32), hist_counts=np.zeros(HIST_BINS, np.int64))
    repo.save_activation_stats(s, job_id=job.id, model_id=model_id, stats=[st])
    repo.finish_job(s, job.id, status="succeeded", result={"layers": 1, "tokens": 64})
    return job.id


def _score(s, model_id, label, kl_seq):
    job = _finished(s, model_id, "score", {"scheme": label})
    kl = float(np.mean(kl_seq))
    repo.save_score(s, job_id=job.id, model_id=model_id, plan_id=None, plan_label=label, plan_body={"default": label},
                    dataset="builtin:lee.cor", report={
                        "kl_mean": kl, "kl_p50": kl, "kl_p90": kl, "kl_p99": kl, "kl_max": kl, "top1_agree": 0.9,
                        "ppl_ref": 10.0, "ppl": 10.2, "tokens": 60, "kl_mean_err": float(np.std(kl_seq, ddof=1) / 2),
                        "sequences": 4, "eval_key": "abc", "kl_by_sequence": kl_seq})
    repo.finish_job(s, job.id, status="succeeded", result={"kl_mean": kl})
    return job.id


def test_compare_prints_scores_side_by_side_with_their_paired_difference(qp_settings, capsys):
    with session_scope() as s:
        model = stored_model(s).id
        a = _score(s, model, "FP8_DYNAMIC", [0.010, 0.020, 0.030, 0.040])
        b = _score(s, model, "INT8_W8A8", [0.012, 0.023, 0.031, 0.044])
    code, out, err = run_cli(capsys, "compare", str(a), str(b))
    assert code == 0, err
    assert f"#{a}: #{a} score · tiny · FP8_DYNAMIC (succeeded)" in out
    assert "* params.scheme" in out and "FP8_DYNAMIC" in out and "INT8_W8A8" in out
    assert f"#{b} − #{a} KL: 0.0025 ± 0.00065" in out and "paired over 4 sequences" in out
    res = run_cli_json(capsys, "compare", f"{a},{b}", "--json")
    assert [r["key"] for r in res["runs"]] == [f"#{a}", f"#{b}"] and res["baseline"] == f"#{a}"
    (kl,) = [d for d in res["differences"] if d["figure"] == "KL"]
    d = np.array([0.002, 0.003, 0.001, 0.004])
    assert kl["paired"] and abs(kl["difference"] - d.mean()) < 1e-12
    assert abs(kl["err"] - d.std(ddof=1) / 2) < 1e-12


def test_compare_two_calibrations_reports_the_outlier_drift(qp_settings, capsys):
    with session_scope() as s:
        base, tuned = stored_model(s, "base").id, stored_model(s, "tuned").id
        a, b = _calibration(s, base, 3), _calibration(s, tuned, 11)
    code, out, err = run_cli(capsys, "compare", str(a), str(b))
    assert code == 0, err
    assert f"== Outlier drift #{a} → #{b} ==" in out
    assert f"{LAYER}: moved; ratio 50 → 50; appeared [11], gone [3]" in out
    assert "recalibrate on tuned" in out and f"{LAYER}: clips and wastes range" in out
    res = run_cli_json(capsys, "compare", str(a), str(b), "--json")
    (drift,) = res["drift"]
    assert drift["layers"][0]["appeared"] == [11] and drift["transfer"][0]["clipped_channels"] == [11]


def test_compare_refuses_one_run_and_unknown_ids_in_a_line(qp_settings, capsys):
    with session_scope() as s:
        a = _calibration(s, stored_model(s).id, 3)
    code, _, err = run_cli(capsys, "compare", str(a))
    assert code == 1 and err.strip() == f"quantplan: compare needs two or more runs (job ids); got 1 (#{a}): name at " \
                                        "least one more"
    code, _, err = run_cli(capsys, "compare", str(a), "77")
    assert code == 1 and "no job #77" in err
    code, _, err = run_cli(capsys, "compare", str(a), "seven")
    assert code == 1 and "'seven' is not a job id" in err
