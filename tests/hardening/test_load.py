"""Load held: a few hundred tiny real jobs on two real workers (the embedded SQLite broker), one SIGKILLed midway.

Every job ends succeeded or failed (none left queued or running), none runs twice (each worker's log says once per
job that it marked it running), the killed worker's job at most is failed (by the survivor's own sweep), and the
whole takes bounded time. Figures: docs/results/hardening.md, section "workers".
"""

from __future__ import annotations

import time

import pytest

from store import repo
from store.db import session_scope
from tests.hardening.test_workers import STALE_S, runs_of, sqlite_deployment, stale_env, start_workers, stop_all

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

__all__ = ["sqlite_deployment", "stale_env"]  # fixtures this module uses

JOBS = 300
TINY_BENCH = {"device": "cpu", "m": [1], "budget_s": 0.1, "paths": ["baseline"]}  # the first times one GEMM; the
# others reuse its stored result: a real job through the broker, the runner and the database, in a tenth of a second
WITHIN_S = 170  # from the first submission to the last job's end, on a loaded 2-core machine


def _counts(settings, ids: list[int]) -> dict[str, int]:
    with session_scope(settings) as s:
        jobs = [repo.get_job(s, i) for i in ids]
    out: dict[str, int] = {}
    for j in jobs:
        out[j.status] = out.get(j.status, 0) + 1
    return out


def test_hundreds_of_tiny_jobs_on_two_workers_one_killed_all_end_once(sqlite_deployment, tmp_path):
    from jobs.client import submit_job

    s = sqlite_deployment
    workers = start_workers(tmp_path, "first", "second")
    victim, survivor = workers
    try:
        started = time.monotonic()
        ids = [submit_job("bench", TINY_BENCH, settings=s).id for _ in range(JOBS)]
        submitted_s = time.monotonic() - started
        deadline = started + WITHIN_S
        while _counts(s, ids).get("succeeded", 0) < JOBS // 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        victim.p.kill()  # SIGKILL, midway: most likely inside a job
        victim.p.wait(timeout=60)
        killed_at = time.monotonic() - started
        while time.monotonic() < deadline:
            counts = _counts(s, ids)
            if counts.get("queued", 0) + counts.get("running", 0) == 0:
                break
            time.sleep(0.5)
        total_s = time.monotonic() - started
        counts = _counts(s, ids)
        assert set(counts) <= {"succeeded", "failed"}, (counts, total_s)
        with session_scope(s) as session:
            failed = [repo.get_job(session, i) for i in ids if repo.get_job(session, i).status == "failed"]
        assert len(failed) <= 1 and all("the worker stopped reporting" in j.error for j in failed), failed
        logs = [w.text() for w in workers]
        runs = {i: sum(runs_of(text, i) for text in logs) for i in ids}
        assert max(runs.values()) == 1, {i: n for i, n in runs.items() if n > 1}  # none ran twice
        assert sum(runs.values()) == counts.get("succeeded", 0) + len(failed)
        per_worker = [sum(runs_of(text, i) for i in ids) for text in logs]
        assert all(per_worker), per_worker  # both worked
        print(f"\n{JOBS} jobs: submitted in {submitted_s:.1f} s; worker killed at {killed_at:.1f} s after "
              f"{per_worker[0]} jobs; all ended in {total_s:.1f} s: {counts}; runs per worker {per_worker}; "
              f"stale limit {STALE_S} s")
    finally:
        stop_all(workers)
