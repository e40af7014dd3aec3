"""Removing a model keeps its history readable, marked removed, and takes it out of new work; only an admin purges
it, audited; a plan version is chosen for a model with who, when and why, one at a time, its history in the audit
log, and its exports say so (issue 44 items 3 and 6)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from jobs.errors import InvalidJob
from quantplan.services import access
from quantplan.services import choices as choices_svc
from quantplan.services import exchange as exchange_svc
from quantplan.services import jobs as jobs_svc
from quantplan.services import models as models_svc
from quantplan.services import notes as notes_svc
from quantplan.services import plans as plans_svc
from quantplan.services import queue as queue_svc
from store import repo
from store.db import session_scope
from tests.factories import run_cli, run_cli_json, stored_model

LINEARS = [{"name": f"model.layers.0.mlp.{p}", "in_features": 8, "out_features": 8}
           for p in ("gate_proj", "up_proj", "down_proj")]


@pytest.fixture
def team(qp_settings):
    """ann (admin), bob (member), cyd (viewer); model tiny (files on disk) with two plan versions, a job, a note."""
    ann = access.sign_in("ann@example.com")
    cyd = access.sign_in("cyd@example.com")
    access.sign_in("bob@example.com")
    with access.acting(ann):
        access.set_role("bob@example.com", "member")
    bob = access.Actor("bob@example.com", "member")
    with session_scope(qp_settings) as s:
        model = stored_model(s, "tiny")
        repo.add_model_summary_fields(s, model.id, {"linears": LINEARS}, replace=("linears",))
        job = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="bob@example.com",
                              model_id=model.id)
        repo.finish_job(s, job.id, status="succeeded", result={"layers": 3})
    folder = Path(qp_settings.artifact_dir) / model.path
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    with access.acting(bob):
        v1 = plans_svc.save_plan(model.id, "p", {"default": "FP8_DYNAMIC"})
        v2 = plans_svc.save_plan(model.id, "p", {"default": "INT8_W8A8"})
        notes_svc.add_note("model", model.id, "the base model", ["base"])
    return {"admin": ann, "member": bob, "viewer": cyd, "model": model, "job": job, "v1": v1, "v2": v2,
            "folder": folder, "settings": qp_settings}


def test_a_removed_model_keeps_its_history_marked_and_takes_no_new_work(team):
    model = team["model"]
    with access.acting(team["admin"]):
        removed = models_svc.remove_model(model.id)
    assert removed.removed and removed.removed_by == "ann@example.com" and removed.removed_at is not None
    assert not team["folder"].exists()  # its files are freed
    assert [m.name for m in models_svc.list_models()] == []  # out of pickers and listings for new work
    assert [(m.name, m.removed) for m in models_svc.list_models(include_removed=True)] == [("tiny", True)]
    assert [m.id for m in models_svc.removed_models()] == [model.id]
    # its history reads as before, with the marker
    assert models_svc.get_model("tiny").removed_by == "ann@example.com"
    assert [p.label for p in plans_svc.list_plans(model.id)] == ["p v1", "p v2"]
    assert jobs_svc.get_job(team["job"].id).model_id == model.id
    assert jobs_svc.jobs_model([jobs_svc.get_job(team["job"].id)]) == {team["job"].id: "tiny (removed)"}
    with session_scope(team["settings"]) as s:  # a failed job of the removed model: the Jobs page offers no retry
        failed = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="bob@example.com",
                                 model_id=model.id)
        repo.finish_job(s, failed.id, status="failed", error="boom")
    assert re.match(rf"tiny was removed by ann@example.com on .* UTC: its files are gone, so job #{failed.id} cannot "
                    "run on it", jobs_svc.retry_refusal(jobs_svc.get_job(failed.id)) or "")
    assert [n.text for n in notes_svc.notes("model", model.id)] == ["the base model"]
    with access.acting(team["member"]):
        with pytest.raises(InvalidJob, match=r"tiny was removed by ann@example.com on .* UTC: its files are gone, "
                                             r"so a calibrate job cannot run on it"):
            queue_svc.submit("calibrate", {"samples": 1, "seq_len": 16}, model_id=model.id)
        with pytest.raises(access.Refused, match="so a new plan version cannot run on it"):
            plans_svc.save_plan(model.id, "p", {"default": "FP8_DYNAMIC"})
        with pytest.raises(access.Refused, match="so a plan choice cannot run on it"):
            choices_svc.choose_plan(team["v2"].id, "too late")
    with access.acting(team["admin"]):
        with pytest.raises(access.Refused, match="was removed by ann@example.com on .* already"):
            models_svc.remove_model(model.id)
        log = access.audit_log(action="remove-model")
    assert [(a.actor, a.target, a.detail["plan versions"]) for a in log] == [
        ("ann@example.com", f"model #{model.id} tiny", 2)]


def test_only_an_admin_purges_and_only_a_removed_model(team):
    model = team["model"]
    with access.acting(team["member"]):
        with pytest.raises(access.Forbidden, match="bob@example.com is a member: purging a removed model needs the "
                                                   "admin role"):
            models_svc.purge_model(model.id)
    with access.acting(team["admin"]):
        with pytest.raises(access.Refused, match="tiny is not removed: remove it first"):
            models_svc.purge_model(model.id)
        models_svc.remove_model(model.id)
        models_svc.purge_model(model.id)
        log = access.audit_log(action="purge-model")
    with pytest.raises(LookupError, match="no model 'tiny'"):
        models_svc.get_model("tiny")
    assert plans_svc.list_plans(model.id) == [] and models_svc.list_models(include_removed=True) == []
    job = jobs_svc.get_job(team["job"].id)  # its jobs stay, naming it
    assert job.model_id is None and job.params[repo.REMOVED_MODEL_KEY] == "tiny"
    assert [n.text for n in notes_svc.notes("model", model.id)] == ["the base model"]  # notes outlive their target
    assert log[0].actor == "ann@example.com" and log[0].detail["removed_by"] == "ann@example.com"


def test_a_chosen_version_says_who_when_why_one_at_a_time_with_its_history(team):
    model, v1, v2 = team["model"], team["v1"], team["v2"]
    with access.acting(team["viewer"]):
        with pytest.raises(access.Forbidden, match="cyd@example.com is a viewer: choosing a plan version needs the "
                                                   "member role"):
            choices_svc.choose_plan(v1.id, "fine")
    with access.acting(team["member"]):
        with pytest.raises(access.Refused, match="say why this version is chosen"):
            choices_svc.choose_plan(v1.id, "   ")
        first = choices_svc.choose_plan(v1.id, "FP8 fits one H100")
        second = choices_svc.choose_plan(v2.id, "INT8 scored lower KL")
    assert (first.label, first.chosen_by, first.why) == ("p v1", "bob@example.com", "FP8 fits one H100")
    chosen = choices_svc.chosen_for(model.id)
    assert chosen == second and (chosen.label, chosen.why) == ("p v2", "INT8 scored lower KL")
    assert choices_svc.chosen_plans() == {model.id: second}  # one per model: the second replaced the first
    history = choices_svc.choice_history(model.id)
    assert [(h["plan"], h["by"], h["replaced"]) for h in history] == [("p v2", "bob@example.com", "p v1"),
                                                                      ("p v1", "bob@example.com", None)]

    recipe = exchange_svc.export_plan(model, v2.body, "llmcompressor", plan=v2)
    first_line = recipe.splitlines()[0]
    assert first_line.startswith("# quantplan: p v2 is the version chosen for tiny, by bob@example.com on ")
    assert first_line.endswith("UTC: INT8 scored lower KL") and "QuantizationModifier" in recipe
    assert not exchange_svc.export_plan(model, v1.body, "llmcompressor", plan=v1).startswith("# quantplan:")
    config = exchange_svc.export_plan(model, v2.body, "compressed-tensors", plan=v2)
    assert json.loads(config) == json.loads(exchange_svc.export_plan(model, v2.body, "compressed-tensors"))

    with access.acting(team["member"]):
        assert choices_svc.unchoose(model.id) == second
    assert choices_svc.chosen_for(model.id) is None
    assert choices_svc.choice_history(model.id)[0]["action"] == "unchoose-plan"


def test_plan_choose_and_models_purge_on_the_command_line(team, capsys):
    out = run_cli_json(capsys, "plan", "choose", "tiny", "p", "--version", "1", "--why", "baseline", "--json")
    assert (out["plan"], out["version"], out["chosen_by"], out["why"]) == ("p", 1, "tester", "baseline")
    code, _, err = run_cli(capsys, "plan", "choose", "tiny", "p", "--version", "7", "--why", "x")
    assert code == 1 and "plan 'p' of tiny has no version 7 (versions: 1, 2)" in err
    code, _, err = run_cli(capsys, "plan", "choose", "tiny", "q", "--why", "x")
    assert code == 1 and "tiny has no plan 'q' (its plans: p)" in err
    code, out_text, _ = run_cli(capsys, "plan", "choose", "tiny", "p", "--why", "newest")  # default: the newest
    assert code == 0 and out_text.startswith("p v2 is the version chosen for tiny, by tester on ")
    code, recipe, err = run_cli(capsys, "plan", "export", "p@v2", "--format", "llmcompressor")
    assert code == 0 and recipe.startswith("# quantplan: p v2 is the version chosen for tiny, by tester on "), err
    code, _, err = run_cli(capsys, "models", "purge", "tiny", "--yes")
    assert code == 1 and "tiny is not removed: remove it first" in err
    assert run_cli_json(capsys, "models", "remove", "tiny", "--yes", "--json")["removed_by"] == "tester"
    gone = run_cli_json(capsys, "models", "list", "--removed", "--json")
    assert [(m["name"], m["removed_by"]) for m in gone] == [("tiny", "tester")]
    assert run_cli_json(capsys, "models", "purge", "tiny", "--yes", "--json")["purged"] == team["model"].id
    assert run_cli_json(capsys, "models", "list", "--removed", "--json") == []
