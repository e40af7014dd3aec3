"""The client: a job's row is written only for parameters its spec accepts, then its task is sent by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jobs import client
from jobs.errors import InvalidJob
from jobs.specs import BenchSpec, CalibrateSpec, ScoreSpec
from store import repo
from store.db import session_scope


@pytest.fixture
def sent(monkeypatch):
    """The tasks sent, instead of a broker: (name, args, queue) each."""
    out: list[tuple[str, list, str]] = []

    class Broker:
        def send_task(self, name, args, queue):
            out.append((name, args, queue))
            return SimpleNamespace(id=f"task-{len(out)}")

    monkeypatch.setattr(client, "celery_client", lambda settings=None: Broker())
    return out


def _jobs(settings):
    with session_scope(settings) as s:
        return repo.list_jobs(s, limit=50)


def test_a_spec_is_stored_as_its_json_and_sent_by_task_name_to_its_queue(qp_settings, sent):
    job = client.submit_job("bench", BenchSpec(device="cuda", m=[1, 16]), settings=qp_settings)
    assert job.params == {"device": "cuda", "m": [1, 16], "budget_s": 60.0}
    assert (job.queue, job.status, job.requested_by, job.celery_task_id) == ("gpu", "queued", "tester", "task-1")
    assert sent == [("quantplan.bench", [job.id], "gpu")]


def test_a_params_dict_is_checked_by_its_spec_and_stored_as_given(qp_settings, sent):
    params = {"device": "cpu", "samples": 3, "seq_len": 16, "user": "tester"}
    job = client.submit_job("calibrate", params, settings=qp_settings)
    assert job.params == params and sent[0][0] == "quantplan.calibrate"


def test_parameters_out_of_range_queue_nothing(qp_settings, sent):
    with pytest.raises(InvalidJob, match="calibrate job's samples"):
        client.submit_job("calibrate", {"samples": -1}, settings=qp_settings)
    with pytest.raises(InvalidJob, match="unknown job kind"):
        client.submit_job("export", {}, settings=qp_settings)
    assert _jobs(qp_settings) == [] and sent == []


def test_a_spec_of_another_kind_is_refused(qp_settings, sent):
    with pytest.raises(InvalidJob, match="a calibrate job's parameters were given for a score job"):
        client.submit_job("score", CalibrateSpec(), settings=qp_settings)
    assert sent == []


def test_a_local_job_is_written_on_the_local_queue_and_sent_nowhere(qp_settings, sent):
    job = client.create_local_job("score", ScoreSpec(scheme="FP8_DYNAMIC", samples=2), settings=qp_settings)
    assert (job.queue, job.status, job.params["scheme"], job.params["samples"]) == ("local", "queued",
                                                                                    "FP8_DYNAMIC", 2)
    assert sent == []


def test_waiting_for_a_job_returns_it_once_finished_or_when_time_is_up(qp_settings, sent):
    job = client.create_local_job("calibrate", CalibrateSpec(), settings=qp_settings)
    seen = []
    assert client.wait_for(job.id, timeout_s=0, poll_s=0, on_update=seen.append, settings=qp_settings).status == \
        "queued"
    with session_scope(qp_settings) as s:
        repo.finish_job(s, job.id, status="failed", message="failed", error="no")
    assert client.wait_for(job.id, poll_s=0, settings=qp_settings).status == "failed"
    assert len(seen) == 1


def test_a_score_of_an_encoder_is_refused_before_anything_is_queued(qp_settings, sent):
    with session_scope(qp_settings) as s:
        bert = repo.add_model(s, name="bert", sha256="b" * 64, source_kind="folder", source_name="bert",
                              path="models/b", user="t",
                              summary={"architecture": "BertModel", "model_type": "bert", "causal_lm": False,
                                       "num_layers": 2, "num_params": 1, "dtype": "float32", "total_bytes": 4,
                                       "linears": []})
    with pytest.raises(InvalidJob, match="bert is a BertModel \\(bert\\), not a causal language model"):
        client.submit_job("score", ScoreSpec(scheme="FP8_DYNAMIC"), model_id=bert.id, settings=qp_settings)
    assert client.create_local_job("calibrate", CalibrateSpec(), model_id=bert.id, settings=qp_settings).kind == \
        "calibrate"  # its calibration works
    assert sent == [] and [j.kind for j in _jobs(qp_settings)] == ["calibrate"]


def test_a_zero_asked_for_now_is_refused_although_an_old_rows_zero_reads_as_the_default(qp_settings, sent):
    """A dict of parameters given now (a page, `plan auto`'s verifying score) with budget_s 0 or samples 0 was
    queued with the default (0 read as "not given", as a row of an older version is still read); it is refused by
    the parameter's rule, nothing written. Retrying an old row whose 0 meant the default queues its spec's JSON."""
    from quantplan.services import jobs as jobs_svc

    for kind, params, said in (("bench", {"budget_s": 0}, "bench job's budget_s must be more than 0"),
                               ("calibrate", {"samples": 0}, "calibrate job's samples must be between 1"),
                               ("bench", {"tensor_parallel": 0}, "tensor_parallel must be between 1 and 1024")):
        with pytest.raises(InvalidJob, match=said):
            client.submit_job(kind, params, settings=qp_settings)
    assert _jobs(qp_settings) == [] and sent == []
    from tests.factories import stored_model

    with session_scope(qp_settings) as s:  # as an older version wrote it, then failed
        model = stored_model(s)
        old = repo.create_job(s, kind="calibrate", params={"samples": 0, "seq_len": 16}, queue="cpu", user="ann",
                              model_id=model.id)
        repo.finish_job(s, old.id, status="failed", error="lost")
    again = jobs_svc.retry_job(old.id)
    assert again.params["samples"] == CalibrateSpec.samples and again.params["seq_len"] == 16
