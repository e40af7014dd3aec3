"""The History page and a run's own page (issue 44, item 4), drawn by AppTest on a seeded database: the table with
its headline figures, notes and tags, a filter (also from a link's address), a run's parameters, software (not
recorded for an old run), timings, score, its plan version's change from the parent, and its notes."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from store import repo, team
from store.db import session_scope

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")
LINEARS = [{"name": f"model.layers.0.{p}", "in_features": 64, "out_features": 64}
           for p in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")]


@pytest.fixture
def two_runs(qp_settings):
    """ann scored plan "fast" v2 (one layer kept in BF16 against v1) and tagged it; bob calibrated."""
    summary = {"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 1, "num_params": 12288,
               "dtype": "float32", "total_bytes": 49152, "linears": LINEARS}
    with session_scope(qp_settings) as s:
        model = repo.add_model(s, name="tiny", sha256="c" * 64, source_kind="folder", source_name="tiny",
                               path="models/tiny", summary=summary, user="ann")
        v1 = repo.save_plan(s, model_id=model.id, name="fast", body={"default": "FP8_DYNAMIC"}, user="ann")
        v2 = repo.save_plan(s, model_id=model.id, name="fast", user="ann", note="down_proj back to BF16",
                            body={"default": "FP8_DYNAMIC", "layers": {"model.layers.0.mlp.down_proj": "BF16"}})
        cal = repo.create_job(s, kind="calibrate", params={"samples": 4}, queue="cpu", user="bob",
                              model_id=model.id)
        repo.mark_running(s, cal.id, worker_host="h2", device="cpu", torch_version="2.9")
        repo.finish_job(s, cal.id, status="succeeded", result={"layers": 3, "top": [
            {"name": "model.layers.0.mlp.down_proj", "outlier_ratio": 640.0}]})
        sc = repo.create_job(s, kind="score", params={"samples": 4, "seq_len": 64}, queue="cpu", user="ann",
                             model_id=model.id, plan_id=v2.id)
        repo.mark_running(s, sc.id, worker_host="h1", device="cpu", torch_version="2.9")
        repo.save_score(s, job_id=sc.id, model_id=model.id, plan_id=v2.id, plan_label="fast v2",
                        plan_body=v2.body, dataset="builtin:lee.cor",
                        report={"kl_mean": 0.0123, "kl_p50": 0.01, "kl_p90": 0.02, "kl_p99": 0.05, "kl_max": 0.3,
                                "top1_agree": 0.97, "ppl_ref": 18.0, "ppl": 18.2, "tokens": 252,
                                "kl_mean_err": 0.0004})
        repo.finish_job(s, sc.id, status="succeeded", result={"kl_mean": 0.0123})
        team.add_note(s, author="ann", target_kind="job", target_id=sc.id, text="shipped to staging",
                      tags=["shipped"])
    return {"model": model, "v1": v1, "v2": v2, "cal": cal.id, "score": sc.id}


def _page(page: str, **query: str) -> AppTest:
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.run()
    for k, v in query.items():
        at.query_params[k] = v
    at.switch_page(f"views/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_the_history_lists_every_run_and_filters_by_person(two_runs):
    at = _page("history")
    table = at.dataframe[0].value.set_index("run")
    assert list(table.index) == [f"run?job={two_runs['score']}", f"run?job={two_runs['cal']}"]
    score = table.loc[f"run?job={two_runs['score']}"]
    assert (score["model"], score["plan"], score["person"], score["kind"]) == ("tiny", "fast v2", "ann", "score")
    assert score["headline"] == "KL 0.0123 ± 0.0004 · top-1 0.9700"
    assert (score["notes"], score["tags"]) == ("ann: shipped to staging", "shipped")
    assert table.loc[f"run?job={two_runs['cal']}", "headline"] == "3 layers · top outlier ×640 " \
                                                                     "model.layers.0.mlp.down_proj"
    at.selectbox(key="history_person").set_value("bob").run()
    assert list(at.dataframe[0].value["person"]) == ["bob"]
    at.selectbox(key="history_tag").set_value("shipped").run()
    assert any(i.value == "No run matches." for i in at.info)


def test_a_link_may_name_the_filter(two_runs):
    at = _page("history", person="ann", q="staging")
    assert list(at.dataframe[0].value["person"]) == ["ann"]
    assert at.text_input(key="history_text").value == "staging"


def test_a_runs_page_shows_its_parameters_software_timings_score_plan_change_and_notes(two_runs):
    at = _page("run", job=str(two_runs["score"]))
    assert at.title[0].value == f"Run #{two_runs['score']} · score · succeeded"
    software = at.table[0].value["version"]
    assert set(software) == {"not recorded"}  # a run from before the worker recorded it
    assert any(c.value.startswith("Not recorded: the run started before") for c in at.caption)
    timings = at.table[1].value["UTC / seconds"]
    assert timings["started"] != "never" and timings["ran"].endswith(" s")
    assert [m.value for m in at.metric][:2] == ["0.0123 ± 0.0004", "0.9700 ± —"]
    diff = at.dataframe[0].value
    assert list(diff.columns) == ["layer", "fast v1", "fast v2"]
    assert diff.to_dict("records") == [{"layer": "model.layers.0.mlp.down_proj", "fast v1": "FP8_DYNAMIC",
                                        "fast v2": "BF16"}]
    assert any(c.value == "1 layer(s) changed from fast v1: down_proj back to BF16." for c in at.caption)
    assert any(c.value == "No other score run to compare with yet." for c in at.caption)
    notes = at.dataframe[1].value
    assert list(notes["note"]) == ["shipped to staging"] and list(notes["by"]) == ["ann"]
    at.text_input(key="note_text").set_value("checked again")
    at.text_input(key="note_tags").set_value("ok")
    at.button(key="note_add").click().run()
    assert [s.value for s in at.success] == [f"Noted on job #{two_runs['score']} by tester."]


def test_a_run_compares_with_runs_of_its_kind(two_runs, qp_settings):
    with session_scope(qp_settings) as s:
        other = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="ann",
                                model_id=two_runs["model"].id)
    at = _page("run", job=str(two_runs["cal"]))
    picker = at.selectbox(key=f"run_compare_{two_runs['cal']}")
    assert picker.value == other.id
    assert any(c.value == "No stored plan version." for c in at.caption)
    links = [link.proto.label for link in at.get("page_link")]
    compare = f"Compare #{two_runs['cal']} with #{other.id}"
    assert compare in links or any(c.value == "The Compare page is not part of this app." for c in at.caption)


@pytest.mark.parametrize(("job", "said"), [
    ("", "Open a run from the History page (its address is /run?job=ID)."),
    ("abc", "job='abc' in the address is no run id: it is a number, as in /run?job=12."),
])
def test_a_run_page_without_a_run_says_how_to_open_one(qp_settings, job, said):
    at = _page("run", **({"job": job} if job else {}))
    assert [i.value for i in at.info] == [said]


def test_a_run_page_for_an_unknown_run_says_so(qp_settings):
    at = _page("run", job="4242")
    assert [e.value for e in at.error] == ["no job #4242: the address names a run this deployment does not have."]


def test_the_history_of_an_empty_deployment_says_so(qp_settings):
    at = _page("history")
    assert [i.value for i in at.info] == ["No run yet."]
