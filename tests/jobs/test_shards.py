"""Sharded sweeps, the torch-free half (jobs.shards): how units are dealt out, how the shards' rows merge back into
the one sweep's order, how many shards a sweep asks for, and what queueing one writes."""

from __future__ import annotations

import random

import pytest

from jobs.errors import InvalidJob
from jobs.shards import live_on, merged_rows, shard_count, shard_part
from jobs.specs import SensitivitySpec
from store import repo
from store import shards as shard_rows
from store.db import session_scope


def test_shards_deal_the_units_out_in_turn_and_cover_each_once():
    units = [f"u{i}" for i in range(11)]
    parts = [shard_part(units, i, 3) for i in range(3)]
    assert parts[0] == ["u0", "u3", "u6", "u9"] and parts[2] == ["u2", "u5", "u8"]
    assert sorted(u for p in parts for u in p) == sorted(units)
    assert shard_part(units[:1], 1, 2) == []  # more shards than units: a shard with none
    with pytest.raises(ValueError, match="shard 3 of 3"):
        shard_part(units, 3, 3)


def _whole_sweep(kls: list[float]) -> list[dict]:
    """What quantcore.evaluation.sensitivity returns: rows in unit order, sorted by KL, largest first (stable)."""
    rows = [{"layer": f"unit{i}", "kl_mean": kl} for i, kl in enumerate(kls)]
    rows.sort(key=lambda r: r["kl_mean"], reverse=True)
    return rows


def test_merged_shards_are_the_whole_sweeps_rows_in_its_order_ties_included():
    kls = [0.3, 0.0, 0.7, 0.0, 0.3, 1e-9, 0.0, 2.0]  # ties: the unsharded sort keeps them in unit order
    indexed = [{"layer": f"unit{i}", "kl_mean": kl, "unit_index": i} for i, kl in enumerate(kls)]
    for count in (2, 3, 8):
        parts = [sorted(shard_part(indexed, i, count), key=lambda r: r["kl_mean"], reverse=True)
                 for i in range(count)]
        random.Random(count).shuffle(parts)  # shards end in any order
        assert merged_rows(parts) == _whole_sweep(kls)


def test_a_merge_missing_a_unit_or_holding_one_twice_is_refused():
    rows = [{"layer": f"u{i}", "kl_mean": 0.1, "unit_index": i} for i in range(4)]
    with pytest.raises(ValueError, match=r"missing units \[2\]"):
        merged_rows([rows[:2], rows[3:]])
    with pytest.raises(ValueError, match="1 twice"):
        merged_rows([rows[:3], rows[2:3]])


def test_the_shard_count_is_the_sweeps_own_else_one_per_live_worker_on_its_queue(qp_settings):
    spec = SensitivitySpec(scheme="FP8")
    assert shard_count(spec, "cpu", qp_settings) == 1  # no live worker: today's one task
    with session_scope(qp_settings) as s:
        for name, queues in (("a@h", ["cpu"]), ("b@h", ["cpu", "gpu"]), ("c@h", ["gpu"])):
            repo.worker_started(s, name=name, host="h", queues=queues, device="cpu", device_name="cpu",
                                device_class="cpu", torch_version=None)
    assert live_on("cpu", qp_settings) == 2 and live_on("gpu", qp_settings) == 2
    assert shard_count(spec, "cpu", qp_settings) == 2
    assert shard_count(spec.with_changes(shards=5), "cpu", qp_settings) == 5
    assert shard_count(spec.with_changes(shards=1), "cpu", qp_settings) == 1
    assert shard_count(spec.with_changes(shard=(0, 2)), "cpu", qp_settings) == 1  # a shard is never split again
    # the Fisher estimate is a few passes over every unit at once: one task unless shards are asked for
    assert shard_count(spec.with_changes(method="fisher"), "cpu", qp_settings) == 1


def test_shard_parameters_are_checked():
    with pytest.raises(InvalidJob, match="shards"):
        SensitivitySpec(scheme="FP8", shards=0)
    with pytest.raises(InvalidJob, match=r"shard must be \[index, count\]"):
        SensitivitySpec(scheme="FP8", shard=(2, 2))
    assert SensitivitySpec.from_params({"scheme": "FP8", "shard": [1, 2]}).shard == (1, 2)


def test_queueing_a_sharded_sweep_writes_one_listed_sweep_and_its_shard_rows_each_sent(qp_settings):
    from jobs.client import submit_job
    from tests.factories import stored_model

    with session_scope(qp_settings) as s:
        model = stored_model(s)
    parent = submit_job("sensitivity", {"scheme": "FP8", "shards": 3}, model_id=model.id, settings=qp_settings)
    with session_scope(qp_settings) as s:
        shards = shard_rows.shards_of(s, parent.id)
        listed = repo.list_jobs(s)
        counted = repo.count_jobs(s, kind="sensitivity")
    assert parent.status == "queued" and parent.params["shards"] == 3 and parent.celery_task_id
    assert [sh.shard for sh in shards] == [0, 1, 2] and {sh.shards for sh in shards} == {3}
    assert [sh.job.params["shard"] for sh in shards] == [[0, 3], [1, 3], [2, 3]]
    assert all(sh.job.celery_task_id and sh.job.queue == "cpu" for sh in shards)
    assert len({sh.job.celery_task_id for sh in shards} | {parent.celery_task_id}) == 4
    assert [j.id for j in listed] == [parent.id] and counted == 1  # the shards are the sweep's, not listed
