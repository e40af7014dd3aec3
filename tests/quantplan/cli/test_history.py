"""`quantplan history` (issue 44, item 4): the History page's table in a terminal and as JSON, with the same
filters and sort; `quantplan history show ID`: one run in full; bad input refused naming the option."""

from __future__ import annotations

from store import repo, team
from store.db import session_scope
from tests.factories import run_cli, run_cli_json

SUMMARY = {"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 1, "num_params": 1000,
           "dtype": "float32", "total_bytes": 4000, "linears": []}


def _seed(settings) -> dict[str, int]:
    with session_scope(settings) as s:
        model = repo.add_model(s, name="tiny", sha256="d" * 64, source_kind="folder", source_name="tiny",
                               path="models/tiny", summary=SUMMARY, user="ann")
        sc = repo.create_job(s, kind="score", params={"scheme": "FP8_DYNAMIC"}, queue="cpu", user="ann",
                             model_id=model.id)
        repo.mark_running(s, sc.id, worker_host="h1", device="cpu", torch_version="2.9")
        repo.save_score(s, job_id=sc.id, model_id=model.id, plan_id=None, plan_label="FP8_DYNAMIC",
                        plan_body={"default": "FP8_DYNAMIC"}, dataset="builtin:lee.cor",
                        report={"kl_mean": 0.02, "kl_p50": 0.01, "kl_p90": 0.05, "kl_p99": 0.2, "kl_max": 1.0,
                                "top1_agree": 0.95, "ppl_ref": 18.0, "ppl": 18.4, "tokens": 1000,
                                "kl_mean_err": 0.001})
        repo.finish_job(s, sc.id, status="succeeded", result={"kl_mean": 0.02})
        bench = repo.create_job(s, kind="bench", params={"device": "cpu"}, queue="cpu", user="bob")
        repo.finish_job(s, bench.id, status="failed", error="no kernel path here")
        team.add_note(s, author="ann", target_kind="job", target_id=sc.id, text="baseline", tags=["shipped"])
    return {"score": sc.id, "bench": bench.id}


def test_history_lists_filters_and_sorts_runs(qp_settings, capsys):
    runs = _seed(qp_settings)
    everything = run_cli_json(capsys, "history", "--json")
    assert (everything["total"], [r["id"] for r in everything["runs"]]) == (2, [runs["bench"], runs["score"]])
    score = everything["runs"][1]
    assert (score["person"], score["model"], score["scheme"], score["worker"], score["tags"]) == (
        "ann", "tiny", "FP8_DYNAMIC", "h1", ["shipped"])
    assert score["headline"] == "KL 0.02 ± 0.001 · top-1 0.9500" and score["notes"] == ["ann: baseline"]
    assert [r["id"] for r in run_cli_json(capsys, "history", "--person", "bob", "--json")["runs"]] == [runs["bench"]]
    assert [r["id"] for r in run_cli_json(capsys, "history", "--tag", "shipped", "--json")["runs"]] == [runs["score"]]
    assert [r["id"] for r in run_cli_json(capsys, "history", "--device", "cpu", "--json")["runs"]] == [runs["score"]]
    assert [r["id"] for r in run_cli_json(capsys, "history", "--sort", "id", "--ascending", "--json")["runs"]] == [
        runs["score"], runs["bench"]]
    assert run_cli_json(capsys, "history", "--search", "kernel", "--json")["runs"][0]["error"] == "no kernel path here"
    code, out, err = run_cli(capsys, "history", "--kind", "score")
    assert code == 0, err
    [line] = out.strip().splitlines()
    assert line.startswith(f"#{runs['score']}") and "ann" in line and "KL 0.02 ± 0.001" in line and "#shipped" in line
    page = run_cli_json(capsys, "history", "--limit", "1", "--page", "2", "--json")
    assert (page["pages"], [r["id"] for r in page["runs"]]) == (2, [runs["score"]])


def test_history_show_prints_one_run_in_full(qp_settings, capsys):
    runs = _seed(qp_settings)
    shown = run_cli_json(capsys, "history", "show", str(runs["score"]), "--json")
    assert (shown["kind"], shown["model"], shown["person"], shown["software"]) == ("score", "tiny", "ann", None)
    assert shown["score"]["kl_mean"] == 0.02 and shown["score"]["kl_mean_err"] == 0.001
    assert shown["parameters"] == {"scheme": "FP8_DYNAMIC"} and shown["notes"][0]["tags"] == ["shipped"]
    code, out, err = run_cli(capsys, "history", "show", str(runs["score"]))
    assert code == 0, err
    assert "software: quantplan not recorded" in out and "KL 0.02 ± 0.001" in out


def test_bad_history_input_is_refused_naming_the_option(qp_settings, capsys):
    code, _, err = run_cli(capsys, "history", "--since", "yesterday")
    assert code == 1 and "since: 'yesterday' is not a date; write it as YYYY-MM-DD" in err
    code, _, err = run_cli(capsys, "history", "--limit", "0")
    assert code == 1 and "page size: 0 runs; a page holds 1 to 500" in err
    code, _, err = run_cli(capsys, "history", "show")
    assert code == 1 and "say which run: quantplan history show ID" in err
    code, _, err = run_cli(capsys, "history", "show", "77")
    assert code == 1 and "no job #77" in err
