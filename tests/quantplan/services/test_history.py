"""The team's history (issue 44, item 4): every run in one table, filtered by person, model, plan, kind, device,
tag, dates and words, sorted by any column, paged; read in a fixed number of bounded statements that never read
a job's whole parameters or result nor any per-layer row; one run in full for its permalink page, with the
software its worker recorded as it started it."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import event, update

from quantplan.services import history as history_svc
from quantplan.services.errors import Refused
from store import models as m
from store import repo, team
from store.db import get_engine, session_scope

T0 = dt.datetime(2026, 11, 30, 9, 0, tzinfo=dt.UTC)
SUMMARY = {"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 1, "num_params": 1000,
           "dtype": "float32", "total_bytes": 4000,
           "linears": [{"name": f"model.layers.0.{p}", "in_features": 64, "out_features": 64}
                       for p in ("self_attn.q_proj", "mlp.down_proj")]}


def _timed(s, job_id: int, queued: dt.datetime, ran_s: float | None, worker: str = "h1",
           device: str = "cpu") -> None:
    """Set a job's times as if it was queued at ``queued`` and ran ``ran_s`` seconds (None: never started)."""
    values: dict = {"created_at": queued}
    if ran_s is not None:
        start = queued + dt.timedelta(seconds=5)
        values |= {"started_at": start, "finished_at": start + dt.timedelta(seconds=ran_s), "worker_host": worker,
                   "device": device}
    s.execute(update(m.Job).where(m.Job.id == job_id).values(**values))


def _score(s, job_id: int, model_id: int, plan_id: int | None, label: str, kl: float, err: float) -> None:
    repo.save_score(s, job_id=job_id, model_id=model_id, plan_id=plan_id, plan_label=label,
                    plan_body={"default": "FP8_DYNAMIC"}, dataset="builtin:lee.cor",
                    report={"kl_mean": kl, "kl_p50": kl, "kl_p90": kl, "kl_p99": kl, "kl_max": kl,
                            "top1_agree": 0.97, "ppl_ref": 18.0, "ppl": 18.2, "tokens": 1000, "kl_mean_err": err,
                            "kl_hist": {"edges": [0, 1], "counts": [5]}})


def _seed(settings, p: str = "") -> dict[str, int]:
    """Six runs of two people on one model: a calibration, two scores (a plan version and a preset), a sweep, a
    benchmark on a GPU and a failed calibration; ann tagged her score."""
    with session_scope(settings) as s:
        model = repo.add_model(s, name=f"{p}tiny", sha256=(p.encode().hex() + "a" * 64)[:64], source_kind="folder",
                               source_name="tiny", path="models/tiny", summary=SUMMARY, user=p + "ann")
        v1 = repo.save_plan(s, model_id=model.id, name="fast", body={"default": "FP8_DYNAMIC"}, user=p + "ann")
        v2 = repo.save_plan(s, model_id=model.id, name="fast", body={"default": "FP8_DYNAMIC",
                            "layers": {"model.layers.0.mlp.down_proj": "BF16"}}, user=p + "ann")
        cal = repo.create_job(s, kind="calibrate", params={"samples": 4}, queue="cpu", user=p + "ann",
                              model_id=model.id)
        repo.finish_job(s, cal.id, status="succeeded", result={
            "layers": 2, "tokens": 256, "top": [{"name": "model.layers.0.mlp.down_proj", "outlier_ratio": 812.5},
                                                {"name": "model.layers.0.self_attn.q_proj", "outlier_ratio": 3.0}]})
        _timed(s, cal.id, T0, 30.0)
        sc = repo.create_job(s, kind="score", params={"samples": 4}, queue="cpu", user=p + "ann", model_id=model.id,
                             plan_id=v2.id)
        _score(s, sc.id, model.id, v2.id, "fast v2", 0.0123, 0.0004)
        repo.finish_job(s, sc.id, status="succeeded", result={"kl_mean": 0.0123})
        _timed(s, sc.id, T0 + dt.timedelta(days=1), 120.0)
        pre = repo.create_job(s, kind="score", params={"scheme": "INT8_W8A8"}, queue="cpu", user=p + "bob",
                              model_id=model.id)
        _score(s, pre.id, model.id, None, "INT8_W8A8", 0.05, 0.002)
        repo.finish_job(s, pre.id, status="succeeded", result={"kl_mean": 0.05})
        _timed(s, pre.id, T0 + dt.timedelta(days=2), 60.0, worker="h2")
        sw = repo.create_job(s, kind="sensitivity", params={"scheme": "W4A16"}, queue="cpu", user=p + "bob",
                             model_id=model.id)
        repo.finish_job(s, sw.id, status="succeeded", result={
            "scheme": "W4A16", "units": 2, "top": [{"layer": "model.layers.0.mlp.down_proj", "kl_mean": 0.31}]})
        _timed(s, sw.id, T0 + dt.timedelta(days=3), 10.0, worker="h2")
        bench = repo.create_job(s, kind="bench", params={"device": "cuda"}, queue="gpu", user=p + "ann")
        repo.save_kernel_results(s, job_id=bench.id, records=[
            {"device": "cuda", "device_name": "NVIDIA H100", "torch_version": "2.9", "m": mm, "n": 64, "k": 64,
             "path": path, "ms": 1.0, "speedup": speed, "native": True}
            for mm, path, speed in ((16, "baseline", 1.0), (16, "fp8_row", 1.4), (2048, "fp8_row", 1.8),
                                    (2048, "int8_row", 1.3))])
        repo.finish_job(s, bench.id, status="succeeded", result={"measured": 4, "reused": 0, "records": []})
        _timed(s, bench.id, T0 + dt.timedelta(days=4), 300.0, worker="gpu-1", device="cuda (NVIDIA H100)")
        bad = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=p + "bob", model_id=model.id)
        repo.finish_job(s, bad.id, status="failed", error="out of memory loading the checkpoint")
        _timed(s, bad.id, T0 + dt.timedelta(days=5), None)
        team.add_note(s, author=p + "ann", target_kind="job", target_id=sc.id, text="shipped to staging",
                      tags=["shipped", "wikitext"])
        team.add_note(s, author=p + "bob", target_kind="job", target_id=pre.id, text="", tags=["baseline"])
        return {"model": model.id, "v1": v1.id, "v2": v2.id, "cal": cal.id, "score": sc.id, "preset": pre.id,
               "sweep": sw.id, "bench": bench.id, "failed": bad.id}


@pytest.fixture
def runs(qp_settings):
    return _seed(qp_settings)


def _ids(**filters) -> list[int]:
    sort = filters.pop("sort", "id")
    descending = filters.pop("descending", True)
    page = history_svc.history(history_svc.history_filter(**filters), sort=sort, descending=descending)
    return [r.id for r in page.rows]


def test_every_run_is_listed_newest_first_with_who_what_where_and_its_headline(runs):
    page = history_svc.history()
    assert page.total == 6 and [r.id for r in page.rows] == sorted(runs[k] for k in runs if k not in (
        "model", "v1", "v2"))[::-1]
    by_id = {r.id: r for r in page.rows}
    sc = by_id[runs["score"]]
    assert (sc.kind, sc.status, sc.model, sc.plan, sc.scheme, sc.person, sc.device, sc.worker) == (
        "score", "succeeded", "tiny", "fast v2", "fast v2", "ann", "cpu", "h1")
    assert sc.duration_s == 120.0 and sc.notes == ["ann: shipped to staging"] and sc.tags == ["shipped", "wikitext"]
    assert history_svc.headline(sc) == "KL 0.0123 ± 0.0004 · top-1 0.9700"
    assert history_svc.headline(by_id[runs["preset"]]).startswith("KL 0.05 ± 0.002")
    assert by_id[runs["preset"]].scheme == "INT8_W8A8" and by_id[runs["preset"]].plan is None
    assert history_svc.headline(by_id[runs["cal"]]) == "2 layers · top outlier ×812 model.layers.0.mlp.down_proj"
    assert history_svc.headline(by_id[runs["sweep"]]) == "2 units · most sensitive model.layers.0.mlp.down_proj " \
                                                          "(KL 0.31)"
    assert by_id[runs["sweep"]].scheme == "W4A16"
    assert history_svc.headline(by_id[runs["bench"]]) == "best fp8_row ×1.80, int8_row ×1.30 (4 measured, 0 reused)"
    failed = by_id[runs["failed"]]
    assert failed.duration_s is None and failed.started_at is None and history_svc.headline(failed) == ""


def test_filters_find_runs_by_person_model_plan_kind_device_tag_dates_and_words(runs):
    assert _ids(person="ANN") == [runs["bench"], runs["score"], runs["cal"]]
    assert _ids(person="nobody") == []
    assert _ids(model="tiny") == _ids(model=str(runs["model"])) == [runs[k] for k in (
        "failed", "sweep", "preset", "score", "cal")]
    assert _ids(plan="fast") == _ids(plan="fast v2") == _ids(plan="fast@v2") == _ids(plan=str(runs["v2"])) \
        == [runs["score"]]
    assert _ids(plan="fast v1") == []
    assert _ids(plan="INT8_W8A8") == [runs["preset"]]  # a preset scored, by its label
    assert _ids(kind="calibrate") == [runs["failed"], runs["cal"]]
    assert _ids(kind="calibrate", status="failed") == [runs["failed"]]
    assert _ids(device="h100") == [runs["bench"]]
    assert _ids(tag="shipped") == [runs["score"]] and _ids(tag="ship") == []  # a whole tag, not a part
    assert _ids(since="2026-12-01", until="2026-12-02") == [runs["preset"], runs["score"]]  # both days included
    assert _ids(since=dt.date(2026, 12, 5)) == [runs["failed"]]
    assert _ids(until="2026-11-30") == [runs["cal"]]
    assert _ids(text="staging") == [runs["score"]]  # a note's words
    assert _ids(text="memory") == [runs["failed"]]  # an error's
    assert _ids(text="gpu-1") == [runs["bench"]]  # a worker's
    assert _ids(text="ann fast") == [runs["score"]]  # every word
    assert _ids(text=f"#{runs['sweep']}") == [runs["sweep"]]
    assert _ids(text="100%_") == []  # LIKE's wildcards are plain characters


def test_every_column_sorts_both_ways_with_runs_lacking_a_value_last(runs):
    for key in history_svc.SORTS:
        down, up = _ids(sort=key), _ids(sort=key, descending=False)
        assert sorted(down) == sorted(up) == sorted(_ids()), key
    assert _ids(sort="duration") == [runs[k] for k in ("bench", "score", "preset", "cal", "sweep", "failed")]
    assert _ids(sort="duration", descending=False)[:2] == [runs["sweep"], runs["cal"]]
    assert _ids(sort="kl")[:2] == [runs["preset"], runs["score"]]
    assert _ids(sort="person", descending=False)[:3] == [runs["bench"], runs["score"], runs["cal"]]  # ann's
    assert _ids(sort="notes")[:2] == [runs["preset"], runs["score"]]  # one note each, newest first
    with pytest.raises(Refused, match="sort: 'colour' is no column to sort by; choose one of id, kind"):
        history_svc.history(sort="colour")


def test_pages_of_the_history(runs):
    first = history_svc.history(page=1, page_size=4)
    second = history_svc.history(page=2, page_size=4)
    assert (first.total, first.pages, len(first.rows), len(second.rows)) == (6, 2, 4, 2)
    assert {r.id for r in first.rows}.isdisjoint({r.id for r in second.rows})
    assert history_svc.history(page=9, page_size=4).page == 2  # past the last: the last
    with pytest.raises(Refused, match="page size: 501 runs; a page holds 1 to 500"):
        history_svc.history(page_size=501)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("kind", "train", "kind: 'train' is no kind of run; choose one of register, calibrate"),
    ("status", "done", "status: 'done' is no status"),
    ("since", "30/11/2026", "since: '30/11/2026' is not a date; write it as YYYY-MM-DD"),
    ("tag", "two words", "tag: 'two words' is no tag"),
])
def test_a_bad_filter_is_refused_naming_its_field(qp_settings, field, value, message):
    with pytest.raises(Refused, match=message):
        history_svc.history_filter(**{field: value})
    with pytest.raises(Refused, match=r"until \(2026-11-01\) is before since \(2026-12-01\)"):
        history_svc.history_filter(since="2026-12-01", until="2026-11-01")


def test_a_page_of_the_history_reads_no_per_layer_details_in_a_bounded_number_of_statements(runs, qp_settings):
    """A run that scored a plan file of 20,000 layers, a benchmark with thousands of records in its result: a page
    reads neither (only values picked out of the JSON in SQL), no per-layer table, and the same number of
    statements (at most 4) whether it shows 2 runs or 50."""
    huge_plan = {"default": "FP8_DYNAMIC", "layers": {f"model.layers.{i}.mlp.experts.{e}.down_proj": "BF16"
                                                       for i in range(100) for e in range(200)}}
    with session_scope(qp_settings) as s:
        for _ in range(40):
            job = repo.create_job(s, kind="score", params={"plan": huge_plan, "samples": 4}, queue="cpu",
                                  user="carol", model_id=runs["model"])
            repo.finish_job(s, job.id, status="succeeded", result={
                "kl_mean": 0.1, "records": [{"m": i, "path": "fp8_row", "speedup": 1.1} for i in range(5000)]})
    statements: list[str] = []

    def seen(conn, cursor, statement, *args) -> None:
        statements.append(statement)

    engine = get_engine(qp_settings)
    event.listen(engine, "before_cursor_execute", seen)
    try:
        small = history_svc.history(page_size=2)
        n_small = len(statements)
        statements.clear()
        big = history_svc.history(page_size=50)
        n_big = len(statements)
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert len(small.rows) == 2 and len(big.rows) == 46 and big.total == 46
    assert n_small <= n_big <= 4, statements  # count, page, its notes, its benchmarks' best speed-ups
    text = "\n".join(statements)
    for whole in ("jobs.params", "jobs.result"):  # only ever inside a JSON_EXTRACT(jobs.x, path)
        assert text.count(whole) == text.count(f"JSON_EXTRACT({whole},"), whole
    for per_layer in ("summary", "details", "plan_body", "activation_stats", "sensitivity_results", "channel_max"):
        assert per_layer not in text, per_layer
    carol = history_svc.history(history_svc.history_filter(person="carol"), page_size=1).rows[0]
    assert carol.scheme is None and carol.plan is None  # a plan file: no stored version, no preset


def test_a_runs_page_has_its_parameters_software_timings_results_and_the_plans_change(runs, qp_settings):
    from quantplan.services import access
    from quantplan.services import notes as notes_svc
    from worker.runner import Outcome, run_job

    r = history_svc.run(runs["score"])
    assert r.job.id == runs["score"] and r.model_name == "tiny" and not r.model_removed
    assert (r.plan.label, r.parent.label) == ("fast v2", "fast v1")
    assert r.score.kl_mean == 0.0123 and r.score.kl_mean_err == 0.0004
    assert dict(r.software) == {label: "not recorded" for label in history_svc.SOFTWARE_LABELS.values()}
    assert dict(r.timings)["ran"] == "120.0 s" and dict(r.timings)["waited in its queue"] == "5.0 s"
    assert [n.text for n in r.notes] == ["shipped to staging"]
    assert r.neighbours[0] == (runs["preset"], "score", "succeeded")  # the other score of its model first
    assert [o["name"] for o in history_svc.run(runs["cal"]).outliers] == []  # no statistics were stored here
    with session_scope(qp_settings) as s:
        job = repo.create_job(s, kind="bench", params={"device": "cpu"}, queue="local", user="ann")
    assert run_job(job.id, lambda ctx: Outcome(result={"measured": 0, "reused": 0}), settings=qp_settings) \
        == "succeeded"
    software = dict(history_svc.run(job.id).software)
    import platform

    import torch
    import transformers

    assert software["torch"] == torch.__version__ and software["transformers"] == transformers.__version__
    assert software["Python"] == platform.python_version() and software["quantplan"] == "0.1.0"
    assert software["CUDA (torch build)"] == (torch.version.cuda or "none found")
    assert software["git commit"] != "not recorded"
    with access.acting(access.Actor("viewer-vic", "viewer")), pytest.raises(access.Forbidden):
        notes_svc.add_note("job", job.id, "no")
    with pytest.raises(LookupError, match="no job #999"):
        history_svc.run(999)


def test_the_history_on_postgres(qp_env, pg_database, monkeypatch):
    """The same SQL on PostgreSQL (its JSON operators, its interval arithmetic for durations): filters, every sort,
    the headlines."""
    from store.db import upgrade
    from store.settings import get_settings
    from tests.conftest import clear_settings_cache

    monkeypatch.setenv("QUANTPLAN_DATABASE_URL", pg_database)
    clear_settings_cache()
    upgrade(get_settings())
    runs = _seed(get_settings(), "pg-history-")  # the session's database is shared: our rows by our names
    mine = {"model": "pg-history-tiny"}
    assert _ids(**mine) == [runs[k] for k in ("failed", "sweep", "preset", "score", "cal")]
    assert _ids(person="pg-history-ann") == [runs["bench"], runs["score"], runs["cal"]]
    assert _ids(tag="shipped", person="pg-history-ann") == [runs["score"]]
    assert _ids(plan="fast v2", **mine) == [runs["score"]]
    assert _ids(text="staging", **mine) == [runs["score"]]
    assert _ids(since="2026-12-01", until="2026-12-02", **mine) == [runs["preset"], runs["score"]]
    for key in history_svc.SORTS:
        assert sorted(_ids(sort=key, **mine)) == sorted(_ids(sort=key, descending=False, **mine)), key
    assert _ids(sort="duration", **mine) == [runs[k] for k in ("score", "preset", "cal", "sweep", "failed")]
    rows = {r.id: r for r in history_svc.history(history_svc.history_filter(person="pg-history-ann")).rows}
    assert history_svc.headline(rows[runs["score"]]) == "KL 0.0123 ± 0.0004 · top-1 0.9700"
    assert history_svc.headline(rows[runs["cal"]]) == "2 layers · top outlier ×812 model.layers.0.mlp.down_proj"
    assert history_svc.headline(rows[runs["bench"]]).startswith("best fp8_row ×1.80")
    assert rows[runs["score"]].duration_s == 120.0


def test_a_removed_model_and_a_chosen_plan_version_are_marked(runs, qp_settings):
    """A model marked removed keeps its runs, marked; a purged one's runs name it from their parameters; the plan
    version chosen for the model says so (issue 44, items 3 and 6)."""
    with session_scope(qp_settings) as s:
        s.add(m.ChosenPlan(model_id=runs["model"], plan_id=runs["v2"], chosen_by="ann", why="best KL"))
        s.execute(update(m.Model).where(m.Model.id == runs["model"]).values(removed_at=T0, removed_by="lead"))
        gone = repo.create_job(s, kind="calibrate", params={repo.REMOVED_MODEL_KEY: "purged-one"}, queue="cpu",
                               user="ann")
    rows = {r.id: r for r in history_svc.history().rows}
    assert rows[runs["score"]].plan_chosen and rows[runs["score"]].model_removed
    assert not rows[runs["preset"]].plan_chosen
    assert (rows[gone.id].model, rows[gone.id].model_removed) == ("purged-one", True)
    assert _ids(model="purged-one") == [gone.id]
    assert history_svc.run(runs["score"]).model_removed
