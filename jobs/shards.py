"""Sharded sensitivity sweeps: a sweep's units split into shard tasks queued as one Celery chord.

A sweep asked with ``shards`` > 1 (or, with ``shards`` unset, on a queue that more than one live worker consumes)
becomes one parent job row (the sweep the pages and the CLI show) and one job row per shard
(:mod:`store.shards`), sent as a Celery ``chord``: a ``group`` of :data:`SHARD_TASK` tasks, one per shard, each
taken by whichever worker of the queue is free, and the :data:`MERGE_TASK` callback, which merges the shards' rows
into the parent's (worker.bodies.sweep_shards). The chord needs a result backend: Redis in the team setup (its
native chord counter), the embedded SQLite one through Celery's ``celery.chord_unlock`` task, which polls the
group's results each second on the callback's queue (so any worker of that queue runs it).

Shard ``i`` of ``n`` sweeps units ``i, i + n, i + 2n, ...`` of the model-order unit list (:func:`shard_part`):
an early unit reruns more blocks than a late one, and dealing them out in turn gives every shard the same mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from jobs.specs import SensitivitySpec
from jobs.workers import live_workers
from store.settings import Settings
from store.shards import SHARD_ATTEMPTS  # a failed or lost shard runs once more, alone

SHARD_TASK = "quantplan.sensitivity_shard"
MERGE_TASK = "quantplan.sensitivity_merge"

T = TypeVar("T")


def shard_part(units: Sequence[T], index: int, count: int) -> list[T]:
    """The units shard ``index`` of ``count`` sweeps: every ``count``-th from ``index`` (model order kept)."""
    if not 0 <= index < count:
        raise ValueError(f"shard {index} of {count}: the index must be at least 0 and below the count")
    return list(units[index::count])


def merged_rows(parts: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The one sweep's rows from its shards' (each row with its ``unit_index`` in the whole sweep's unit order):
    in unit order, then sorted by ``kl_mean``, largest first, ties in unit order, as the unsharded sweep sorts
    them (quantcore.evaluation.sensitivity); ``unit_index`` dropped. ValueError when a unit is missing or twice."""
    rows = sorted((r for part in parts for r in part), key=lambda r: int(r["unit_index"]))
    seen = [int(r["unit_index"]) for r in rows]
    if seen != list(range(len(rows))):
        missing = sorted(set(range(max(seen, default=-1) + 1)) - set(seen))
        raise ValueError(f"the shards' rows do not cover the sweep's units once each (missing units {missing[:10]}, "
                         f"{len(seen) - len(set(seen))} twice)")
    rows.sort(key=lambda r: r["kl_mean"], reverse=True)
    return [{k: v for k, v in r.items() if k != "unit_index"} for r in rows]


def live_on(queue: str, settings: Settings | None = None) -> int:
    """The live workers consuming ``queue`` (jobs.workers): a sweep's shard count when it asks for none."""
    return sum(1 for w in live_workers(settings) if queue in w.queues)


def shard_count(spec: SensitivitySpec, queue: str, settings: Settings | None = None) -> int:
    """How many shards a sweep runs as: its ``shards``, else one per live worker on its queue (at least 1)."""
    if spec.shard is not None:
        return 1  # a shard's own row: never split again
    if spec.shards is None and getattr(spec, "method", "kl") == "fisher":
        return 1  # the estimate is a few backward passes over every unit at once: split, each shard pays for them
    if spec.shards is not None:
        return spec.shards
    return max(1, live_on(queue, settings))


__all__ = ["MERGE_TASK", "SHARD_ATTEMPTS", "SHARD_TASK", "live_on", "merged_rows", "shard_count", "shard_part"]
