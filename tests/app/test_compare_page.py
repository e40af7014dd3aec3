"""The Compare page (/compare?jobs=ID,ID): runs picked by link or by the picker, parameters with the differences
highlighted, the paired difference of two scores, and the outlier drift of two calibrations (AppTest)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from quantcore.evaluation.stats import HIST_BINS, LayerStats
from store import repo
from store.db import session_scope
from tests.factories import stored_model

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")
LAYER = "model.layers.0.mlp.down_proj"


def _job(s, model_id, kind, params, result=None):
    job = repo.create_job(s, kind=kind, params=params, queue="cpu", user="ann", model_id=model_id)
    repo.mark_running(s, job.id, worker_host="box", device="cpu", torch_version="2.x")
    repo.finish_job(s, job.id, status="succeeded", result=result)
    return job.id


@pytest.fixture
def runs(qp_settings):
    """Two scores of one model on the same tokens (per-sequence KLs kept) and the calibrations of a base model and
    its "fine-tune" whose outlier moved from channel 3 to 11: (score a, score b, calibration a, calibration b)."""
    with session_scope() as s:
        base, tuned = stored_model(s, "base").id, stored_model(s, "tuned").id
        scores = []
        for label, seq in (("FP8_DYNAMIC", [0.01, 0.02, 0.03, 0.04]), ("INT8_W8A8", [0.02, 0.025, 0.04, 0.05])):
            jid = _job(s, base, "score", {"scheme": label})
            kl = float(np.mean(seq))
            repo.save_score(s, job_id=jid, model_id=base, plan_id=None, plan_label=label, plan_body={"default": label},
                            dataset="builtin:lee.cor", report={
                                "kl_mean": kl, "kl_p50": kl, "kl_p90": kl, "kl_p99": kl, "kl_max": kl,
                                "top1_agree": 0.9, "ppl_ref": 10.0, "ppl": 10.2, "tokens": 60,
                                "kl_mean_err": float(np.std(seq, ddof=1) / 2), "sequences": 4, "eval_key": "k",
                                "kl_by_sequence": seq})
            scores.append(jid)
        cals = []
        for model, channel in ((base, 3), (tuned, 11)):
            jid = _job(s, model, "calibrate", {"samples": 4})
            cm = np.ones(32, dtype=np.float32)
            cm[channel] = 60.0
            repo.save_activation_stats(s, job_id=jid, model_id=model, stats=[LayerStats(
                name=LAYER, in_features=32, out_features=16, n_tokens=64, channel_max=cm,
                weight_channel_max=np.full(32, 0.1, np.float32), hist_counts=np.zeros(HIST_BINS, np.int64))])
            cals.append(jid)
    return (*scores, *cals)


def _open(jobs: str | None) -> AppTest:
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.run()
    if jobs is not None:
        at.query_params["jobs"] = jobs
    at.switch_page("views/compare.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_a_link_compares_two_scores_with_their_paired_difference(runs):
    a, b, _, _ = runs
    at = _open(f"{a},{b}")
    assert at.title[0].value == "Compare" and at.multiselect(key="compare_jobs").value == [a, b]
    params = at.dataframe[0].value.set_index("parameter")
    assert params.loc["params.scheme", f"#{b}"] == "INT8_W8A8" and "requested by" not in params.index  # same: hidden
    diffs = at.dataframe[2].value
    kl = diffs.iloc[0]
    assert kl["a"] == f"#{b}" and kl["b"] == f"#{a}" and bool(kl["paired"])
    assert kl["difference"] == pytest.approx(np.mean([0.01, 0.005, 0.01, 0.01]))
    assert "paired over 4 sequences" in kl["why"]
    at.toggle(key="compare_only_differing").set_value(False).run()
    assert "requested by" in at.dataframe[0].value.set_index("parameter").index


def test_two_calibrations_show_the_outlier_drift_and_what_clips(runs):
    _, _, ca, cb = runs
    at = _open(f"{ca},{cb}")
    assert f"#{ca} → #{cb}" in [h.value for h in at.subheader]
    assert any("recalibrate on tuned" in w.value for w in at.warning)
    layers = next(d.value for d in at.dataframe if "verdict" in d.value.columns and "appeared" in d.value.columns)
    row = layers.set_index("layer").loc[LAYER]
    assert row["verdict"] == "moved" and row["appeared"] == "11" and row["gone"] == "3"
    transfer = next(d.value for d in at.dataframe if "clipped_channels" in d.value.columns)
    assert transfer.set_index("layer").loc[LAYER, "verdict"] == "clips and wastes range"
    assert at.selectbox(key="compare_drift_plan").value is None  # the what-if until a plan is picked


def test_the_picker_names_the_runs_in_the_address_and_a_bad_link_says_so(runs):
    a, _, ca, _ = runs
    at = _open(None)
    assert any("Pick two or more runs" in i.value for i in at.info)
    at.multiselect(key="compare_jobs").set_value([a, ca]).run()
    assert not at.exception and at.query_params["jobs"] == f"{a},{ca}"
    assert any("fewer than two scores among these runs" in c.value for c in at.caption)
    at.run()  # the address now names them: the picker keeps them
    assert at.multiselect(key="compare_jobs").value == [a, ca] and not at.exception
    at = _open(f"{a},999")
    assert any("No job #999" in w.value for w in at.warning)
    assert any("Pick two or more runs" in i.value for i in at.info)


def test_the_compare_page_and_command_never_import_torch():
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, '.');"
            "import app.charts.compare, quantplan.services.compare, quantplan.cli.compare, quantcore.evaluation.drift;"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stdout + res.stderr
