"""A worker killed mid-shard or mid-stream, with the real runner and store: the stale-job sweep queues a lost shard
again (attempts left, nothing cancelled) instead of failing the sweep, the next delivery of its task runs it, and
the sweep merges; a streamed job's scratch files are gone once the sweep has failed the job. The shard bodies are
faked (tests/e2e covers the sweep's numerics)."""
# ruff: noqa: F811 - the tests take the imported ``sweep`` fixture by name

from __future__ import annotations

import datetime as dt

from sqlalchemy import update

from store import models as m
from store import repo
from store import shards as shard_rows
from store.db import session_scope
from tests.worker.test_sweep_shards import ROWS, _job, _rows_body
from tests.worker.test_sweep_shards import sweep as sweep  # noqa: F401 - the fixture (a parent, two queued shards)
from worker.bodies.sweep_shards import merge, run_shard

OLD = dt.timedelta(hours=1)


def killed_while_running(settings, job_id: int, worker: str = "dead@h") -> None:
    """``worker`` took the shard (its attempt counted), ran it, and stopped beating an hour ago."""
    with session_scope(settings) as s:
        shard_rows.count_attempt(s, job_id, worker)
        repo.mark_running(s, job_id, worker_host=worker, device="cpu", torch_version="t")
        s.execute(update(m.Job).where(m.Job.id == job_id).values(heartbeat_at=m.utcnow() - OLD))


def test_a_shard_whose_worker_was_killed_runs_again_on_another_and_the_sweep_merges(qp_settings, sweep):
    parent, kids = sweep
    with session_scope(qp_settings) as s:
        repo.mark_running(s, parent, worker_host="2 shards", device="cpu", torch_version="t")
    killed_while_running(qp_settings, kids[0])
    with session_scope(qp_settings) as s:
        assert repo.sweep_stale_jobs(s, stale_after_s=60) == []  # nothing failed
    lost = _job(qp_settings, kids[0])
    assert (lost.status, lost.started_at) == ("queued", None)
    assert "attempt 1 lost" in lost.message and "dead@h" in lost.message
    assert _job(qp_settings, parent).status == "running"
    assert run_shard(kids[0], _rows_body(ROWS[0]), "two@h", settings=qp_settings) == ("succeeded", False)
    assert run_shard(kids[1], _rows_body(ROWS[1]), "two@h", settings=qp_settings) == ("succeeded", False)
    with session_scope(qp_settings) as s:
        first = shard_rows.shard_of(s, kids[0])
    assert first is not None and (first.attempts, first.worker) == (2, "two@h")
    assert merge(parent, settings=qp_settings) == "succeeded"
    assert [r["layer"] for r in _job(qp_settings, parent).result["top"]] == ["c", "b", "a"]


def test_a_delivery_that_finds_its_shard_lost_runs_it(qp_settings, sweep, monkeypatch):
    """The broker hands the killed worker's task out again before any sweep ran: the delivery's own sweep (a job
    found running is swept at once: worker.runner) queues the shard again, and the delivery runs it."""
    parent, kids = sweep
    monkeypatch.setattr(qp_settings, "heartbeat_stale_s", 60.0)
    killed_while_running(qp_settings, kids[0])
    assert run_shard(kids[0], _rows_body(ROWS[0]), "two@h", settings=qp_settings) == ("succeeded", False)
    assert _job(qp_settings, kids[0]).result["rows"] == ROWS[0]
    # a delivery of a shard that runs, beating, elsewhere runs nothing and uses no attempt
    with session_scope(qp_settings) as s:
        repo.mark_running(s, kids[1], worker_host="one@h", device="cpu", torch_version="t")
    assert run_shard(kids[1], _rows_body(ROWS[1]), "two@h", settings=qp_settings) == ("skipped", False)
    with session_scope(qp_settings) as s:
        assert shard_rows.shard_of(s, kids[1]).attempts == 0  # type: ignore[union-attr]


def test_a_shard_lost_on_its_last_attempt_or_in_a_cancelled_sweep_fails(qp_settings, sweep):
    parent, kids = sweep
    killed_while_running(qp_settings, kids[0], "one@h")
    with session_scope(qp_settings) as s:
        assert repo.sweep_stale_jobs(s, stale_after_s=60) == []
    killed_while_running(qp_settings, kids[0], "two@h")  # lost again: attempt 2 of 2
    with session_scope(qp_settings) as s:
        assert repo.sweep_stale_jobs(s, stale_after_s=60) == [kids[0]]
    assert "stopped reporting" in _job(qp_settings, kids[0]).error
    killed_while_running(qp_settings, kids[1])
    with session_scope(qp_settings) as s:
        s.execute(update(m.Job).where(m.Job.id == parent).values(cancel_requested=True))
        assert repo.sweep_stale_jobs(s, stale_after_s=60) == [kids[1]]


def test_the_stale_sweep_removes_the_scratch_files_of_a_worker_killed_mid_stream(qp_settings, monkeypatch):
    """A streamed job's worker killed with its hidden states in a memory-mapped scratch file (issue #42 item 6):
    the sweep fails the job and removes its scratch folder in the same pass; a live streamed job's stays."""
    from tests.factories import stored_model
    from worker.runner import sweep as stale_sweep

    monkeypatch.setattr(qp_settings, "heartbeat_stale_s", 60.0)
    with session_scope(qp_settings) as s:
        model = stored_model(s)
        jobs = [repo.create_job(s, kind="score", params={"stream": True}, queue="cpu", user="t", model_id=model.id)
                for _ in range(2)]
        for job in jobs:
            repo.mark_running(s, job.id, worker_host="h", device="cpu", torch_version="t")
        s.execute(update(m.Job).where(m.Job.id == jobs[0].id).values(heartbeat_at=m.utcnow() - OLD))
    folders = [qp_settings.job_scratch_dir(j.id) for j in jobs]
    for folder in folders:
        (folder / "stream-x").mkdir(parents=True)
        (folder / "stream-x" / "block0.bin").write_bytes(b"\0" * 4096)
    assert stale_sweep(qp_settings) == [jobs[0].id]
    assert _job(qp_settings, jobs[0].id).status == "failed"
    assert not folders[0].exists() and (folders[1] / "stream-x" / "block0.bin").exists()
