"""The worker's Celery app: a thin task per job kind, registered under the name the senders use (jobs.routing)."""

from __future__ import annotations

import pytest

from jobs.routing import TASK_NAMES
from worker.bodies import KINDS, body_for


def test_the_worker_registers_a_task_under_each_job_kinds_name():
    import worker.tasks  # noqa: F401 (registers the tasks)
    from worker.celery_app import celery_app

    assert set(TASK_NAMES.values()) <= set(celery_app.tasks)
    assert "worker.tasks" in celery_app.conf.include


def test_every_job_kind_has_a_body_named_after_it():
    assert set(KINDS) == set(TASK_NAMES)
    for kind in KINDS:
        body = body_for(kind)
        assert body.__name__ == kind and body.__module__ == f"worker.bodies.{kind}"


def test_an_unknown_kind_has_no_body():
    with pytest.raises(ValueError, match="no job body for kind 'export'"):
        body_for("export")


def test_a_task_runs_its_kinds_body_by_job_id(monkeypatch):
    import worker.tasks

    ran: list[tuple[int, str]] = []
    monkeypatch.setattr(worker.tasks, "run_job", lambda job_id, body: ran.append((job_id, body.__name__)) or "ok")
    assert worker.tasks.calibrate_task.run(7) == "ok" and worker.tasks.bench_task.run(8) == "ok"
    assert ran == [(7, "calibrate"), (8, "bench")]
