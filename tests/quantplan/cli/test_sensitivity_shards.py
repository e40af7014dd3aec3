"""`quantplan sensitivity --shards N`: the sweep queued as N shard tasks of one sweep (jobs.shards)."""

from __future__ import annotations

import pytest

from store import repo
from store import shards as shard_rows
from store.db import session_scope
from tests.factories import run_cli


def test_shards_queue_one_sweep_split_into_that_many_shard_jobs(tiny_model, qp_settings, capsys):
    code, _, err = run_cli(capsys, "sensitivity", "tiny", "--scheme", "FP8", "--samples", "2", "--seq-len", "8",
                           "--shards", "3", "--timeout", "0.5")
    assert code == 1 and "still queued" in err  # no worker here: queued, and the command stopped waiting
    with session_scope(qp_settings) as s:
        (sweep,) = repo.list_jobs(s, kind="sensitivity")
        shards = shard_rows.shards_of(s, sweep.id)
    assert sweep.params["shards"] == 3 and [sh.job.params["shard"] for sh in shards] == [[0, 3], [1, 3], [2, 3]]


def test_one_shard_is_todays_one_task_and_zero_is_refused_when_parsed(tiny_model, qp_settings, capsys):
    code, _, err = run_cli(capsys, "sensitivity", "tiny", "--scheme", "FP8", "--samples", "2", "--seq-len", "8",
                           "--shards", "1", "--timeout", "0.5")
    assert code == 1
    with session_scope(qp_settings) as s:
        (sweep,) = repo.list_jobs(s, kind="sensitivity")
        assert shard_rows.shards_of(s, sweep.id) == [] and sweep.params["shards"] == 1
    with pytest.raises(SystemExit) as exited:
        run_cli(capsys, "sensitivity", "tiny", "--scheme", "FP8", "--shards", "0")
    assert exited.value.code == 2
    assert "argument --shards: shards must be between 1 and 256 tasks, got 0" in capsys.readouterr().err
