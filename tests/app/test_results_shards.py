"""The Results page's "Sweep shards" input reaches the sweeps it queues (jobs.shards)."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")


def _results(model_id: int) -> AppTest:
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["model_id"] = model_id
    at.session_state["results_score_open"] = True  # the score form, built once opened (the model has a score)
    at.run()
    at.switch_page("views/results.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_the_shards_asked_on_the_results_page_split_its_sweeps(seeded, qp_settings):
    from quantplan.services import jobs as jobs_svc
    from store import shards as shard_rows
    from store.db import session_scope

    at = _results(seeded.id)
    at.multiselect(key=f"score_what_{seeded.id}").set_value(["preset:INT8_W8A8"])
    at.checkbox(key="score_sens").check()
    at.number_input(key="score_shards").set_value(2)
    at.button[0].click().run()
    assert not at.exception, [e.value for e in at.exception]
    (sweep,) = [j for j in jobs_svc.list_jobs(limit=10) if j.kind == "sensitivity" and j.status == "queued"]
    assert sweep.params["shards"] == 2
    with session_scope(qp_settings) as s:
        assert [sh.job.params["shard"] for sh in shard_rows.shards_of(s, sweep.id)] == [[0, 2], [1, 2]]


def test_shards_left_at_0_take_one_per_live_worker(seeded):
    from quantplan.services import jobs as jobs_svc

    at = _results(seeded.id)
    at.multiselect(key=f"score_what_{seeded.id}").set_value(["preset:INT8_W8A8"])
    at.checkbox(key="score_sens").check()
    at.button[0].click().run()
    (sweep,) = [j for j in jobs_svc.list_jobs(limit=10) if j.kind == "sensitivity" and j.status == "queued"]
    assert "shards" not in sweep.params  # no live worker here: one task, today's sweep
