"""The Results page's "Predicted against measured": every verified automatic plan of the model's architecture family,
its measured KL (± error) against the sum of its units' KLs, coloured by where those came from, and the correction
the next search uses, with how many verifications it rests on (issue 43)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from streamlit.testing.v1 import AppTest

from app.charts import results as result_charts

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")


def test_the_prediction_chart_draws_each_plan_against_the_line_measured_equals_predicted():
    df = pd.DataFrame([
        {"plan": "auto-a", "sensitivity": "kl", "predicted_kl": 0.02, "measured_kl": 0.03, "measured_kl_err": 0.002},
        {"plan": "auto-b", "sensitivity": "fisher", "predicted_kl": 0.01, "measured_kl": 0.012,
         "measured_kl_err": None},
        {"plan": "bf16", "sensitivity": "kl", "predicted_kl": 0.0, "measured_kl": 0.0, "measured_kl_err": 0.0},
    ])
    spec = result_charts.prediction_chart(df).to_dict()
    marks = [layer["mark"]["type"] if isinstance(layer["mark"], dict) else layer["mark"] for layer in spec["layer"]]
    assert marks == ["line", "rule", "circle"]
    points = spec["layer"][2]
    assert points["encoding"]["x"]["scale"]["type"] == "log" and points["encoding"]["y"]["scale"]["type"] == "log"
    assert points["encoding"]["color"]["scale"]["domain"] == ["kl", "fisher"]
    datasets = spec["datasets"]
    plotted = datasets[points["data"]["name"]]
    assert sorted(r["plan"] for r in plotted) == ["auto-a", "auto-b"]  # a KL of 0 has no place on a log axis
    bars = datasets[spec["layer"][1]["data"]["name"]]
    assert [r["plan"] for r in bars] == ["auto-a"]  # no error, no bar
    assert bars[0]["lo"] == 0.03 - 2 * 0.002 and bars[0]["hi"] == 0.03 + 2 * 0.002
    line = datasets[spec["layer"][0]["data"]["name"]]
    assert [(r["predicted_kl"], r["measured_kl"]) for r in line] == [(0.005, 0.005), (0.06, 0.06)]


def test_results_page_plots_the_verified_plans_and_the_correction(seeded):
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        for label, method, predicted, measured in (("auto-h100-kl0.05", None, 0.02, 0.03),
                                                   ("auto-h100-kl0.05-fisher", "fisher", 0.01, 0.02)):
            params = {"predicted_kl": predicted, **({"sensitivity": method} if method else {})}
            job = repo.create_job(s, kind="score", params=params, queue="cpu", user=None, model_id=seeded.id)
            repo.save_score(s, job_id=job.id, model_id=seeded.id, plan_id=None, plan_label=label,
                            plan_body={"default": "FP8_DYNAMIC"}, dataset="builtin:lee.cor", predicted_kl=predicted,
                            report={"kl_mean": measured, "kl_p50": 0.01, "kl_p90": 0.05, "kl_p99": 0.2,
                                    "kl_max": 1.0, "top1_agree": 0.95, "ppl_ref": 18.0, "ppl": 18.4, "tokens": 1000})
            repo.finish_job(s, job.id, status="succeeded", result={"kl_mean": measured})
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["model_id"] = seeded.id
    at.run()
    at.switch_page("views/results.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(h.value == "Predicted against measured" for h in at.subheader)
    said = " ".join(c.value for c in at.caption)
    assert "from Fisher estimates, measured ≈ 2 × predicted (× / ÷ 1), from 1 verified plan" in said
    assert "from exact sweeps, measured ≈ 1.5 × predicted (× / ÷ 1), from 1 verified plan" in said
