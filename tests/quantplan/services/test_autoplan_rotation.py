"""The automatic plan weighing a rotation (issue #46): searched on the unrotated sweeps and on those made rotated,
the cheaper plan under the budget kept, its plan file rotating the model where that one won; refused, naming the
command to run, without a rotated sweep."""

from __future__ import annotations

import pytest

from quantplan.services import autoplan as autoplan_svc
from quantplan.services import plans as plans_svc
from quantplan.services.errors import Refused
from store import repo
from store.db import session_scope
from tests.factories import smol_linears, stored_smol_model


@pytest.fixture
def model(qp_settings):
    with session_scope(qp_settings) as s:
        return stored_smol_model(s)

ROTATION = {"kind": "hadamard", "rotations": ["R1", "R2", "R4"]}


def _sweep(qp_settings, model, kl: float, rotation=None, scheme: str = "MXFP4") -> None:
    with session_scope(qp_settings) as s:
        job = repo.create_job(s, kind="sensitivity", params={"scheme": scheme, **({"rotation": rotation} if rotation
                                                                                  else {})},
                              queue="cpu", user=None, model_id=model.id)
        repo.save_sensitivity(s, job_id=job.id, model_id=model.id, scheme=scheme,
                              rows=[{"layer": lin["name"], "layers": [lin["name"]], "kl_mean": kl,
                                     "top1_agree": 0.99, "sqnr_db": 30.0} for lin in smol_linears()])
        repo.finish_job(s, job.id, status="succeeded", result={"units": len(smol_linears()), "scheme": scheme,
                                                               **({"rotation": rotation} if rotation else {})})


def _auto(model, rotation=ROTATION, budget=None):
    budget = budget if budget is not None else 0.002 * len(smol_linears())
    return autoplan_svc.AutoPlan(model, kl_budget=budget, target="h100", cost="bits", verify=False,
                                 rotation=rotation, correct=False, sensitivity="kl")


def test_the_rotation_is_kept_where_its_sweeps_make_the_plan_cheaper(qp_settings, model) -> None:
    _sweep(qp_settings, model, kl=0.01)  # unrotated: MXFP4 on a few units only under the budget
    _sweep(qp_settings, model, kl=0.001, rotation={"kind": "hadamard"})  # rotated: on every unit
    command = _auto(model)
    result, plan, _ = command.run()
    assert command.rotated and set(result.plan.values()) == {"MXFP4"}
    assert plan.body["transforms"] == {"rotation": ROTATION} and plan.name.endswith("-rot")
    assert any(n.startswith("rotation hadamard R1+R2+R4 chosen") for n in result.notes)
    plain, _, _ = _auto(model, rotation=None).run()  # without --rotation: the unrotated sweeps only, as before
    assert set(plain.plan.values()) == {"MXFP4", "BF16"} and result.cost < plain.cost


def test_the_rotation_is_left_out_where_it_costs_no_less(qp_settings, model) -> None:
    _sweep(qp_settings, model, kl=0.001)
    _sweep(qp_settings, model, kl=0.01, rotation=ROTATION)
    command = _auto(model)
    result, plan, _ = command.run()
    assert not command.rotated and "transforms" not in plan.body
    assert any(n.startswith("rotation hadamard R1+R2+R4 not chosen") for n in result.notes)


def test_no_rotated_sweep_is_refused_naming_the_sweep_to_run(qp_settings, model) -> None:
    _sweep(qp_settings, model, kl=0.001)
    with pytest.raises(Refused, match=r"no sweep made rotated \(hadamard R1\+R2\+R4 /64\).*--rotation hadamard "
                                      r"--rotation-block 64"):
        _auto(model, rotation={"kind": "hadamard", "block_size": 64}).run()
    with pytest.raises(Refused, match="'kind' must be one of"):
        _auto(model, rotation={"kind": "givens"}).run()
    assert plans_svc.list_plans(model.id) == []
