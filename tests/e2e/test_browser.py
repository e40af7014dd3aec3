"""A person's first visit, in headless Chromium against the running app and a real worker:
register the demo model → calibrate → Outliers shows the chart, and no page shows an exception."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from store import repo
from store.db import session_scope
from tests.e2e.browser import PAGE_TIMEOUT_MS, no_exception, screenshot
from tests.factories import Proc, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.slow]

JOB_DEADLINE_S = 1200.0  # how long a job may take on a loaded 2-core machine (the worker runs one job at a time)


@pytest.fixture
def app_url(qp_settings, worker, tmp_path, monkeypatch):
    port = free_port()
    env = dict(os.environ, QUANTPLAN_UI_PORT=str(port))
    proc = Proc([sys.executable, "-m", "quantplan", "app"], env, tmp_path / "app.log")
    try:
        proc.wait_for("URL: http", timeout=300)  # a busy machine starts Streamlit slowly
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def _settle(page, seconds: float = 2.0) -> None:
    page.wait_for_load_state("networkidle")
    page.wait_for_timeout(int(seconds * 1000))
    # Streamlit shows a running indicator while the script runs
    for _ in range(100):
        if page.locator("[data-testid='stStatusWidget']").count() == 0:
            break
        page.wait_for_timeout(200)




def _newest_job_id(settings) -> int:
    """The id of the newest job row (0 for none): a job queued after this call has a larger one."""
    with session_scope(settings) as s:
        jobs = repo.list_jobs(s, limit=1)
    return jobs[0].id if jobs else 0


def _wait_job(settings, kind: str, *, after: int = 0, timeout: float = JOB_DEADLINE_S):
    """The first ``kind`` job queued after job ``after``, once its row says it finished (succeeded, else the
    test fails with its error): the state a page's next words depend on, polled with a generous overall deadline
    whatever else the worker has to run first (a job queued before it runs first)."""
    deadline = time.monotonic() + timeout
    job = None
    while time.monotonic() < deadline:
        with session_scope(settings) as s:
            jobs = [j for j in repo.list_jobs(s, kind=kind, limit=50) if j.id > after]
        job = min(jobs, key=lambda j: j.id) if jobs else None
        if job is not None and job.finished:
            assert job.status == "succeeded", job.error
            return job
        time.sleep(1)
    raise TimeoutError(f"no {kind} job queued after #{after} finished within {timeout:.0f} s; last seen: {job}")


def test_first_visit_demo_to_outliers(app_url, page, qp_settings, tmp_path):
    from playwright.sync_api import expect

    from tests.factories import save_tiny_llama

    page.goto(app_url + "/")  # Models is the default page: it lives at the root URL
    _settle(page)
    no_exception(page)
    page.get_by_role("button", name="Register the demo model").click()
    _wait_job(qp_settings, "register")
    # no reload: the page follows its job and redraws itself when it ends
    expect(page.get_by_text("is done: registered SmolLM2-135M-Instruct")).to_be_visible()
    _settle(page)
    no_exception(page)
    assert page.get_by_text("SmolLM2-135M-Instruct").count() > 0
    screenshot(page, "01-models")

    # a small calibration: 4 sequences of 64 tokens
    page.get_by_label("Sequences").fill("4")
    page.get_by_label("Tokens per sequence", exact=True).fill("64")  # not its help button
    before = _newest_job_id(qp_settings)
    page.get_by_role("button", name="Queue calibration").click()
    _settle(page)
    no_exception(page)
    _wait_job(qp_settings, "calibrate", after=before)

    for path in ("/jobs", "/outliers", "/plans", "/results", "/kernels", "/models"):
        page.goto(app_url + path)
        _settle(page, 3)
        no_exception(page)
        assert "Page not found" not in page.inner_text("body"), path
        screenshot(page, path.strip("/"))
        if path == "/outliers":
            charts = page.locator("[data-testid='stVegaLiteChart']")
            # waited for, not counted after a fixed wait: a loaded CI machine once read the page before it drew any
            expect(charts.nth(1)).to_be_attached(timeout=PAGE_TIMEOUT_MS)  # the overview and the channels chart
            assert page.get_by_text("model.layers.11.mlp.down_proj").count() > 0
        if path == "/models":  # the address a person may type: the Models page at the root, the model kept
            assert page.url.startswith(app_url + "/?model=")
            assert page.get_by_text("Register a model").count() > 0

    # Results: a calibration text uploaded with the score it is for; the queued job names it
    cal_text = tmp_path / "domain.txt"
    cal_text.write_text("\n\n".join(f"Serving-domain document {i}: what the deployed model will read."
                                   for i in range(30)))
    page.goto(app_url + "/results")
    _settle(page)
    page.get_by_text("Texts: what is scored").click()
    _settle(page, 1)
    page.locator("[data-testid='stFileUploaderDropzoneInput']").first.set_input_files(str(cal_text))
    _settle(page)
    page.get_by_label("Calibration sequences").fill("2")
    page.get_by_label("Sequences", exact=True).fill("2")  # a short score: the worker has the upload to register next
    page.get_by_label("Tokens each").first.fill("32")
    page.get_by_role("button", name="Queue").click()
    expect(page.get_by_text("Queued score job")).to_be_visible()
    no_exception(page)
    with session_scope(qp_settings) as s:
        (ds,) = [d for d in repo.list_datasets(s) if d.name == "domain.txt"]
        (job,) = [j for j in repo.list_jobs(s) if j.kind == "score"]
    assert ds.role == "calibration" and (job.params["cal_dataset"], job.params["cal_samples"]) == (ds.id, 2)
    assert (job.params["samples"], job.params["seq_len"]) == (2, 32)
    screenshot(page, "results-calibration-upload")

    # an upload through the browser's file picker: a zipped Hugging Face folder
    archive = shutil.make_archive(str(tmp_path / "tiny-llama"), "zip",
                                  save_tiny_llama(tmp_path / "up" / "tiny-llama").parent)
    page.goto(app_url + "/")
    _settle(page)
    page.locator("[data-testid='stFileUploaderDropzoneInput']").first.set_input_files(archive)
    _settle(page)
    page.get_by_label("Name (optional)").fill("tiny-upload")
    page.keyboard.press("Tab")
    _settle(page)
    before = _newest_job_id(qp_settings)
    page.get_by_role("button", name="Register upload").click()
    # the worker runs the score queued above first: wait for the registration's row, however long that takes,
    # then for the page, which follows the job, to say so
    registered = _wait_job(qp_settings, "register", after=before)
    assert registered.result["name"] == "tiny-upload"
    expect(page.get_by_text("is done: registered tiny-upload")).to_be_visible()
    no_exception(page)
    with session_scope(qp_settings) as s:
        assert "tiny-upload" in [m.name for m in repo.list_models(s)]
    screenshot(page, "02-upload")

    # remove it again on its page: the sidebar moves to the model that is left, not the removed one
    with session_scope(qp_settings) as s:
        models = {m.name: m for m in repo.list_models(s)}
    tiny, smol = models["tiny-upload"], models["SmolLM2-135M-Instruct"]

    # Results: the score queued above (it ran before the upload's registration), its KL with its error
    scored = _wait_job(qp_settings, "score")
    page.goto(app_url + f"/results?model={smol.id}")
    _settle(page)
    no_exception(page)
    kl = f"{scored.result['kl_mean']:.4g} ± {scored.result['kl_mean_err']:.2g}"
    expect(page.get_by_text(f"KL {kl}").first).to_be_visible()  # the compared score's metric, ± one error
    screenshot(page, "results-statistics")

    page.goto(app_url + f"/?model={tiny.id}")
    _settle(page)
    sidebar_model = page.locator("[data-testid='stSidebar'] [data-testid='stSelectbox'] input").first
    assert sidebar_model.input_value() == f"#{tiny.id} tiny-upload"
    page.get_by_text("Remove tiny-upload").first.click()
    _settle(page, 1)
    page.get_by_text("Yes, remove tiny-upload").first.click()
    _settle(page, 1)
    page.get_by_role("button", name="Remove model").click()
    _settle(page, 3)
    no_exception(page)
    expect(page.get_by_test_id("stAlertContentSuccess").get_by_text("Removed tiny-upload")).to_be_visible()
    expect(page.get_by_test_id("stToastText").get_by_text("Removed tiny-upload")).to_be_visible()
    assert sidebar_model.input_value() == f"#{smol.id} SmolLM2-135M-Instruct"
    assert not (Path(qp_settings.artifact_dir) / tiny.path).exists()
    screenshot(page, "03-removed")
