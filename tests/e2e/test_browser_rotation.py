"""The Outliers page's rotation what-if (issue #46) in headless Chromium against the running app: a tiny Llama
registered and calibrated by real jobs; on the page a person queues the rotated calibration with the button, the job
the page wrote runs (here, through the worker's own runner: no worker process to start, tests/e2e/test_browser.py
covers the page-to-worker path), and the page then shows the chosen layer's input before and after the rotation (chart
and table), what each format flushes under each fix, and the whole model ranked by the fix. Every wait polls a state,
none sleeps. Screenshots go to QUANTPLAN_SCREENSHOTS where it is set."""

from __future__ import annotations

import pytest

from quantplan.cli.common import run_job
from quantplan.cli.local import run_here
from store import repo
from store.db import session_scope
from tests.e2e.browser import PAGE_TIMEOUT_MS, no_exception, screenshot, settle
from tests.factories import save_tiny_llama

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.slow]

LAYER = "model.layers.1.mlp.down_proj"  # the tiny Llama's last down_proj: R4's Hadamard sits before it


@pytest.fixture
def calibrated(qp_settings, tmp_path) -> int:
    """A tiny Llama registered and calibrated by real jobs run in this process (`--local`); its id."""
    folder = save_tiny_llama(tmp_path / "tiny-llama")
    reg = run_job("register", {"source": str(folder), "name": "tiny"}, model_id=None, local=True, quiet=True)
    run_job("calibrate", {"samples": 2, "seq_len": 32, "device": "cpu"}, model_id=reg.result["model_id"],
            local=True, quiet=True)
    return reg.result["model_id"]


def _settled(page) -> None:
    page.wait_for_load_state("networkidle")
    settle(page)
    no_exception(page)




def _open_layer(page, app_url: str) -> None:
    """The Outliers page with the tiny model's last down_proj chosen."""
    page.goto(f"{app_url}/outliers")
    _settled(page)
    page.get_by_role("combobox", name="Layer", exact=True).click()
    page.get_by_role("option", name=LAYER, exact=True).click()
    _settled(page)


def _table(page, header: str):
    """The dataframe with a column headed ``header``."""
    return page.get_by_test_id("stDataFrame").filter(has=page.locator("[role='columnheader']", has_text=header)).first


def test_the_outliers_page_queues_a_rotated_calibration_and_shows_the_layer_before_and_after(
        calibrated, app_url, page, qp_settings):
    from playwright.sync_api import expect

    expect.set_options(timeout=PAGE_TIMEOUT_MS)
    charts = page.get_by_test_id("stVegaLiteChart")
    try:
        _open_layer(page, app_url)
        before = charts.count()  # the page without a rotated calibration
        page.get_by_role("button", name="Calibrate the rotated model (Hadamard R1 + R2 + R4)").click()
        expect(page.get_by_text("Queued job #")).to_be_visible()
        with session_scope(qp_settings) as s:
            (job,) = [j for j in repo.list_jobs(s, kind="calibrate", model_id=calibrated) if j.params.get("rotation")]
        assert job.params["rotation"] == {"kind": "hadamard", "rotations": ["R1", "R2", "R4"]}
        run_here(job, settings=qp_settings, on_progress=lambda fraction, message: None)  # as a worker runs it
        with session_scope(qp_settings) as s:
            job = repo.get_job(s, job.id)
        assert job.status == "succeeded", job.error

        _open_layer(page, app_url)  # a new session: the page as a person opens it after the job
        expect(charts).to_have_count(before + 1)  # the layer's channels as calibrated, smoothed and rotated
        expect(page.get_by_text(f"{LAYER}'s input as calibrated, smoothed")).to_be_visible()
        fixes = _table(page, "outlier ratio (max / median)")
        expect(fixes.locator("td", has_text="rotation")).to_have_count(1)
        expect(fixes.locator("td", has_text="SmoothQuant α=0.5")).to_have_count(1)

        page.get_by_text(f"What each format flushes or clips in {LAYER}, under each fix").click()
        _settled(page)
        breakage = _table(page, "channels flushed")
        expect(breakage.locator("td", has_text="rotation").first).to_be_attached()
        page.get_by_text("Whole model: where each fix helps most").click()
        _settled(page)
        expect(charts).to_have_count(before + 2)  # and every down_proj across depth, by fix
        expect(_table(page, "rotation's gain").locator("td").first).to_be_attached()
        screenshot(page, "rotation-outliers")
    finally:
        expect.set_options(timeout=5_000)
