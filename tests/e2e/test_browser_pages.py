"""Issue #45, items 3-6, in headless Chromium at 1400 × 1000 against the running app: every table's key columns are
visible without scrolling sideways (Jobs, Results, the Plans rules editor), a row's details open on selection, times
read "… ago" with the UTC time on hover, an ended job shows its final state and a running one its count and time
left, the rules editor offers the model's layer patterns and every scheme described by family, and a form queued
once opens on what it queued. One seeded database (rows as the jobs store them: no worker, nothing runs) and one
app start; screenshots of every table are saved under the test's tmp folder (the path is printed)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from store import repo
from store.db import session_scope
from tests.e2e.browser import CHROMIUM, CHROMIUM_ARGS, PAGE_TIMEOUT_MS, settle
from tests.factories import smol_linears

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.slow]

WIDTH, HEIGHT = 1400, 1000
ROW_PX = 35  # the height of a Streamlit table's header and of each row (its default row height)
RUNNING_MESSAGE = "scoring: 12 of 32 sequences (whole model) · about 40 s left"  # as worker.runner writes it


def _seed(settings) -> dict[str, int]:
    """A model with SmolLM2's linear layers; a running score (its message as the runner writes it), a failed
    calibration stopped at 5 %, a cancelled sweep stopped at 50 %, a succeeded calibration of 16 × 128 tokens that
    ran 20 s on cpu (a measured rate for the calibration form), two scores by different people on different
    devices, and a saved plan. Returns the ids the test reads."""
    summary = {"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 30,
               "num_params": 135_000_000, "dtype": "float32", "total_bytes": 40_000_000, "linears": smol_linears()}
    ids: dict[str, int] = {}
    with session_scope(settings) as s:
        model = repo.add_model(s, name="smol-shapes", sha256="ef" * 32, source_kind="folder", source_name="x",
                               path="models/x", summary=summary, user="ada")
        ids["model"] = model.id
        cal = repo.create_job(s, kind="calibrate", params={"samples": 16, "seq_len": 128, "device": "cpu"},
                              queue="cpu", user="ada", model_id=model.id)
        repo.mark_running(s, cal.id, worker_host="host-a", device="cpu", torch_version="2.13.0")
        repo.finish_job(s, cal.id, status="succeeded", message="210 layers calibrated", result={"tokens": 2048})
        ids["calibrated"] = cal.id
        failed = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="bob", model_id=model.id)
        repo.mark_running(s, failed.id, worker_host="host-a", device="cpu", torch_version="2.13.0")
        repo.report_progress(s, failed.id, 0.05, "loading smol-shapes")
        repo.finish_job(s, failed.id, status="failed", error="boom: out of memory", traceback="Traceback …")
        ids["failed"] = failed.id
        swept = repo.create_job(s, kind="sensitivity", params={"scheme": "W4A16"}, queue="cpu", user="bob",
                                model_id=model.id)
        repo.mark_running(s, swept.id, worker_host="host-a", device="cpu", torch_version="2.13.0")
        repo.report_progress(s, swept.id, 0.5, "down_proj (60 of 121)")
        repo.finish_job(s, swept.id, status="cancelled", message="cancelled")
        ids["cancelled"] = swept.id
        for who, device, scheme, kl in (("ada", "cpu", "FP8_DYNAMIC", 0.02), ("bob", "cuda (NVIDIA H100 80GB HBM3)",
                                                                              "W4A16", 0.31)):
            sc = repo.create_job(s, kind="score", params={"scheme": scheme, "samples": 8, "seq_len": 128},
                                 queue="cpu", user=who, model_id=model.id)
            repo.mark_running(s, sc.id, worker_host=f"host-{who}", device=device, torch_version="2.13.0")
            repo.save_score(s, job_id=sc.id, model_id=model.id, plan_id=None, plan_label=scheme,
                            plan_body={"default": scheme}, dataset="builtin:lee.cor",
                            report={"kl_mean": kl, "kl_mean_err": kl / 10, "kl_p50": kl / 2, "kl_p90": kl,
                                    "kl_p99": kl * 4, "kl_max": kl * 20, "top1_agree": 0.95, "top1_agree_err": 0.004,
                                    "ppl_ref": 18.0, "ppl": 18.4, "tokens": 1016})
            repo.finish_job(s, sc.id, status="succeeded", result={"kl_mean": kl})
        running = repo.create_job(s, kind="score", params={"scheme": "INT8_W8A8", "samples": 32, "seq_len": 256},
                                  queue="cpu", user="ada", model_id=model.id)
        repo.mark_running(s, running.id, worker_host="host-a", device="cpu", torch_version="2.13.0")
        repo.report_progress(s, running.id, 0.4, RUNNING_MESSAGE)
        ids["running"] = running.id
    # the calibration ran 20 s: the form's estimate reads that rate (2,048 tokens in 20 s)
    from sqlalchemy import update

    from store import models as m

    start = dt.datetime.now(dt.UTC).replace(tzinfo=None) - dt.timedelta(minutes=12)
    with session_scope(settings) as s:
        s.execute(update(m.Job).where(m.Job.id == ids["calibrated"])
                  .values(created_at=start, started_at=start, finished_at=start + dt.timedelta(seconds=20)))
    from quantplan.services import plans as plans_svc

    plans_svc.save_plan(ids["model"], "mixed", {"default": "FP8_DYNAMIC",
                                                "rules": [{"match": "lm_head", "scheme": "BF16"}]})
    return ids



def _fits(page, table, columns: list[str]) -> None:
    """``table`` (a Streamlit dataframe or data editor) shows ``columns`` first, in this order, and needs no sideways
    scroll at this window: every key column lies within the table and the table within the viewport."""
    headers = [h.inner_text() for h in table.locator("[role='columnheader']").all()]
    assert headers[: len(columns)] == columns, headers
    scroll, client, right = table.evaluate(
        "e => { const s = e.querySelector('.dvn-scroller');"
        " return [s.scrollWidth, s.clientWidth, e.getBoundingClientRect().right]; }")
    assert scroll <= client + 1, f"{columns}: {scroll} px of columns in {client} px: a key column is cut off"
    assert right <= WIDTH, f"the table ends at {right} px, past the {WIDTH} px window"


def _cells(table, column: int) -> list[str]:
    """The text of every drawn row's cell in ``column`` (1-based, after the selection column)."""
    return [c.inner_text() for c in table.locator(f"td[aria-colindex='{column}']").all()]


def _select_row(page, table, row: int) -> None:
    """Tick the selection box of ``row`` (0-based): the grid draws on a canvas, so click where the box is."""
    box = table.bounding_box()
    page.mouse.click(box["x"] + 15, box["y"] + ROW_PX * (row + 1.5))


def _settle(page) -> None:
    page.wait_for_load_state("networkidle")
    settle(page)  # a rerun the last click asked for has run and drawn, not only not yet started
    assert page.locator("[data-testid='stException']").count() == 0


def test_tables_fit_jobs_say_how_long_the_rules_editor_explains_and_forms_remember(app_url, qp_settings, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (./dev.sh test installs it)")
    from playwright.sync_api import expect, sync_playwright

    from app.frames import JOB_KEY_COLUMNS, SCORE_KEY_COLUMNS

    ids = _seed(qp_settings)
    shots = tmp_path / "screens"
    shots.mkdir()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        page.set_default_timeout(PAGE_TIMEOUT_MS)
        expect.set_options(timeout=PAGE_TIMEOUT_MS)  # a state the database already holds: only the drawing waits
        try:
            _jobs(page, expect, app_url, ids, shots)
            _results(page, expect, shots)
            _plans(page, expect, shots)
            _forms(page, expect)
        finally:
            expect.set_options(timeout=5_000)  # Playwright's default, for the tests after this one
            browser.close()
    print(f"\nscreenshots of every table at {WIDTH} x {HEIGHT}: {shots}")
    assert {f.name for f in shots.iterdir()} >= {"jobs.png", "results.png", "plans-rules.png"}
    assert JOB_KEY_COLUMNS and SCORE_KEY_COLUMNS


def _jobs(page, expect, app_url: str, ids: dict[str, int], shots: Path) -> None:
    """Jobs: the key columns fit; ended jobs read their final state, the running one its count and time left; every
    age reads "… ago"; a selected row's details give its times in UTC on hover."""
    from app.frames import JOB_KEY_COLUMNS

    page.goto(f"{app_url}/jobs?model={ids['model']}")
    table = page.get_by_test_id("stDataFrame").first
    expect(table.locator("td", has_text="failed after")).to_have_count(1)
    _settle(page)
    _fits(page, table, JOB_KEY_COLUMNS)
    job_ids = [int(t) for t in _cells(table, 1)]
    progress = dict(zip(job_ids, _cells(table, JOB_KEY_COLUMNS.index("progress") + 1), strict=True))
    assert progress[ids["failed"]].startswith("failed after") and "%" not in progress[ids["failed"]]
    assert progress[ids["cancelled"]].startswith("cancelled after") and "%" not in progress[ids["cancelled"]]
    assert progress[ids["calibrated"]] == "done in 20 s"
    assert progress[ids["running"]] == "40% · about 40 s left · scoring: 12 of 32 sequences (whole model)"
    ages = _cells(table, JOB_KEY_COLUMNS.index("age") + 1)
    assert all(a.endswith(" ago") or a == "just now" for a in ages), ages
    assert dict(zip(job_ids, ages, strict=True))[ids["calibrated"]] == "12 min ago"
    # the running job's card: a bar with its count and time left; no card, no bar, for an ended one
    expect(page.get_by_test_id("stProgress").get_by_text(RUNNING_MESSAGE)).to_be_visible()
    assert page.get_by_test_id("stProgress").count() == 1
    table.screenshot(path=str(shots / "jobs-table.png"))
    page.screenshot(path=str(shots / "jobs.png"), full_page=True)
    _select_row(page, table, job_ids.index(ids["calibrated"]))
    when = page.locator("span[title$=' UTC']", has_text="12 min ago")  # created, started, finished
    expect(when.first).to_be_visible()  # the details: relative, the UTC time on hover
    assert when.count() == 3 and when.first.get_attribute("title").startswith(f"{dt.datetime.now(dt.UTC):%Y-}")
    expect(page.get_by_text("worker host-a · device cpu")).to_be_visible()
    page.screenshot(path=str(shots / "jobs-details.png"), full_page=True)


def _results(page, expect, shots: Path) -> None:
    """Results: the scores' key columns fit, "when" reads "… ago", who asked and where it ran are in view; a selected
    row shows the rest."""
    from app.frames import SCORE_KEY_COLUMNS

    page.get_by_test_id("stSidebarNav").get_by_text("Results").click()
    table = page.get_by_test_id("stDataFrame").filter(has=page.locator("[role='columnheader']", has_text="KL ± error"))
    expect(table.first).to_be_visible()
    _settle(page)
    table = table.first
    table.scroll_into_view_if_needed()
    _fits(page, table, SCORE_KEY_COLUMNS)
    assert _cells(table, SCORE_KEY_COLUMNS.index("asked by") + 1) == ["bob", "ada"]  # newest first
    assert _cells(table, SCORE_KEY_COLUMNS.index("device") + 1)[0].startswith("cuda (NVIDIA H100")
    assert all(w.endswith(" ago") or w == "just now" for w in _cells(table, SCORE_KEY_COLUMNS.index("when") + 1))
    table.screenshot(path=str(shots / "results-table.png"))
    page.screenshot(path=str(shots / "results.png"), full_page=True)
    _select_row(page, table, 0)
    expect(page.locator("span[title$=' UTC']").first).to_be_visible()
    expect(page.get_by_text("#5 W4A16", exact=False).first).to_be_visible()


def _plans(page, expect, shots: Path) -> None:
    """Plans: the rules editor offers the model's patterns with their counts, picks a scheme described by family, adds
    the rule, and reads every row back with the layers it matches; the preset explainer opens from the editor."""
    page.get_by_test_id("stSidebarNav").get_by_text("Plans").click()
    page.get_by_text("Start from").wait_for()
    _settle(page)
    page.get_by_role("combobox", name="Start from").click()
    page.get_by_role("option", name="mixed").click()
    _settle(page)
    layers = page.get_by_role("combobox", name="Layers (a pattern of this model, or type one)")
    layers.click()
    downs = sum(lin["name"].endswith("down_proj") for lin in smol_linears())
    page.get_by_role("option", name=f"down_proj ({downs} layers)").click()
    _settle(page)
    expect(page.get_by_text(f"down_proj matches {downs} of {len(smol_linears())} layers")).to_be_visible()
    scheme = page.get_by_role("combobox", name="Scheme", exact=True)
    scheme.click()  # grouped by family, each with its description: FP8 first, ..., BF16 (keep) last
    expect(page.get_by_role("option").first).to_have_text(
        "FP8 · FP8: FP8 E4M3, per-tensor weights, static per-tensor activations (calibrated amax)")
    scheme.fill("W4A16_G32")  # the list filters as one types
    expect(page.get_by_role("option", name="weight-only · W4A16_G32: INT4 weights in groups of 32",
                            exact=False).first).to_be_visible()
    scheme.fill("INT8_W8A8")
    page.get_by_role("option", name="INT8 · INT8_W8A8: INT8, per-channel weights", exact=False).first.click()
    _settle(page)
    page.get_by_role("button", name="Add rule").click()
    _settle(page)
    read = page.get_by_test_id("stDataFrame").filter(has=page.locator("[role='columnheader']", has_text="state"))
    expect(read.locator("td", has_text="down_proj")).to_have_count(1)
    _fits(page, read.first, ["row", "match", "scheme", "layers", "state"])
    assert _cells(read.first, 5) == ["in the plan", "in the plan"]
    assert _cells(read.first, 4) == ["1", str(downs)]
    assert page.get_by_test_id("stAlertContentWarning").count() == 0
    editor = page.get_by_test_id("stDataFrame").filter(has=page.locator("[role='columnheader']", has_text="match"))
    _fits(page, editor.first, ["match", "scheme"])
    editor.first.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "plans-rules.png"))
    explainer = page.get_by_test_id("stExpander").filter(has_text="Schemes explained")
    explainer.locator("summary").click()
    tabs = explainer.get_by_role("tab")
    expect(tabs.first).to_have_text("FP8")
    assert tabs.all_inner_texts() == ["FP8", "INT8", "FP4", "weight-only", "keep"]
    fp8 = explainer.get_by_test_id("stTable").first
    expect(fp8.get_by_text("FP8_DYNAMIC", exact=True)).to_be_visible()
    heads = [h.strip() for h in fp8.locator("thead th").all_inner_texts()]
    assert heads == ["scheme", "description", "weights", "activations", "granularity", "storage bits", "native on"]
    expect(fp8.get_by_text("FP8 E4M3, per-channel weights, dynamic per-token activations; no calibration")
           ).to_be_visible()
    scroll, client, right = fp8.evaluate("e => [e.scrollWidth, e.clientWidth, e.getBoundingClientRect().right]")
    assert scroll <= client + 1 and right <= WIDTH, (scroll, client, right)  # the whole row in view: text wraps
    fp8.screenshot(path=str(shots / "plans-schemes.png"))
    tabs.get_by_text("keep").click()
    expect(explainer.get_by_test_id("stTable").get_by_text("left unquantized")).to_be_visible()


def _forms(page, expect) -> None:
    """Models: the calibration form says what it will cost from the rate measured on the past calibration (2,048
    tokens in 20 s), and opens on what it queued after a visit to another page."""
    page.get_by_test_id("stSidebarNav").get_by_text("Models").click()
    page.get_by_text("Queue calibration").wait_for()
    _settle(page)
    expect(page.get_by_text("8,192 tokens; about 80 s on cpu (measured on 1 past calibrate job of this model",
                            exact=False)).to_be_visible()
    sequences = page.get_by_label("Sequences", exact=True)
    sequences.fill("24")
    page.get_by_role("button", name="Queue calibration").click()
    expect(page.get_by_text("Queued calibration job #", exact=False)).to_be_visible()
    page.get_by_test_id("stSidebarNav").get_by_text("Jobs").click()
    page.get_by_test_id("stDataFrame").first.wait_for()
    page.get_by_test_id("stSidebarNav").get_by_text("Models").click()
    page.get_by_text("Queue calibration").wait_for()
    _settle(page)
    expect(page.get_by_label("Sequences", exact=True)).to_have_value("24")
    expect(page.get_by_text("6,144 tokens; about 60 s on cpu", exact=False)).to_be_visible()
