"""A sharded sweep's shards on the worker (worker.bodies.sweep_shards) with the real runner and store: progress
aggregated into the sweep's, a failed shard run again alone, cancel reaching every shard, the merge, and the
stale-job sweep. The shard bodies are faked (the sweep's numerics are not under test here: tests/e2e covers them)."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import update

from store import models as m
from store import repo
from store import shards as shard_rows
from store.db import session_scope
from worker.bodies.sweep_shards import merge, run_shard
from worker.runner import Outcome


@pytest.fixture
def sweep(qp_settings):
    """A sweep's parent row and its two shard rows (queued, as jobs.client.submit_sharded writes them)."""
    from tests.factories import stored_model

    with session_scope(qp_settings) as s:
        model = stored_model(s)
        params = {"scheme": "FP8", "shards": 2}
        parent = repo.create_job(s, kind="sensitivity", params=params, queue="cpu", user="t", model_id=model.id)
        kids = []
        for i in range(2):
            kid = repo.create_job(s, kind="sensitivity", params={**params, "shard": [i, 2]}, queue="cpu", user="t",
                                  model_id=model.id)
            shard_rows.add_shard(s, parent_id=parent.id, job_id=kid.id, shard=i, shards=2)
            kids.append(kid.id)
    return parent.id, kids


def _job(settings, job_id):
    with session_scope(settings) as s:
        return repo.get_job(s, job_id)


def _rows_body(rows):
    def body(ctx):
        ctx.progress(0.5, "half")
        return Outcome(result={"scheme": "FP8", "text": "t", "rows": rows}, message="shard done")
    return body


ROWS = [[{"layer": "a", "layers": ["a"], "kl_mean": 0.1, "top1_agree": 1.0, "sqnr_db": 30.0, "unit_index": 0},
         {"layer": "c", "layers": ["c"], "kl_mean": 0.5, "top1_agree": 0.9, "sqnr_db": 20.0, "unit_index": 2}],
        [{"layer": "b", "layers": ["b"], "kl_mean": 0.3, "top1_agree": 0.95, "sqnr_db": 25.0, "unit_index": 1}]]


def test_a_shards_progress_runs_its_sweep_and_is_the_mean_of_its_shards(qp_settings, sweep, monkeypatch):
    monkeypatch.setattr("worker.runner.PROGRESS_INTERVAL_S", 0.0)
    parent, kids = sweep
    seen = []

    def body(ctx):
        ctx.progress(0.5, "unit 1 of 2")
        seen.append(_job(qp_settings, parent))
        return Outcome(result={"rows": ROWS[0]})

    assert run_shard(kids[0], body, "one@h", settings=qp_settings) == ("succeeded", False)
    assert seen[0].status == "running" and seen[0].progress == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert seen[0].message == "shard 1 of 2 (one@h): unit 1 of 2"
    with session_scope(qp_settings) as s:
        shard = shard_rows.shard_of(s, kids[0])
    assert shard is not None and (shard.attempts, shard.worker) == (1, "one@h")


def test_a_failed_shard_is_queued_again_alone_and_the_sweep_fails_only_when_it_fails_again(qp_settings, sweep):
    parent, kids = sweep
    calls = []

    def flaky(ctx):
        calls.append(ctx.job_id)
        if len(calls) == 1:
            raise RuntimeError("out of memory, once")
        return Outcome(result={"rows": ROWS[0]})

    assert run_shard(kids[0], flaky, "one@h", settings=qp_settings) == ("failed", True)
    again = _job(qp_settings, kids[0])
    assert again.status == "queued" and "attempt 1 failed (RuntimeError: out of memory, once" in again.message
    assert _job(qp_settings, kids[1]).status == "queued"  # the other shard is untouched
    assert run_shard(kids[0], flaky, "two@h", settings=qp_settings) == ("succeeded", False)

    def broken(ctx):
        raise RuntimeError("always")

    assert run_shard(kids[1], broken, "one@h", settings=qp_settings) == ("failed", True)
    assert run_shard(kids[1], broken, "one@h", settings=qp_settings) == ("failed", False)  # attempts used up
    assert merge(parent, settings=qp_settings) == "failed"
    failed = _job(qp_settings, parent)
    assert failed.status == "failed" and "shard 2 of 2" in failed.error and "after 2 attempt(s)" in failed.error
    assert "always" in failed.error


def test_the_merge_saves_the_shards_rows_as_the_one_sweep(qp_settings, sweep):
    parent, kids = sweep
    for kid, rows in zip(kids, ROWS, strict=True):
        assert run_shard(kid, _rows_body(rows), "w@h", settings=qp_settings)[0] == "succeeded"
    assert merge(parent, settings=qp_settings) == "succeeded"
    done = _job(qp_settings, parent)
    assert done.status == "succeeded" and done.progress == 1.0
    assert [t["layer"] for t in done.result["top"]] == ["c", "b", "a"]
    assert done.result["units"] == 3 and done.result["shards"] == 2 and "rows" not in done.result
    with session_scope(qp_settings) as s:
        rows = repo.list_sensitivity(s, parent)
    assert [(r.unit, r.kl_mean) for r in rows] == [("c", 0.5), ("b", 0.3), ("a", 0.1)]
    assert merge(parent, settings=qp_settings) == "succeeded"  # a callback delivered twice changes nothing


def test_cancelling_the_sweep_cancels_every_shard_queued_or_running(qp_settings, sweep, monkeypatch):
    monkeypatch.setattr("worker.runner.PROGRESS_INTERVAL_S", 0.0)
    parent, kids = sweep

    def cancelled_while_running(ctx):
        ctx.progress(0.1, "started")
        with session_scope(qp_settings) as s:
            repo.request_cancel(s, parent)  # a person cancels the sweep while shard 1 runs
        ctx.progress(0.2, "next unit")  # the shard stops here
        raise AssertionError("not reached")

    assert run_shard(kids[0], cancelled_while_running, "w@h", settings=qp_settings) == ("cancelled", False)
    assert _job(qp_settings, kids[1]).status == "cancelled"  # queued: cancelled at once
    assert run_shard(kids[1], _rows_body(ROWS[1]), "w@h", settings=qp_settings) == ("skipped", False)
    assert merge(parent, settings=qp_settings) == "cancelled"
    assert _job(qp_settings, parent).status == "cancelled"


def test_the_stale_sweep_leaves_a_sweep_alone_while_a_shard_waits_and_fails_it_after(qp_settings, sweep):
    parent, kids = sweep
    old = m.utcnow() - dt.timedelta(hours=1)
    with session_scope(qp_settings) as s:  # the sweep ran a shard an hour ago; shard 2 waits for a free worker
        repo.mark_running(s, parent, worker_host="h", device="cpu", torch_version="t")
        s.execute(update(m.Job).where(m.Job.id == parent).values(heartbeat_at=old))
        assert repo.sweep_stale_jobs(s, stale_after_s=60) == []
        for kid in kids:
            repo.finish_job(s, kid, status="failed", error="gone")
        assert repo.sweep_stale_jobs(s, stale_after_s=60) == [parent]


def test_only_the_delivery_that_runs_a_shard_counts_for_the_chord(qp_settings, sweep):
    """A second delivery of a running shard's task (Redis brings back a task that outlives its visibility timeout)
    runs nothing and is ignored, so the chord's callback waits for the delivery that runs it; a shard cancelled
    before any worker took it counts at once."""
    from worker.tasks import sensitivity_shard_task

    parent, kids = sweep
    with session_scope(qp_settings) as s:
        repo.mark_running(s, kids[0], worker_host="h", device="cpu", torch_version="t")  # another delivery runs it
        repo.request_cancel(s, kids[1])
    running = sensitivity_shard_task.apply(args=[kids[0]])
    assert running.state == "IGNORED"
    cancelled = sensitivity_shard_task.apply(args=[kids[1]])
    assert (cancelled.state, cancelled.result) == ("SUCCESS", "skipped")
