"""The Compare page in headless Chromium against the running app: a link naming two scores and two calibrations
draws every tab (tables, charts with their legend, the outlier drift) without an exception. Rows as the jobs store
them (nothing runs); screenshots of each tab are saved under the test's tmp folder (the path is printed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quantcore.evaluation.stats import HIST_BINS, LayerStats
from store import repo
from store.db import session_scope
from tests.e2e.browser import CHROMIUM, CHROMIUM_ARGS, PAGE_TIMEOUT_MS
from tests.factories import stored_model

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.slow]

LAYERS = [f"model.layers.{b}.{p}" for b in range(2) for p in ("self_attn.q_proj", "mlp.down_proj")]


def _seed() -> list[int]:
    """Two scores of one model on the same tokens, and the calibrations of a base and a fine-tune whose q_proj
    outlier moved from channel 3 to 11: their job ids."""
    ids = []
    with session_scope() as s:
        base, tuned = stored_model(s, "base").id, stored_model(s, "tuned").id
        for label, seq in (("FP8_DYNAMIC", [0.01, 0.02, 0.03, 0.04]), ("INT8_W8A8", [0.02, 0.025, 0.04, 0.05])):
            job = repo.create_job(s, kind="score", params={"scheme": label}, queue="cpu", user="ann", model_id=base)
            kl = float(np.mean(seq))
            repo.save_score(s, job_id=job.id, model_id=base, plan_id=None, plan_label=label,
                            plan_body={"default": label}, dataset="builtin:lee.cor", report={
                                "kl_mean": kl, "kl_p50": kl, "kl_p90": kl, "kl_p99": kl, "kl_max": kl,
                                "top1_agree": 0.9, "ppl_ref": 10.0, "ppl": 10.2, "tokens": 60,
                                "kl_mean_err": float(np.std(seq, ddof=1) / 2), "sequences": 4, "eval_key": "k",
                                "kl_by_sequence": seq})
            repo.finish_job(s, job.id, status="succeeded")
            ids.append(job.id)
        for model, channel in ((base, 3), (tuned, 11)):
            job = repo.create_job(s, kind="calibrate", params={"samples": 4}, queue="cpu", user="ann",
                                  model_id=model)
            stats = []
            for name in LAYERS:
                cm = np.ones(32, dtype=np.float32)
                cm[channel if "q_proj" in name else 7] = 60.0 if "q_proj" in name else 20.0 * (1 + (channel > 3))
                stats.append(LayerStats(name=name, in_features=32, out_features=16, n_tokens=64, channel_max=cm,
                                        weight_channel_max=np.full(32, 0.1, np.float32),
                                        hist_counts=np.zeros(HIST_BINS, np.int64)))
            repo.save_activation_stats(s, job_id=job.id, model_id=model, stats=stats)
            repo.finish_job(s, job.id, status="succeeded")
            ids.append(job.id)
    return ids



def _settle(page) -> None:
    page.wait_for_load_state("networkidle")
    for _ in range(150):  # Streamlit shows a running indicator while the script runs
        if page.locator("[data-testid='stStatusWidget']").count() == 0:
            break
        page.wait_for_timeout(200)
    assert page.locator("[data-testid='stException']").count() == 0


def test_a_link_draws_every_tab_of_the_comparison(app_url, qp_settings, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (./dev.sh test installs it)")
    from playwright.sync_api import expect, sync_playwright

    a, b, ca, cb = _seed()
    shots = tmp_path / "screens"
    shots.mkdir()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(PAGE_TIMEOUT_MS)
        expect.set_options(timeout=PAGE_TIMEOUT_MS)
        try:
            page.goto(f"{app_url}/compare?jobs={a},{b},{ca},{cb}")
            expect(page.get_by_role("heading", name="Compare")).to_be_visible()
            _settle(page)
            expect(page.get_by_text(f"#{b} score · base · INT8_W8A8").first).to_be_visible()
            page.screenshot(path=str(shots / "parameters.png"), full_page=True)
            for tab, shown in (("Metrics", "kl_mean"), ("Differences", "Solid: the error as measured"),
                               ("Per layer", "Outlier ratio of each layer's input"),
                               ("Outlier drift", "recalibrate on tuned")):
                page.get_by_role("tab", name=tab).click()
                _settle(page)
                expect(page.get_by_text(shown).first).to_be_visible()
                page.screenshot(path=str(shots / f"{tab.lower().replace(' ', '-')}.png"), full_page=True)
            drift_chart = page.locator("[data-testid='stVegaLiteChart']:visible").first
            expect(drift_chart).to_be_visible()
            drift_chart.scroll_into_view_if_needed()
            drift_chart.screenshot(path=str(shots / "drift-chart.png"))
            assert page.locator("[data-testid='stException']").count() == 0
        finally:
            expect.set_options(timeout=5_000)  # Playwright's default, for the tests after this one
            browser.close()
    print(f"\nscreenshots of each tab: {shots}")
