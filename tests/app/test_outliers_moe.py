"""The Outliers page's MoE section (issue 43): a block x expert heatmap of the calibration tokens routed to each
expert, with the experts below the threshold counted in its caption; nothing for a dense model's calibration."""

from __future__ import annotations

from tests.app.test_pages import _run

TITLE = "MoE experts: calibration tokens per expert"


def test_the_outliers_page_flags_experts_routed_too_few_calibration_tokens(seeded):
    from store import repo
    from store.db import session_scope

    at = _run("outliers", seeded.id)
    assert not at.exception and not any(h.value == TITLE for h in at.subheader)  # a dense model: no section
    experts = {f"model.layers.{b}.mlp.experts": {"tokens": 256, "top_k": 2, "counts": [200, 150, 100, 50, 5, 3, 4, 0],
                                                 "weight": [120.0, 80.0, 50.0, 20.0, 1.0, 1.0, 1.0, 0.0]}
               for b in range(2)}
    with session_scope() as s:
        stats = repo.load_activation_stats(s, repo.calibrations(s, seeded.id)[0].id)
        cal = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="t", model_id=seeded.id)
        repo.save_activation_stats(s, job_id=cal.id, model_id=seeded.id, stats=stats)
        repo.finish_job(s, cal.id, status="succeeded", result={"tokens": 256, "text": "t", "experts": experts})
    at = _run("outliers", seeded.id)
    assert not at.exception
    assert any(h.value == TITLE for h in at.subheader)
    assert any("8 of 16 experts were routed fewer than 32 tokens" in c.value
               and "model.layers.0.mlp.experts expert 4: 5" in c.value for c in at.caption)
