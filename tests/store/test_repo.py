"""Repositories: job life, cancel, stale sweep, statistics round trip, plans versioning."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

from quantcore.evaluation.stats import HIST_BINS, LayerStats
from store import models as m
from store import repo
from store.db import session_scope
from tests.factories import stored_model


def test_job_life_and_cancel(qp_settings):
    with session_scope(qp_settings) as s:
        mod = stored_model(s)
        job = repo.create_job(s, kind="calibrate", params={"samples": 2}, queue="cpu", user="ann", model_id=mod.id)
        assert job.status == "queued" and job.requested_by == "ann"
        assert repo.mark_running(s, job.id, worker_host="h", device="cpu", torch_version="x")
        assert repo.report_progress(s, job.id, 0.5, "half") is False
        repo.request_cancel(s, job.id)
        assert repo.report_progress(s, job.id, 0.6, "more") is True
        repo.finish_job(s, job.id, status="cancelled", message="cancelled")
        assert repo.get_job(s, job.id).status == "cancelled"
        # a queued job is cancelled at once and can no longer start
        j2 = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None, model_id=mod.id)
        assert repo.request_cancel(s, j2.id).status == "cancelled"
        assert repo.mark_running(s, j2.id, worker_host="h", device="cpu", torch_version="x") is False


def test_unknown_job_kind_is_refused(qp_settings):
    with session_scope(qp_settings) as s, pytest.raises(ValueError, match="calibrate"):
        repo.create_job(s, kind="train", params={}, queue="cpu", user=None)


def test_stale_running_job_is_failed_by_the_sweep(qp_settings):
    with session_scope(qp_settings) as s:
        job = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None)
        repo.mark_running(s, job.id, worker_host="gone-host", device="cpu", torch_version="x")
        fresh = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None)
        repo.mark_running(s, fresh.id, worker_host="alive", device="cpu", torch_version="x")
        row = s.get(m.Job, job.id)
        row.heartbeat_at = m.utcnow() - dt.timedelta(seconds=1000)
    with session_scope(qp_settings) as s:
        assert repo.sweep_stale_jobs(s, stale_after_s=300) == [job.id]
        failed = repo.get_job(s, job.id)
        assert failed.status == "failed" and "gone-host" in failed.error
        assert repo.get_job(s, fresh.id).status == "running"


def test_the_sweep_leaves_a_job_whose_worker_spoke_after_it_was_read(any_db, monkeypatch):
    """The sweep reads the running jobs, then fails the stale ones; a worker that beats or finishes in between
    keeps what it wrote (the UPDATE asks for the heartbeat it read)."""
    with session_scope(any_db) as s:
        beating = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None)
        done = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None)
        dead = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None)
        for job in (beating, done, dead):
            repo.mark_running(s, job.id, worker_host="h", device="cpu", torch_version="x")
            s.get(m.Job, job.id).heartbeat_at = m.utcnow() - dt.timedelta(seconds=1000)
    real_aware = repo._aware

    def read_then_workers_speak(t):  # called on each row between the read and its UPDATE
        if not spoken:
            spoken.append(True)
            with session_scope(any_db) as other:
                repo.job_heartbeat(other, beating.id)
                repo.finish_job(other, done.id, status="succeeded", result={"ok": 1})
        return real_aware(t)

    spoken: list[bool] = []
    monkeypatch.setattr(repo, "_aware", read_then_workers_speak)
    with session_scope(any_db) as s:
        assert repo.sweep_stale_jobs(s, stale_after_s=300) == [dead.id]
    with session_scope(any_db) as s:
        assert repo.get_job(s, beating.id).status == "running"
        assert repo.get_job(s, done.id).status == "succeeded" and repo.get_job(s, done.id).error is None
        assert repo.get_job(s, dead.id).status == "failed"


def test_activation_stats_round_trip_and_rerun_replaces(qp_settings):
    rng = np.random.default_rng(0)
    st = LayerStats(name="model.layers.0.mlp.down_proj", in_features=16, out_features=8, n_tokens=10,
                    channel_max=rng.random(16).astype(np.float32), weight_channel_max=rng.random(16).astype(np.float32),
                    token_max={"p50": 1.0, "max": 2.0}, hist_counts=np.arange(HIST_BINS, dtype=np.int64), zeros=3)
    with session_scope(qp_settings) as s:
        mod = stored_model(s)
        job = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None, model_id=mod.id)
        repo.save_activation_stats(s, job_id=job.id, model_id=mod.id, stats=[st])
        repo.save_activation_stats(s, job_id=job.id, model_id=mod.id, stats=[st])  # idempotent rerun
    with session_scope(qp_settings) as s:
        back = repo.load_activation_stats(s, job.id)
    assert len(back) == 1
    np.testing.assert_array_equal(back[0].channel_max, st.channel_max)
    np.testing.assert_array_equal(back[0].hist_counts, st.hist_counts)
    assert back[0].zeros == 3 and back[0].token_max == {"p50": 1.0, "max": 2.0}
    assert back[0].outlier_ratio == pytest.approx(st.outlier_ratio)
    again = LayerStats.from_record(back[0])  # the worker's and the app's conversion of the store's record
    assert again.name == st.name and again.amax == pytest.approx(st.amax) and again.token_max == st.token_max


def test_model_lookup_by_id_name_and_demo(qp_settings):
    with session_scope(qp_settings) as s:
        mod = stored_model(s, "abc")
        assert repo.get_model(s, str(mod.id)).name == "abc"
        assert repo.get_model(s, "abc").id == mod.id
        with pytest.raises(repo.NotFound, match="models add --demo"):
            repo.get_model(s, "demo")
        # same content registered again → the same record
        assert stored_model(s, "abc").id == mod.id


def test_plans_are_versioned_with_parents(qp_settings):
    with session_scope(qp_settings) as s:
        mod = stored_model(s)
        v1 = repo.save_plan(s, model_id=mod.id, name="p", body={"default": "FP8"}, user="ann")
        v2 = repo.save_plan(s, model_id=mod.id, name="p", body={"default": "INT8_W8A8"}, user="bob")
        assert (v1.version, v2.version, v2.parent_id) == (1, 2, v1.id)
        assert repo.get_plan(s, "p").id == v2.id
        assert repo.get_plan(s, "p@v1").id == v1.id
        assert v2.author == "bob"


def test_newest_kernel_results_per_case(qp_settings):
    def rec(path, ms, skipped=None, torch_version="2.13"):
        return {"device": "cuda", "device_name": "GPU X", "torch_version": torch_version, "m": 16, "n": 64,
                "k": 32, "path": path, "ms": ms, "tflops": None, "pct_peak": None, "speedup": None,
                "native": True, "max_rel_err": None, "padded_m": None, "skipped": skipped}

    with session_scope(qp_settings) as s:
        old = repo.create_job(s, kind="bench", params={}, queue="gpu", user="ann")
        new = repo.create_job(s, kind="bench", params={"m": [16]}, queue="gpu", user="ann")
        other = repo.create_job(s, kind="bench", params={}, queue="gpu", user="ann")
        repo.save_kernel_results(s, job_id=old.id, records=[
            rec("baseline", 2.0), rec("fp8_row", 1.0), rec("int8_row", None, "not supported on cuda: sm80")])
        repo.save_kernel_results(s, job_id=new.id, records=[
            rec("baseline", 1.9), rec("fp8_row", None, "over budget: 60 s"),
            rec("fp8_tensor", None, "failed on cuda: x")])
        repo.save_kernel_results(s, job_id=other.id, records=[rec("baseline", 5.0, torch_version="2.11")])
        repo.finish_job(s, new.id, status="succeeded", result={"budget_s": 60.0})

        every = {r.path: r for r in repo.newest_kernel_results(s, device_name="GPU X", torch_version="2.13")}
        assert (every["baseline"].ms, every["baseline"].job_id) == (1.9, new.id)
        assert every["fp8_row"].skipped.startswith("over budget") and every["fp8_tensor"].skipped
        any_torch = repo.newest_kernel_results(s, device_name="GPU X")
        assert [r.ms for r in any_torch if r.path == "baseline"] == [5.0]  # newest job, any torch version
        assert repo.newest_kernel_results(s, device_name="GPU Y") == []
        # every record of the device, newest job first: what quantcore.kernels.records.reusable_records weighs
        assert [r.job_id for r in repo.kernel_results(s, device_name="GPU X", torch_version="2.13")] == [new.id] * 3 + [
            old.id] * 3
        assert repo.params_and_results(s, [new.id, 10**6]) == {new.id: ({"m": [16]}, {"budget_s": 60.0})}


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db(request, qp_env, monkeypatch):
    """Migrated settings on the embedded SQLite file, then on PostgreSQL (skipped when it does not answer)."""
    from store.db import upgrade
    from store.settings import get_settings
    from tests.conftest import clear_settings_cache

    if request.param == "postgresql":
        monkeypatch.setenv("QUANTPLAN_DATABASE_URL", request.getfixturevalue("pg_database"))
        clear_settings_cache()
    s = get_settings()
    upgrade(s)
    return s


def test_deleting_a_model_takes_what_was_measured_on_it_and_keeps_the_jobs(any_db):
    import uuid

    rng = np.random.default_rng(1)
    stat = LayerStats(name="a", in_features=4, out_features=8, n_tokens=3, channel_max=rng.random(4).astype(np.float32),
                      weight_channel_max=rng.random(4).astype(np.float32), token_max={"max": 1.0},
                      hist_counts=np.zeros(HIST_BINS, dtype=np.int64), zeros=0)
    tag = uuid.uuid4().hex[:6]  # the PostgreSQL database is shared by the session's tests
    with session_scope(any_db) as s:
        gone, kept = stored_model(s, f"gone{tag}"), stored_model(s, f"kept{tag}")
        jobs = {}
        for mod in (gone, kept):
            cal = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None, model_id=mod.id)
            repo.save_activation_stats(s, job_id=cal.id, model_id=mod.id, stats=[stat])
            repo.finish_job(s, cal.id, status="succeeded")
            v1 = repo.save_plan(s, model_id=mod.id, name="p", body={"default": "FP8"}, user=None)
            v2 = repo.save_plan(s, model_id=mod.id, name="p", body={"default": "BF16"}, user=None)
            assert v2.parent_id == v1.id  # versions point at each other
            sc = repo.create_job(s, kind="score", params={}, queue="cpu", user=None, model_id=mod.id)
            repo.save_score(s, job_id=sc.id, model_id=mod.id, plan_id=v2.id, plan_label="p@v2", plan_body={},
                            dataset="d", report={"kl_mean": 0.1, "kl_p50": 0.1, "kl_p90": 0.1, "kl_p99": 0.1,
                                                 "kl_max": 0.1, "top1_agree": 0.9, "ppl_ref": 1.0, "ppl": 1.1,
                                                 "tokens": 10})
            repo.finish_job(s, sc.id, status="succeeded")
            sj = repo.create_job(s, kind="sensitivity", params={"scheme": "FP8"}, queue="cpu", user=None,
                                 model_id=mod.id)
            repo.save_sensitivity(s, job_id=sj.id, model_id=mod.id, scheme="FP8",
                                  rows=[{"layer": "a", "layers": ["a"], "kl_mean": 0.1, "top1_agree": 0.9,
                                         "sqnr_db": 20.0}])
            repo.finish_job(s, sj.id, status="succeeded")
            jobs[mod.id] = [cal.id, sc.id, sj.id]
        busy = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None, model_id=gone.id)
    with session_scope(any_db) as s:
        usage = repo.model_usage(s, gone.id)
        assert usage == {"calibrations": 1, "scores": 1, "sensitivity sweeps": 1, "plan versions": 2, "active": 1}
        repo.finish_job(s, busy.id, status="cancelled")
        repo.delete_model(s, gone.id)
    with session_scope(any_db) as s:
        with pytest.raises(repo.NotFound):
            repo.get_model(s, gone.id)
        assert repo.model_usage(s, gone.id) == dict.fromkeys(usage, 0)
        for job_id in jobs[gone.id]:  # the history stays, without the model but naming it
            job = repo.get_job(s, job_id)
            assert job.model_id is None and job.params[repo.REMOVED_MODEL_KEY] == f"gone{tag}"
        assert all(repo.REMOVED_MODEL_KEY not in repo.get_job(s, j).params for j in jobs[kept.id])
        # the other model is untouched
        assert repo.model_usage(s, kept.id) == {"calibrations": 1, "scores": 1, "sensitivity sweeps": 1,
                                                "plan versions": 2, "active": 0}
        assert [p.version for p in repo.list_plans(s, kept.id)]
        assert len(repo.load_activation_stats(s, jobs[kept.id][0])) == 1


def test_a_job_says_how_long_it_ran(qp_settings):
    with session_scope(qp_settings) as s:
        job = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None)
        assert repo.get_job(s, job.id).run_seconds() is None  # still queued: it has not run
        repo.mark_running(s, job.id, worker_host="h", device="cpu", torch_version="x")
        running = repo.get_job(s, job.id)
        later = running.started_at + dt.timedelta(seconds=90)
        assert running.run_seconds(now=later) == 90.0 and running.run_seconds() >= 0.0
        repo.finish_job(s, job.id, status="succeeded", message="done")
        done = repo.get_job(s, job.id)
        took = (done.finished_at - done.started_at).total_seconds()
        assert done.run_seconds(now=later + dt.timedelta(days=1)) == took  # an ended job's time no longer grows
        queued = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None)
        repo.request_cancel(s, queued.id)
        assert repo.get_job(s, queued.id).run_seconds() is None  # cancelled before it started


def test_a_job_says_what_it_is_doing(qp_settings):
    with session_scope(qp_settings) as s:
        job = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None)
        assert repo.get_job(s, job.id).progress_text == "waiting for a worker"  # not "queued" twice
        repo.mark_running(s, job.id, worker_host="h", device="cpu", torch_version="x")
        repo.report_progress(s, job.id, 0.5, "batch 2 of 4")
        assert repo.get_job(s, job.id).progress_text == "batch 2 of 4"


def test_the_device_probe_is_the_newest_succeeded_benchmarks_on_that_device(qp_settings):
    probe = {"kind": "cpu", "name": "A CPU", "device_class": "cpu", "torch_version": "2.13.0"}
    with session_scope(qp_settings) as s:
        assert repo.device_probe(s, "A CPU") is None
        ids = []
        for status, result in (("succeeded", {"device": probe}),
                               ("succeeded", {"device": {**probe, "torch_version": "2.14.0"},
                                              "paths": [{"path": "x"}]}),
                               ("failed", {"device": {**probe, "torch_version": "9"}}),
                               ("succeeded", {"device": {**probe, "name": "Another CPU"}}),
                               ("succeeded", None)):
            job = repo.create_job(s, kind="bench", params={}, queue="cpu", user=None)
            repo.finish_job(s, job.id, status=status, result=result)
            ids.append(job.id)
        got = repo.device_probe(s, "A CPU")
        assert got == {"device": {**probe, "torch_version": "2.14.0"}, "paths": [{"path": "x"}], "job_id": ids[1]}
        assert repo.device_probe(s, "Another CPU")["paths"] is None  # a job from before the table was stored
        assert repo.device_probe(s, "No such CPU") is None
