"""The automatic plan as a command (quantplan.services.autoplan.AutoPlan): validate() refuses, with a message for a
person and nothing saved, what cannot be answered; run() saves the plan version and queues its verification once."""

from __future__ import annotations

import pytest

from quantplan.services import autoplan as autoplan_svc
from quantplan.services import jobs as jobs_svc
from quantplan.services import plans as plans_svc
from quantplan.services.errors import Refused
from store import repo
from store.db import session_scope
from tests.factories import smol_linears, stored_smol_model


@pytest.fixture
def model(qp_settings):
    with session_scope(qp_settings) as s:
        return stored_smol_model(s)


def _sweep(qp_settings, model, scheme: str = "INT8_PER_TENSOR") -> None:
    with session_scope(qp_settings) as s:
        job = repo.create_job(s, kind="sensitivity", params={"scheme": scheme}, queue="cpu", user=None,
                              model_id=model.id)
        repo.save_sensitivity(s, job_id=job.id, model_id=model.id, scheme=scheme,
                              rows=[{"layer": lin["name"], "layers": [lin["name"]], "kl_mean": 0.001,
                                     "top1_agree": 0.99, "sqnr_db": 30.0} for lin in smol_linears()])
        repo.finish_job(s, job.id, status="succeeded", result={"units": len(smol_linears()), "scheme": scheme})


def test_a_model_without_sweeps_is_refused_before_anything_is_saved(model) -> None:
    command = autoplan_svc.AutoPlan(model, kl_budget=0.1, target="h100")
    with pytest.raises(Refused, match="smol has no sensitivity sweep yet: run one per candidate scheme first"):
        command.validate()
    with pytest.raises(Refused):
        command.run()
    assert plans_svc.list_plans(model.id) == [] and jobs_svc.list_jobs() == []


def test_an_unknown_cost_and_an_unmeasured_kv_cache_are_refused_with_what_to_do(qp_settings, model) -> None:
    _sweep(qp_settings, model)
    with pytest.raises(Refused, match="unknown cost 'speed'; choose one of: auto, bits, ideal"):
        autoplan_svc.AutoPlan(model, kl_budget=0.1, target="h100", cost="speed").validate()
    with pytest.raises(Refused, match=r"the KL of a FP8 KV cache on smol is not known yet: score it alone first"):
        autoplan_svc.AutoPlan(model, kl_budget=0.1, target="h100", kv_cache="FP8").validate()
    assert plans_svc.list_plans(model.id) == []


def test_a_refusal_is_a_value_error_as_the_pages_and_the_cli_catch_it(model) -> None:
    with pytest.raises(ValueError):
        autoplan_svc.AutoPlan(model, kl_budget=0.1, target="h100").run()


def test_run_saves_one_version_per_question_and_queues_its_verification_once(qp_settings, model) -> None:
    _sweep(qp_settings, model)
    queued = []

    def queue_job(kind, params, *, model_id, plan_id):
        queued.append((kind, params, plan_id))
        with session_scope(qp_settings) as s:
            return repo.create_job(s, kind=kind, params=params, queue="local", user=None, model_id=model_id,
                                   plan_id=plan_id)

    command = autoplan_svc.AutoPlan(model, kl_budget=1.0, target="h100", cost="bits", queue_job=queue_job)
    assert command.plan_name() == "auto-h100-kl1-bits"
    result, plan, job = command.run()
    assert plan.name == "auto-h100-kl1-bits" and plan.version == 1 and result.predicted_kl <= 1.0
    assert [(k, p["label"], i) for k, p, i in queued] == [("score", plan.label, plan.id)] and job.plan_id == plan.id
    again, same, same_job = autoplan_svc.AutoPlan(model, kl_budget=1.0, target="h100", cost="bits",
                                                  queue_job=queue_job).run()
    assert same.id == plan.id and same_job.id == job.id and len(queued) == 1  # asked again: nothing new
    assert any("no new version saved" in note for note in again.notes)
