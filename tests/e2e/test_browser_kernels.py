"""The Kernels page in headless Chromium against the running app (issue #41, item 3): an unstable case is flagged
where a person reads it, and a step estimate that rests on fewer than all layers reads its coverage first, not a
headline figure. The timings are rows written into the database as a benchmark stores them (no worker: nothing is
queued)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quantcore.kernels.records import TIMING
from store import repo
from store.db import session_scope
from tests.e2e.browser import CHROMIUM, CHROMIUM_ARGS, PAGE_TIMEOUT_MS
from tests.factories import smol_linears

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.slow]

# read before the tests' fixtures clear QUANTPLAN_* from the environment, as tests/e2e/test_browser.py reads it
SHOTS = Path(os.environ["QUANTPLAN_SCREENSHOTS"]) if os.environ.get("QUANTPLAN_SCREENSHOTS") else None


def _seed(settings) -> tuple[int, str]:
    """A model with SmolLM2's linear layers and one benchmark of its shapes on "Test CPU" at M = 1 and 16: every
    case steady but down_proj's int8_row+q at M = 16 (unstable) and its fp8_row at M = 16 (skipped over budget).
    Returns the model's id and the unstable case as the page names it."""
    summary = {"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 30,
               "num_params": 10_000_000, "dtype": "float32", "total_bytes": 40_000_000, "linears": smol_linears()}
    down = next(lin for lin in smol_linears() if lin["name"].endswith("mlp.down_proj"))
    shaky = (16, down["out_features"], down["in_features"], "int8_row+q")
    over = (16, down["out_features"], down["in_features"], "fp8_row")
    with session_scope(settings) as s:
        model = repo.add_model(s, name="smol-shapes", sha256="cd" * 32, source_kind="folder", source_name="x",
                               path="models/x", summary=summary, user="tester")
        job = repo.create_job(s, kind="bench", params={"device": "cpu"}, queue="cpu", user=None)
        recs = []
        for n, k in {(lin["out_features"], lin["in_features"]) for lin in smol_linears()}:
            for m in (1, 16):
                for path in ("baseline", "int8_row+q", "fp8_row"):
                    case, base = (m, n, k, path), path == "baseline"
                    timed = case != over
                    recs.append(dict(
                        device="cpu", device_name="Test CPU", torch_version="2.13.0", m=m, n=n, k=k, path=path,
                        ms=(1.0 if base else 0.5) if timed else None, tflops=None, pct_peak=None,
                        speedup=(1.0 if base else 2.0) if timed else None, native=True, max_rel_err=None,
                        padded_m=None, timing=TIMING, skipped=None if timed else "over budget: ~9 s needed",
                        repeats=5 if timed else None, ms_p20=(0.2 if case == shaky else 0.49) if timed else None,
                        ms_p80=(0.9 if case == shaky else 0.51) if timed else None,
                        baseline_ms=None if base or not timed else 1.0,
                        baseline_ms_p20=None if base or not timed else 0.98,
                        baseline_ms_p80=None if base or not timed else 1.02,
                        unstable=(case == shaky) if timed else None))
        repo.save_kernel_results(s, job_id=job.id, records=recs)
        repo.finish_job(s, job.id, status="succeeded", result={"budget_s": 60.0})
    from quantplan.services import plans as plans_svc

    plans_svc.save_plan(model.id, "int8", {"default": "INT8_W8A8"})  # the page estimates the plan saved last
    return model.id, f"int8_row+q M=16 N={shaky[1]} K={shaky[2]}"



def test_the_kernels_page_flags_an_unstable_case_and_shows_a_partial_step_as_such(app_url, qp_settings):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (./dev.sh test installs it)")
    from playwright.sync_api import expect, sync_playwright

    model_id, shaky = _seed(qp_settings)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(PAGE_TIMEOUT_MS)
        expect.set_options(timeout=PAGE_TIMEOUT_MS)  # a state the database already holds: only the drawing waits
        try:
            _check_page(page, expect, app_url, model_id, shaky)
        finally:
            expect.set_options(timeout=5_000)  # Playwright's default, for the tests after this one
            browser.close()


def _check_page(page, expect, app_url: str, model_id: int, shaky: str) -> None:
    """What the Kernels page of the seeded model shows: the flag, the heatmap, the partial prefill step."""
    page.goto(f"{app_url}/kernels?model={model_id}")
    # the flag: a warning naming the case, and the table's column
    expect(page.get_by_text(f"1 case(s) UNSTABLE ({shaky}): the 20th-80th percentile band")).to_be_visible()
    assert page.locator("[data-testid='stException']").count() == 0
    expect(page.locator("[data-testid='stVegaLiteChart']").first).to_be_visible()  # the heatmap
    # the step of the INT8 plan: the unstable layers are left out of the prefill, which reads as partial
    layers = len(smol_linears())
    downs = sum(lin["name"].endswith("mlp.down_proj") for lin in smol_linears())
    expect(page.get_by_text(f"Prefill (M=16) covers {layers - downs} of {layers} layers: partial")).to_be_visible()
    expect(page.get_by_text(f"; {downs} left out as unstable")).to_be_visible()
    expect(page.get_by_text("left out as unstable (their timed calls spread too widely)")).to_be_visible()
    assert page.get_by_test_id("stMetricLabel").get_by_text("Prefill").count() == 0  # no headline figure
    expect(page.get_by_test_id("stMetricLabel").get_by_text("Decode (M=1)")).to_be_visible()
    if SHOTS:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "kernels-unstable.png"), full_page=True)
        page.locator("[data-testid='stVegaLiteChart']").first.screenshot(path=str(SHOTS / "kernels-heatmap.png"))
