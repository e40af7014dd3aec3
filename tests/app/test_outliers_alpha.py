"""The Outliers page suggests a SmoothQuant α for the scheme it will save, and warns before saving a bad one (AppTest
on the seeded deployment: the planted outlier of tests/app/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

from quantcore.evaluation import alpha as al
from tests.factories import OUTLIER_LAYER

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")


def _outliers(model_id: int) -> AppTest:
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["model_id"] = model_id
    at.session_state["outliers_sq_open"] = True  # the SmoothQuant section, opened (it builds on open)
    at.run()
    at.switch_page("views/outliers.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _sweep(model_id: int, scheme: str) -> dict:
    """The sweep the page should draw for the planted layer, from the stored statistics."""
    from quantplan.services import calibration as calibration_svc

    cal = calibration_svc.calibrations(model_id)[0]
    stat = next(s for s in calibration_svc.layer_stats(cal.id) if s.name == OUTLIER_LAYER)
    return al.alpha_error_sweep(stat, scheme)


def _suggestion_text(at: AppTest) -> str:
    return next(m.value for m in at.markdown if "Suggested α" in m.value)


def _warnings(at: AppTest) -> list[str]:
    return [w.value for w in at.warning if "looks bad" in w.value]


def test_the_page_suggests_alpha_for_the_scheme_it_will_save_and_warns_before_a_bad_one(seeded):
    from quantcore.planning.plans import PlanSpec
    from quantplan.services import plans as plans_svc

    at = _outliers(seeded.id)
    assert at.selectbox(key="outliers_layer").value == OUTLIER_LAYER
    # a new plan of INT8_W8A8 (what the save writes by default): the page suggests that scheme's α
    assert at.selectbox(key="alpha_scheme").value == "INT8_W8A8"
    sweep = _sweep(seeded.id, "INT8_W8A8")
    suggested = al.suggested_alpha(sweep)
    assert f"Suggested α = {suggested:.2f}" in _suggestion_text(at) and "INT8_W8A8" in _suggestion_text(at)
    at.button(key="alpha_use_suggested").click().run()
    assert at.slider(key="outliers_alpha").value == suggested and not _warnings(at)

    # an α the chart itself shows to be bad: warned in the form, and not saved unless confirmed
    bad = next(a for a in al.ALPHA_GRID if al.alpha_warning(sweep, a) is not None)
    at.slider(key="outliers_alpha").set_value(bad).run()
    assert _warnings(at) == [al.alpha_warning(sweep, bad)]
    at.button[-1].click().run()  # the form's submit button
    assert not at.exception
    assert any(e.value.startswith("Not saved:") and "Save anyway" in e.value for e in at.error)
    assert plans_svc.list_plans(seeded.id) == []
    at.checkbox(key=f"alpha_anyway_{OUTLIER_LAYER}_{bad:.2f}").check()
    at.button[-1].click().run()
    assert not at.exception and any(f"α = {bad:.2f}" in s.value for s in at.success)
    saved = plans_svc.newest_plan(plans_svc.list_plans(seeded.id))
    assert saved is not None
    assert PlanSpec.from_dict(saved.body).layer_alpha == {OUTLIER_LAYER: bad}

    # another scheme for the new plan: the suggestion follows it, and the save writes that scheme
    at.selectbox(key="alpha_plan").set_value("(new plan)").run()
    at.selectbox(key="alpha_scheme").set_value("INT8_PER_TENSOR").run()
    per_tensor = al.suggested_alpha(_sweep(seeded.id, "INT8_PER_TENSOR"))
    assert f"Suggested α = {per_tensor:.2f}" in _suggestion_text(at) and "INT8_PER_TENSOR" in _suggestion_text(at)
    at.button(key="alpha_use_suggested").click().run()
    at.text_input(key="alpha_new_name").set_value("per-tensor-sq")
    at.button[-1].click().run()
    assert not at.exception and not _warnings(at)
    plan = plans_svc.newest_plan(plans_svc.list_plans(seeded.id))
    assert plan is not None and plan.name == "per-tensor-sq" and plan.body["default"] == "INT8_PER_TENSOR"
    resolved, problem = plans_svc.resolve(seeded, plan.body)
    assert problem is None and resolved[OUTLIER_LAYER].smoothquant_alpha == per_tensor
    assert resolved[OUTLIER_LAYER].name == "INT8_PER_TENSOR"

    # an existing plan picked: its scheme for the layer is the one the chart counts (no scheme to choose)
    at.run()  # the plans offered are listed before the save: a rerun lists the new one
    at.selectbox(key="alpha_plan").set_value("per-tensor-sq").run()
    assert not at.exception and not any(s.key == "alpha_scheme" for s in at.selectbox)
    assert f"Suggested α = {per_tensor:.2f}" in _suggestion_text(at)


def test_the_choosing_alpha_chart_marks_the_chosen_and_the_suggested_alpha() -> None:
    import numpy as np
    import pandas as pd

    from app.charts import outliers as outlier_charts
    from quantcore.evaluation.stats import LayerStats
    from tests.app.test_charts import data_rows, mark_type, spec_of, view_with, views

    rng = np.random.default_rng(0)
    cm = rng.lognormal(0.0, 0.5, 64).astype(np.float32)
    cm[3] *= 500.0
    stat = LayerStats(name=OUTLIER_LAYER, in_features=64, out_features=32, n_tokens=100, channel_max=cm,
                      weight_channel_max=rng.lognormal(-3.0, 0.3, 64).astype(np.float32),
                      token_max={"p50": 3.0, "p90": 5.0, "p99": float(cm.max()), "max": float(cm.max())})
    sweep = al.alpha_error_sweep(stat, "INT8_PER_TENSOR")
    suggested = al.suggested_alpha(sweep)
    spec = spec_of(outlier_charts.alpha_choice_chart(pd.DataFrame(sweep), 0.3, suggested, "INT8_PER_TENSOR"))
    assert "INT8_PER_TENSOR" in str(spec["title"])
    rules = data_rows(spec, view_with(spec, "rule"))
    assert {(r["which"], r["alpha"]) for r in rules} == {("chosen", 0.3), ("suggested", suggested)}
    lines = {v["encoding"]["y"]["field"]: data_rows(spec, v) for v in views(spec) if mark_type(v) == "line"}
    assert len(lines["error"]) == len(al.ALPHA_GRID) and all(r["error"] > 0 for r in lines["error"])
    assert len(lines["flushed"]) == 2 * len(al.ALPHA_GRID)
