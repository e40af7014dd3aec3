"""The charts as a person sees them, in headless Chromium at 1400 x 1000 against the running app (issue #45, item 7):
a tooltip names its fields in words with their units (no ``median_channel_max``), the two versions of a plan compared
are drawn in two clearly distinct colours of the one palette, and no page shows an exception. The statistics and the
scores are rows written as their jobs store them (no worker: nothing is queued). Screenshots of every chart go to
QUANTPLAN_SCREENSHOTS where it is set."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from app.charts import base as chart_base
from store import repo
from store.db import session_scope
from tests.app.conftest import fake_stats
from tests.factories import SMOL_LAYERS, smol_linears

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.slow]

SHOTS = Path(os.environ["QUANTPLAN_SCREENSHOTS"]) if os.environ.get("QUANTPLAN_SCREENSHOTS") else None
DRAWN = "canvas, svg.marks"  # Vega draws a chart with few marks as SVG, one with many on a canvas
SETTLED = ("() => { const a = document.querySelector('[data-testid=\"stApp\"]');"
           " return a && a.getAttribute('data-test-script-state') === 'notRunning'"
           " && document.querySelectorAll('[data-testid=\"stVegaLiteChart\"]').length >= %d; }")


def _seed(settings) -> int:
    """A model with SmolLM2's linears, a calibration (a planted outlier), two versions of one plan and a score of
    each. Returns the model's id."""
    summary = {"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": SMOL_LAYERS,
               "num_params": 10_000_000, "dtype": "float32", "total_bytes": 40_000_000, "linears": smol_linears()}
    edges = list(np.concatenate([[0.0], np.geomspace(1e-6, 10, 41)]))
    with session_scope(settings) as s:
        model = repo.add_model(s, name="smol-charts", sha256="ef" * 32, source_kind="folder", source_name="x",
                               path="models/x", summary=summary, user="tester")
        cal = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="tester", model_id=model.id)
        repo.mark_running(s, cal.id, worker_host="h", device="cpu", torch_version="t")
        repo.save_activation_stats(s, job_id=cal.id, model_id=model.id, stats=fake_stats(np.random.default_rng(0)))
        repo.finish_job(s, cal.id, status="succeeded", result={"tokens": 256, "text": "builtin:lee_background.cor"})
        for version, kl in ((1, 0.05), (2, 0.02)):
            body = {"default": "FP8_DYNAMIC", "rules": [{"match": "lm_head", "scheme": "BF16"}] * version}
            plan = repo.save_plan(s, model_id=model.id, name="fp8", body=body, user="tester")
            job = repo.create_job(s, kind="score", params={}, queue="cpu", user="tester", model_id=model.id,
                                  plan_id=plan.id)
            repo.save_score(s, job_id=job.id, model_id=model.id, plan_id=plan.id, plan_label=plan.label,
                            plan_body=body, dataset="builtin:lee.cor",
                            report={"kl_mean": kl, "kl_p50": kl / 2, "kl_p90": kl * 2, "kl_p99": kl * 5,
                                    "kl_max": kl * 20, "top1_agree": 0.9, "ppl_ref": 18.0, "ppl": 18.4,
                                    "tokens": 1000,
                                    "kl_by_position": [{"bucket_start": i * 16, "bucket_end": i * 16 + 16,
                                                        "kl_mean": kl * (1 + i / 4)} for i in range(8)],
                                    "kl_hist": {"edges": edges, "counts": [(i * version) % 7 for i in range(41)]}})
            repo.finish_job(s, job.id, status="succeeded", result={"kl_mean": kl})
    return model.id



def _open(page, url: str, charts: int) -> None:
    """Go to ``url`` and wait until its script has run and ``charts`` charts are drawn."""
    page.goto(url)
    page.wait_for_function(SETTLED % charts)
    exc = page.locator("[data-testid='stException']")
    assert exc.count() == 0, exc.first.inner_text()


def _shoot(page, name: str) -> None:
    if SHOTS:
        SHOTS.mkdir(parents=True, exist_ok=True)
        for i, chart in enumerate(page.locator("[data-testid='stVegaLiteChart']").all()):
            chart.scroll_into_view_if_needed()
            chart.locator(DRAWN).first.wait_for(state="attached")
            chart.screenshot(path=str(SHOTS / f"charts-{name}-{i}.png"))


def _tooltip_keys(page, chart, x: float, y: float) -> list[str]:
    """The field names of the tooltip Vega shows with the mouse at (x, y) of ``chart`` (shares of its box)."""
    chart.scroll_into_view_if_needed()
    chart.locator(DRAWN).first.wait_for(state="attached")  # a chart is drawn once it is in view
    box = chart.bounding_box()
    page.mouse.move(box["x"] + x * box["width"], box["y"] + y * box["height"])
    tip = page.locator("#vg-tooltip-element.visible")
    tip.wait_for()
    return [k.strip().rstrip(":") for k in tip.locator("td.key").all_inner_texts()]


def _overlapping_texts(chart) -> list[tuple[str, str]]:
    """Pairs of different texts of an SVG chart (the marks' and the axes' labels) whose boxes overlap (a text's white
    halo is the same text at the same place: not a pair)."""
    boxes = chart.evaluate("""el => [...el.querySelectorAll('svg.marks text')].map(t => {
        const b = t.getBoundingClientRect(); return [t.textContent, b.left, b.top, b.right, b.bottom]; })""")
    boxes = [b for b in boxes if b[0].strip()]  # Vega keeps empty texts for the log axis' unlabelled ticks
    pairs = []
    for i, (a, *ra) in enumerate(boxes):
        for b, *rb in boxes[i + 1:]:
            if a != b and ra[0] < rb[2] and rb[0] < ra[2] and ra[1] < rb[3] and rb[1] < ra[3]:
                pairs.append((a, b))
    return pairs


def _palette_pixels(png: bytes) -> dict[str, int]:
    """How many pixels of a screenshot are (within a small distance) each palette colour."""
    import io

    from PIL import Image

    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int32)
    out = {}
    for colour in chart_base.PALETTE[:3]:
        target = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
        out[colour] = int((np.abs(rgb - target).sum(axis=-1) < 40).sum())
    return out


def test_tooltips_name_fields_in_words_and_versions_compared_get_distinct_colours(app_url, page, qp_settings):
    model_id = _seed(qp_settings)

    # the page as it opens draws three charts: the overview, the layer's channels and the depth heatmap; SmoothQuant
    # and the sections below it are built once opened, as a person opens them
    _open(page, f"{app_url}/outliers?model={model_id}", charts=3)
    charts = page.locator("[data-testid='stVegaLiteChart']")
    assert charts.count() == 3
    page.locator("[data-testid='stExpander'] summary", has_text="Smooth this layer").click()
    page.wait_for_function(SETTLED % 5)  # + the SmoothQuant panels and "Choosing α"
    _shoot(page, "outliers")
    # the depth heatmap: every cell has a tooltip; the middle of the plot is a cell
    depth = charts.nth(2)
    keys = _tooltip_keys(page, depth, 0.5, 0.4)
    assert "max |x|" in keys and "block" in keys, keys
    assert not [k for k in keys if "_" in k], keys  # no raw column name
    # SmoothQuant at α = 0.5 (the slider's default), where the smoothed steps meet: every step named, no two names
    # over each other
    smooth = charts.nth(3)
    smooth.scroll_into_view_if_needed()
    smooth.locator("svg.marks").first.wait_for(state="attached")
    names = smooth.evaluate("el => [...el.querySelectorAll('svg.marks g.mark-text text')].map(t => t.textContent)")
    assert sum("INT8 step" in n for n in set(names)) == 4, names  # two tensors, before and after
    assert not _overlapping_texts(smooth)

    _open(page, f"{app_url}/results?model={model_id}", charts=2)
    _shoot(page, "results")
    # both versions compared by default (the newest scores): the KL-by-position lines of v1 and v2, each its own
    # palette colour (blue, orange: never two blues), with the legend beside the chart naming plan and version
    by_position = page.locator("[data-testid='stVegaLiteChart']").nth(1)
    by_position.scroll_into_view_if_needed()
    by_position.locator(DRAWN).first.wait_for(state="attached")
    seen = _palette_pixels(by_position.screenshot())
    blue, orange = chart_base.PALETTE[:2]
    assert seen[blue] > 50 and seen[orange] > 50, seen
    legend = by_position.evaluate(
        "el => [...el.querySelectorAll('svg.marks g.role-legend text')].map(t => t.textContent)")
    assert "score (plan and version)" in legend and any("fp8 v1" in t for t in legend) \
        and any("fp8 v2" in t for t in legend), legend
