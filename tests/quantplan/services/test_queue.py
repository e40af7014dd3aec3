"""Queueing through the application layer (quantplan.services.queue, .calibration, .workers): the current user is
recorded, a spec's JSON is what the row stores, parameters the spec refuses queue nothing, and a job with no live
worker on its queue is said to wait."""

from __future__ import annotations

import pytest

from jobs.errors import InvalidJob
from jobs.specs import BenchSpec, CalibrateSpec
from quantplan.services import calibration as calibration_svc
from quantplan.services import jobs as jobs_svc
from quantplan.services import queue as queue_svc
from quantplan.services import workers as workers_svc


def test_a_job_is_queued_under_the_current_user_as_given_or_from_its_spec(qp_settings) -> None:
    given = queue_svc.submit("bench", {"device": "cpu", "m": [1]})
    assert given.params == {"device": "cpu", "m": [1], "user": "tester"}
    built = queue_svc.submit("bench", BenchSpec(m=(16,)))
    assert built.params["m"] == [16] and built.params["user"] == "tester"
    with pytest.raises(InvalidJob, match="budget_s"):
        queue_svc.submit("bench", {"device": "cpu", "budget_s": -1})
    assert len(jobs_svc.list_jobs()) == 2  # the refused one queued nothing


def test_a_calibration_takes_the_specs_defaults_and_refuses_sizes_it_cannot_use(qp_settings) -> None:
    from store import repo
    from store.db import session_scope

    with session_scope(qp_settings) as s:
        model = repo.add_model(s, name="m", sha256="ef" * 32, source_kind="folder", source_name="m", path="models/m",
                               summary={"linears": []}, user="tester")
    job = calibration_svc.submit_calibration(model.id)
    assert (job.params["samples"], job.params["seq_len"]) == (CalibrateSpec.samples, CalibrateSpec.seq_len)
    with pytest.raises(InvalidJob, match="samples"):
        calibration_svc.submit_calibration(model.id, samples=0)
    assert [j.id for j in jobs_svc.list_jobs()] == [job.id]  # the refused one queued nothing


def test_a_queue_no_live_worker_consumes_is_said_to_wait(qp_settings) -> None:
    assert workers_svc.live_workers() == [] and workers_svc.idle_queues(["cpu", "local"]) == ["cpu"]
    assert "quantplan worker --queues gpu" in workers_svc.no_worker_note("gpu")
    assert workers_svc.no_worker_note("local") is None
