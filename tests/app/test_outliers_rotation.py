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


def _rotated_calibration(seeded, qp_settings) -> int:
    """A finished rotated calibration of the seeded model: its statistics, the planted outlier channel spread over
    every channel (as a rotation does)."""
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
    return job.id


def test_a_rotated_calibration_is_compared_layer_by_layer(seeded, qp_settings):
    rot_id = _rotated_calibration(seeded, qp_settings)
    at = _outliers(seeded.id)
    assert rot_id not in at.selectbox(key="outliers_cal").options  # the model as it is, only
    assert at.selectbox(key="outliers_rot_cal").value == rot_id
    assert at.selectbox(key="outliers_layer").value == OUTLIER_LAYER
    fixes = next(d.value for d in at.dataframe if "fix" in d.value.columns)
    ratio = dict(zip(fixes["fix"], fixes["outlier ratio (max / median)"], strict=True))
    assert list(ratio)[0] == "none" and list(ratio)[2] == "rotation"
    assert ratio["none"] > 1000 and ratio["rotation"] < 2
    # the format table and the whole model compute only while their expanders are open
    assert not any("rotation_gain" in d.value.columns for d in at.dataframe)
    assert not any({"fix", "frac_channels_flushed"} <= set(d.value.columns) for d in at.dataframe)


def test_the_whole_model_is_ranked_by_the_fix_chosen(seeded, qp_settings):
    _rotated_calibration(seeded, qp_settings)
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["model_id"] = seeded.id
    at.session_state["rot_model_open"] = True  # the whole-model expander, open
    at.run()
    at.switch_page("views/outliers.py").run()
    assert not at.exception, [e.value for e in at.exception]
    ranked = next(d.value for d in at.dataframe if "rotation_gain" in d.value.columns)
    assert ranked["layer"].iloc[0] == OUTLIER_LAYER  # the planted outlier: the rotation's largest gain
    assert ranked["rotation_gain"].iloc[0] > 500 and ranked["best_fix"].iloc[0] == "rotation"
    assert (ranked["rotation_gain"].diff().dropna() <= 0).all()  # most helped first
    at.radio(key="rot_rank_by").set_value("SmoothQuant").run()
    by_sq = next(d.value for d in at.dataframe if "rotation_gain" in d.value.columns)
    assert (by_sq["smoothquant_gain"].diff().dropna() <= 0).all()
    assert at.selectbox(key="rot_depth_proj").value == "down_proj"  # the chosen layer's projection type
    flushed = next(d.value for d in at.dataframe if "layers_flushing" in d.value.columns)
    per_fix = flushed[flushed["format"] == "int8"].set_index("fix")["layers_flushing"]
    assert per_fix["none"] >= 1 and per_fix["rotation"] == 0  # INT8 per tensor flushes the planted layer's channels


def test_the_breakage_table_shows_each_fix(seeded, qp_settings):
    _rotated_calibration(seeded, qp_settings)
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["model_id"] = seeded.id
    at.session_state["rot_breakage_open"] = True
    at.run()
    at.switch_page("views/outliers.py").run()
    assert not at.exception, [e.value for e in at.exception]
    table = next(d.value for d in at.dataframe if {"fix", "frac_channels_flushed"} <= set(d.value.columns))
    int8 = table[table["format"] == "int8"].set_index("fix")["frac_channels_flushed"]
    assert list(int8.index) == ["none", "SmoothQuant α=0.5", "rotation"]
    assert int8["none"] > 50 and int8["rotation"] == 0  # percent: most channels flush under the 3000x outlier


def test_a_queued_rotated_calibration_is_said_and_not_offered_again(seeded, qp_settings):
    at = _outliers(seeded.id)
    at.multiselect(key="outliers_rotate_rotations").set_value(["R1", "R4"])
    at.selectbox(key="outliers_rotate_block").set_value(64)
    next(b for b in at.button if b.key == "outliers_rotate").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("Queued job #" in s.value for s in at.success)
    with session_scope(qp_settings) as s:
        job = repo.list_jobs(s, kind="calibrate", model_id=seeded.id, status=("queued",))[0]
    assert job.params["rotation"] == {"kind": "hadamard", "rotations": ["R1", "R4"], "block_size": 64}
    again = _outliers(seeded.id)
    assert any(f"job #{job.id}" in i.value for i in again.info)
    assert not any(b.key == "outliers_rotate" for b in again.button)
