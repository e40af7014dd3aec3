"""A temporary store (SQLite) with the tiny Llama registered, and a way to run one job body as a plain function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from jobs.client import create_local_job
from jobs.specs import JobSpec
from store.records import JobRecord
from tests.factories import save_tiny_llama
from tests.steady_timings import steady_kernel_timings  # noqa: F401 - autouse here
from worker.bodies import body_for
from worker.runner import run_job

RunBody = Callable[..., JobRecord]


@pytest.fixture
def run_body(qp_settings) -> RunBody:
    """``run_body(kind, params, model_id=, plan_id=)``: write a local job of ``kind`` (params: a spec or a dict, as
    a client would send it), run its body in this process through the runner, and return the job as it ended."""
    from store import repo
    from store.db import session_scope

    def run(kind: str, params: JobSpec | dict[str, Any], *, model_id: int | None = None,
            plan_id: int | None = None) -> JobRecord:
        job = create_local_job(kind, params, model_id=model_id, plan_id=plan_id, settings=qp_settings)
        run_job(job.id, body_for(kind), settings=qp_settings)
        with session_scope(qp_settings) as s:
            return repo.get_job(s, job.id)

    return run


@pytest.fixture
def tiny_llama(run_body, tmp_path) -> int:
    """The id of a registered 2-layer Llama (15 linears), its loaded copy forgotten so each test loads it anew."""
    from worker.bodies import shared

    shared._MODEL_CACHE.clear()
    job = run_body("register", {"source": str(save_tiny_llama(tmp_path / "tiny-llama")), "name": "tiny"})
    assert job.status == "succeeded", job.error
    return job.result["model_id"]
