"""A removed model's checkpoint registered again (issue 44): the same row comes back, live, with the plans and
results it kept, and its files stored again; a registration by another name keeps the name it had."""

from __future__ import annotations

from pathlib import Path

from tests.factories import run_cli_json


def test_registering_a_removed_models_checkpoint_again_brings_it_back_with_its_history(tiny_model, capsys, tmp_path,
                                                                                       qp_settings):
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc

    plan = plans_svc.save_plan(tiny_model["model_id"], "kept", {"default": "FP8_DYNAMIC"})
    model = models_svc.get_model("tiny")
    folder = Path(qp_settings.artifact_dir) / model.path
    run_cli_json(capsys, "models", "remove", "tiny", "--yes", "--json")
    assert not folder.exists() and models_svc.list_models() == []

    again = run_cli_json(capsys, "models", "add", str(tmp_path / "tiny-llama"), "--name", "tiny-again", "--json")
    assert (again["model_id"], again["name"]) == (model.id, "tiny")  # the same row, under the name it had
    back = models_svc.get_model(model.id)
    assert not back.removed and back.removed_by is None and folder.is_dir()
    assert [m.name for m in models_svc.list_models()] == ["tiny"]
    assert [p.id for p in plans_svc.list_plans(model.id)] == [plan.id]
