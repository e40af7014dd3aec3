"""A sensitivity sweep sharded over two real worker processes (a Celery chord on the embedded SQLite broker and
result backend): both workers take shards, and the merged sweep equals the same sweep run unsharded."""

from __future__ import annotations

import pytest

from jobs.client import submit_job, wait_for
from store import repo
from store import shards as shard_rows
from store.db import session_scope
from tests.factories import save_tiny_llama, start_worker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SWEEP = {"scheme": "INT8_W8A8", "samples": 24, "seq_len": 96, "device": "cpu"}


def _rows(settings, job_id: int) -> dict[str, tuple]:
    with session_scope(settings) as s:
        return {r.unit: (tuple(r.layers), r.scheme, r.kl_mean, r.top1_agree, r.sqnr_db, r.kl_mean_err)
                for r in repo.list_sensitivity(s, job_id)}


def test_a_sweep_sharded_over_two_workers_equals_the_unsharded_sweep(qp_settings, tmp_path):
    """The embedded default: the chord's callback through celery.chord_unlock polling the SQLite result backend."""
    assert str(qp_settings.result_backend).startswith("db+sqlite:")
    _sharded_equals_whole(qp_settings, tmp_path)


def test_the_same_on_postgres_and_redis(team_settings, tmp_path):
    """The team setup: PostgreSQL, and Redis as broker and result backend (its native chord counter)."""
    _sharded_equals_whole(team_settings, tmp_path)


def _sharded_equals_whole(qp_settings, tmp_path) -> None:
    from jobs.shards import live_on

    workers = [start_worker(tmp_path, name="one"), start_worker(tmp_path, name="two")]
    try:
        reg = submit_job("register", {"source": str(save_tiny_llama(tmp_path / "tiny-llama")), "name": "tiny"},
                         settings=qp_settings)
        reg = wait_for(reg.id, timeout_s=300, settings=qp_settings)
        assert reg.status == "succeeded", reg.error
        model_id = reg.result["model_id"]
        assert live_on("cpu", qp_settings) >= 2  # the default shard count: one per live worker on the queue

        progress_seen: set[float] = set()
        sharded = submit_job("sensitivity", {**SWEEP, "shards": 2}, model_id=model_id, settings=qp_settings)
        sharded = wait_for(sharded.id, timeout_s=600, settings=qp_settings, poll_s=0.1,
                           on_update=lambda j: progress_seen.add(round(j.progress, 3)))
        assert sharded.status == "succeeded", (sharded.error, workers[0].text()[-3000:])
        whole = submit_job("sensitivity", {**SWEEP, "shards": 1}, model_id=model_id, settings=qp_settings)
        whole = wait_for(whole.id, timeout_s=600, settings=qp_settings)
        assert whole.status == "succeeded", whole.error

        with session_scope(qp_settings) as s:
            shards = shard_rows.shards_of(s, sharded.id)
            listed = [j.id for j in repo.list_jobs(s, kind="sensitivity") if j.id >= sharded.id]  # PG: shared
            assert shard_rows.shards_of(s, whole.id) == []  # shards=1: today's one task
        assert [sh.shard for sh in shards] == [0, 1]
        assert all(sh.job.status == "succeeded" and sh.attempts == 1 for sh in shards)
        took = {sh.worker.split("@")[0] for sh in shards if sh.worker}
        assert took == {"one", "two"}, [(sh.shard, sh.worker) for sh in shards]  # both workers took a shard
        assert sorted(listed) == sorted([sharded.id, whole.id])  # the shards' own rows are not listed as sweeps
        assert len(progress_seen - {0.0, 1.0}) >= 2  # the sweep's progress moved while its shards ran

        merged, unsharded = _rows(qp_settings, sharded.id), _rows(qp_settings, whole.id)
        assert len(unsharded) == 2 * 4 + 1  # two blocks of q/k/v, o, gate/up, down; and lm_head
        assert merged == unsharded  # the same units, the same KLs, bit for bit
        assert sharded.result["top"] == whole.result["top"]  # and the same order
        assert sharded.result["units"] == whole.result["units"] == len(unsharded)
        assert sharded.result["shards"] == 2 and len(sharded.result["workers"]) == 2
    finally:
        for w in workers:
            w.stop()
