"""The Outliers page's rotation what-if (issue #46): without a rotated calibration it offers one; with one it shows
the chosen layer's input as calibrated, smoothed and rotated, and ranks the layers by how much the rotation helps.
A rotated calibration is never the page's (or a score's) calibration of the model as it is."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from streamlit.testing.v1 import AppTest

from quantcore.evaluation.stats import LayerStats
from store import repo
from store.db import session_scope
from tests.factories import OUTLIER_LAYER

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")
ROTATION = {"kind": "hadamard", "rotations": ["R1", "R2", "R4"]}


def _outliers(model_id: int) -> AppTest:
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["model_id"] = model_id
    at.run()
    at.switch_page("views/outliers.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_without_a_rotated_calibration_the_page_offers_one(seeded):
    at = _outliers(seeded.id)
    assert any(b.label.startswith("Calibrate the rotated model") for b in at.button)


def test_a_rotated_calibration_is_compared_layer_by_layer(seeded, qp_settings):
    with session_scope(qp_settings) as s:  # the seeded calibration's statistics, then "rotated"
        (plain,) = [c for c in repo.calibrations(s, seeded.id)]
        stats = [LayerStats.from_record(r) for r in repo.load_activation_stats(s, plain.id)]
    for st_ in stats:  # rotated: the planted outlier channel spread over all of them
        st_.channel_max = np.full_like(st_.channel_max, float(np.median(st_.channel_max)) * 1.5)
        st_.channel_max[0] *= 1.2
    with session_scope(qp_settings) as s:
        job = repo.create_job(s, kind="calibrate", params={"rotation": ROTATION}, queue="cpu", user=None,
                              model_id=seeded.id)
        repo.mark_running(s, job.id, worker_host="h", device="cpu", torch_version="t")
        repo.save_activation_stats(s, job_id=job.id, model_id=seeded.id, stats=stats)
        repo.finish_job(s, job.id, status="succeeded", result={"tokens": 256, "text": "t", "rotation": ROTATION})
    at = _outliers(seeded.id)
    assert job.id not in at.selectbox(key="outliers_cal").options  # the model as it is, only
    assert at.selectbox(key="outliers_rot_cal").value == job.id
    assert at.selectbox(key="outliers_layer").value == OUTLIER_LAYER
    fixes = next(d.value for d in at.dataframe if "fix" in d.value.columns)
    ratio = dict(zip(fixes["fix"], fixes["outlier ratio (max / median)"], strict=True))
    assert list(ratio)[0] == "none" and list(ratio)[2] == "rotation"
    assert ratio["none"] > 1000 and ratio["rotation"] < 2
    ranked = next(d.value for d in at.dataframe if "rotation_gain" in d.value.columns)
    assert ranked["layer"].iloc[0] == OUTLIER_LAYER
