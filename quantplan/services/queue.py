"""Queueing a job for the workers under the current user: through the jobs client, by task name, its parameters
checked against the job kind's spec (jobs.specs) before anything is written."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jobs.client import submit_job
from jobs.specs import JobSpec
from quantplan.services import access
from quantplan.services.deployment import settings
from store.records import JobRecord


def submit(kind: str, params: Mapping[str, Any] | JobSpec, *, model_id: int | None = None,
           plan_id: int | None = None) -> JobRecord:
    """Queue a job of ``kind`` asked by the current user (QUANTPLAN_USER): ``params`` as its JSON dict (stored as
    given, with ``user`` added) or as its spec (built with ``user``). InvalidJob (a ValueError), nothing queued, for
    parameters the spec refuses or a model that cannot run the job; access.Forbidden for a viewer."""
    user = access.require("queue").name
    stored = params.with_changes(user=user) if isinstance(params, JobSpec) else {**params, "user": user}
    return submit_job(kind, stored, model_id=model_id, plan_id=plan_id, user=user, settings=settings())
