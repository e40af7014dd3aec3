"""Issue #45, items 3-6, in the pages' own logic and in AppTest: one time format, a job's final state as its
progress, the scheme table by family, the rules read back in place, and forms that remember and say what they cost.
(tests/e2e/test_browser_pages.py checks the same in Chromium at 1400 px.)"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from store import repo
from store.db import session_scope
from tests.factories import smol_linears

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")
NOW = dt.datetime(2026, 12, 5, 16, 30, tzinfo=dt.UTC)


def _run(page: str, model_id: int) -> AppTest:
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["model_id"] = model_id
    at.run()
    at.switch_page(f"views/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_every_time_reads_relative_with_the_utc_time_beside_it():
    from app.text import ago, ago_html, utc_text

    naive = dt.datetime(2026, 12, 5, 16, 18)  # SQLite's: naive UTC
    assert [ago(NOW - dt.timedelta(seconds=s), NOW) for s in (2, 40, 12 * 60, 3 * 3600, 5 * 86400, 60 * 86400)] == [
        "just now", "40 s ago", "12 min ago", "3 h ago", "5 d ago", "2026-10-06"]
    assert ago(naive, NOW) == "12 min ago" and utc_text(naive) == "2026-12-05 16:18:00 UTC"
    assert ago_html(naive, NOW) == '<span title="2026-12-05 16:18:00 UTC">12 min ago</span>'
    assert ago(None) == utc_text(None) == ago_html(None) == ""


def test_an_ended_job_shows_its_final_state_never_the_fraction_it_stopped_at(qp_settings):
    from quantplan.services.jobs import get_job, progress_cell

    with session_scope(qp_settings) as s:
        jobs = {}
        for status, fraction in (("failed", 0.05), ("cancelled", 0.5), ("succeeded", 0.9), ("running", 0.4)):
            job = repo.create_job(s, kind="score", params={}, queue="cpu", user="t")
            repo.mark_running(s, job.id, worker_host="h", device="cpu", torch_version="t")
            repo.report_progress(s, job.id, fraction, "scoring: 12 of 32 sequences · about 40 s left")
            if status != "running":
                repo.finish_job(s, job.id, status=status, error="boom" if status == "failed" else None)
            jobs[status] = job.id
        queued = repo.create_job(s, kind="score", params={}, queue="cpu", user="t").id
        never = repo.create_job(s, kind="score", params={}, queue="cpu", user="t").id
        repo.request_cancel(s, never)
    cells = {k: progress_cell(get_job(i)) for k, i in jobs.items()}
    assert cells["failed"].startswith("failed after ") and cells["cancelled"].startswith("cancelled after ")
    assert cells["succeeded"].startswith("done in ") and not any("%" in cells[k] for k in ("failed", "cancelled",
                                                                                            "succeeded"))
    assert cells["running"] == "40% · about 40 s left · scoring: 12 of 32 sequences"
    assert progress_cell(get_job(queued)) == "waiting for a worker"
    assert progress_cell(get_job(never)) == "cancelled before it started"


def test_the_scheme_table_is_every_preset_by_family_with_the_results_pages_descriptions():
    from app.frames import SCHEME_FAMILIES, scheme_catalog
    from quantcore.schemes.presets import get_scheme, list_schemes

    table = scheme_catalog()
    assert sorted(table["scheme"]) == sorted(list_schemes())
    order = [SCHEME_FAMILIES.index(f) for f in table["family"]]
    assert order == sorted(order) and set(table["family"]) == set(SCHEME_FAMILIES)
    row = table.set_index("scheme")
    assert row.loc["FP8_DYNAMIC", "description"] == get_scheme("FP8_DYNAMIC").description
    assert (row.loc["INT8_W8A8", "family"], row.loc["NVFP4", "family"], row.loc["W4A16", "family"],
            row.loc["BF16", "family"]) == ("INT8", "FP4", "weight-only", "keep")
    assert row.loc["W4A16", "storage bits"] == pytest.approx(4 + 16 / 128)  # int4 + a 16-bit scale per 128
    assert row.loc["W4A16", "granularity"] == "W group 128" and row.loc["BF16", "storage bits"] == 16
    assert "h100" in row.loc["FP8_DYNAMIC", "native on"] and "a100" not in row.loc["FP8_DYNAMIC", "native on"]
    assert row.loc["NVFP4", "native on"] == "b200"


def test_the_rules_are_read_back_row_by_row_with_what_each_matches():
    from app.frames import layer_patterns, rules_readback

    names = [lin["name"] for lin in smol_linears()]
    downs = sum(n.endswith("down_proj") for n in names)
    patterns = layer_patterns(names)
    assert patterns["down_proj"] == downs and patterns["lm_head"] == 1 and r"layers\.0\." in patterns
    read = rules_readback([{"match": "down_proj", "scheme": None}, {"match": None, "scheme": "BF16"},
                           {"match": "(", "scheme": "BF16"}, {"match": "no_such", "scheme": "BF16"},
                           {"match": "lm_head", "scheme": "BF16"}, {"match": float("nan"), "scheme": None}], names)
    assert list(read["state"][:2]) == ["incomplete: add a scheme", "incomplete: add a match"]
    assert read["state"][2].startswith("not a regular expression: ")
    assert list(read["state"][3:]) == ["matches no layer", "in the plan", "incomplete: add a match and a scheme"]
    assert read["layers"][0] == downs and read["layers"][4] == 1


def test_a_forms_cost_is_measured_on_past_jobs_of_its_kind_on_its_device(qp_settings):
    from app import forms
    from quantplan.services import models as models_svc

    summary = {"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 2, "num_params": 1_000_000,
               "dtype": "float32", "total_bytes": 4_000_000, "linears": smol_linears()}
    with session_scope(qp_settings) as s:
        small = repo.add_model(s, name="small", sha256="a1" * 32, source_kind="folder", source_name="s",
                               path="models/s", summary=summary, user="t")
        big = repo.add_model(s, name="big", sha256="b2" * 32, source_kind="folder", source_name="b", path="models/b",
                             summary={**summary, "num_params": 4_000_000}, user="t")
    small, big = models_svc.get_model(small.id), models_svc.get_model(big.id)
    assert forms.cost_note("calibrate", "cpu", small, 8192, "tokens", forms.tokens_of) == (
        "8,192 tokens; no estimate of its time on cpu: no calibrate job has run there yet.")
    from sqlalchemy import update

    from store import models as m

    with session_scope(qp_settings) as s:
        job = repo.create_job(s, kind="calibrate", params={"samples": 16, "seq_len": 128}, queue="cpu", user="t",
                              model_id=small.id)
        repo.mark_running(s, job.id, worker_host="h", device="cpu", torch_version="t")
        repo.finish_job(s, job.id, status="succeeded")
        start = dt.datetime(2026, 12, 5, 16, 0)
        s.execute(update(m.Job).where(m.Job.id == job.id)
                  .values(started_at=start, finished_at=start + dt.timedelta(seconds=20)))
    assert forms.cost_note("calibrate", "cpu", small, 8192, "tokens", forms.tokens_of) == (
        "8,192 tokens; about 80 s on cpu (measured on 1 past calibrate job of this model, at 102 tokens a second).")
    # another model's rate, scaled by size: four times the parameters, a quarter of the tokens a second
    assert forms.cost_note("calibrate", "cpu", big, 8192, "tokens", forms.tokens_of).startswith(
        "8,192 tokens; about 5 min 20 s on cpu (measured on 1 past calibrate job of other models, scaled by their "
        "size, at 25.6 tokens a second for this model's size)")
    assert "no estimate of its time on cuda" in forms.cost_note("calibrate", "cuda", small, 8192, "tokens",
                                                                 forms.tokens_of)
    bench = forms.cost_note("bench", "cpu", small, 120, "GEMM cases", forms.cases_of, scale_by_size=False,
                            at_most_s=600.0)
    assert bench == ("120 GEMM cases; no estimate of its time on cpu: no bench job has run there yet "
                     "(at most 10 min 0 s).")


def test_the_calibration_form_opens_on_what_was_queued_for_the_model_after_another_page(seeded):
    at = _run("models", seeded.id)
    assert at.number_input(key="cal_samples").value == 32
    assert any(c.value.startswith("Cost: 8,192 tokens; ") for c in at.caption)
    at.number_input(key="cal_samples").set_value(24)
    next(b for b in at.button if b.label == "Queue calibration").click().run()
    assert not at.exception and any("Queued calibration job #" in s.value for s in at.success)
    at.switch_page("views/jobs.py").run()
    at.switch_page("views/models.py").run()
    assert not at.exception
    assert at.number_input(key="cal_samples").value == 24  # not the default 32 again
    assert any(c.value.startswith("Cost: 6,144 tokens; ") for c in at.caption)


def test_the_jobs_table_shows_its_key_columns_first_and_the_scores_who_and_where(seeded):
    from app.frames import JOB_KEY_COLUMNS, SCORE_KEY_COLUMNS

    at = _run("jobs", seeded.id)
    table = next(d for d in at.dataframe if "progress" in d.value.columns)
    assert list(table.proto.column_order) == JOB_KEY_COLUMNS
    rows = table.value.set_index("status")
    assert rows.loc["failed", "progress"] == "failed" and re.fullmatch(r"just now|\d+ s ago", rows.loc["failed", "age"])
    at = _run("results", seeded.id)
    scores = next(d for d in at.dataframe if "KL ± error" in d.value.columns)
    assert list(scores.proto.column_order) == SCORE_KEY_COLUMNS
    assert re.fullmatch(r"just now|\d+ s ago", scores.value["when"].iloc[0])
    assert scores.value["scored"].iloc[0].endswith(" UTC")


def test_a_rule_is_built_from_the_models_patterns_and_read_back_in_place(seeded):
    at = _run("plans", seeded.id)
    key = f"plan_rules_{seeded.id}_(new plan)"
    downs = sum(lin["name"].endswith("down_proj") for lin in smol_linears())
    at.selectbox(key=f"{key}_pattern").set_value("down_proj").run()
    assert any(c.value == f"`down_proj` matches {downs} of {len(smol_linears())} layers" for c in at.caption)
    at.selectbox(key=f"{key}_scheme").set_value("INT8_W8A8").run()
    at.button(key=f"{key}_add").click().run()
    assert not at.exception and not at.warning
    read = next(d.value for d in at.dataframe if "state" in d.value.columns)
    assert read.iloc[-1].to_dict() == {"row": len(read), "match": "down_proj", "scheme": "INT8_W8A8",
                                       "layers": downs, "state": "in the plan"}
    plan_body = at.session_state[f"plan_body_{seeded.id}"]
    assert plan_body["rules"][-1] == {"match": "down_proj", "scheme": "INT8_W8A8"}
