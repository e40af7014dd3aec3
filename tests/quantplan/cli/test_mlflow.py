"""Every finished job also an MLflow run (QUANTPLAN_MLFLOW_TRACKING_URI, worker.mlflow_log; issue 44 item 7): a real
score job run through the command is read back from a SQLite tracking store with MlflowClient, with its parameters,
metrics, plan file and recipe, and its model / plan / person tags; a tracking store that cannot be reached never
fails a job, and says so in its message."""

from __future__ import annotations

import pytest

from tests.conftest import clear_settings_cache
from tests.factories import run_cli_json

pytest.importorskip("mlflow", reason="mlflow-skinny is in the test extra (pip install -e '.[test]')")


def _runs(uri: str, experiment: str = "quantplan"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} at {uri}"
    return client, client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])


def test_a_finished_score_job_is_an_mlflow_run_with_its_figures_plan_and_recipe(tiny_model, capsys, tmp_path,
                                                                               monkeypatch):
    from quantplan.services import scoring as scoring_svc

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("QUANTPLAN_MLFLOW_TRACKING_URI", uri)
    clear_settings_cache()
    plan_file = tmp_path / "int8.yaml"
    plan_file.write_text("name: int8\nmodel: tiny\ndefault: INT8_W8A8\n")
    done = run_cli_json(capsys, "score", "tiny", "--plan", str(plan_file), "--local", "--samples", "1",
                        "--seq-len", "16", "--json")
    score = scoring_svc.list_scores(tiny_model["model_id"])[-1]

    client, runs = _runs(uri)
    run = next(r for r in runs if r.data.tags.get("quantplan.kind") == "score")
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    assert run.info.status == "FINISHED"
    assert tags["quantplan.job"] == str(score.job_id) and tags["quantplan.status"] == "succeeded"
    assert (tags["quantplan.model"], tags["quantplan.plan"], tags["quantplan.person"]) == ("tiny", "int8", "tester")
    assert tags["mlflow.user"] == "tester" and tags["mlflow.runName"] == f"score #{score.job_id} int8"
    assert params["samples"] == "1" and params["seq_len"] == "16"
    assert metrics["score.kl_mean"] == pytest.approx(score.kl_mean) and metrics["score.top1_agree"] == \
        pytest.approx(score.top1_agree)
    assert metrics["duration_s"] > 0
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"plan.yaml", "recipe.yaml", "result.json"} <= files, files
    folder = client.download_artifacts(run.info.run_id, "", str(tmp_path / "got"))
    from pathlib import Path

    assert "INT8_W8A8" in (Path(folder) / "plan.yaml").read_text()
    assert "QuantizationModifier" in (Path(folder) / "recipe.yaml").read_text()
    assert done  # the command itself answered as without MLflow
    assert not any("MLflow" in (r.data.tags.get("quantplan.error") or "") for r in runs)


def test_a_tracking_store_that_fails_never_fails_the_job_and_is_said_in_its_message(qp_settings, monkeypatch):
    from store import repo
    from store.db import session_scope
    from worker.runner import Outcome, run_job

    monkeypatch.setenv("QUANTPLAN_MLFLOW_TRACKING_URI", "nosuch://tracking.invalid")
    clear_settings_cache()
    from store.settings import get_settings

    s = get_settings()
    with session_scope(s) as session:
        job = repo.create_job(session, kind="calibrate", params={"device": "cpu"}, queue="cpu", user="t")
    # the body is faked: the logging after it is what is under test
    assert run_job(job.id, lambda ctx: Outcome(result={"n": 1}, message="ok"), settings=s) == "succeeded"
    with session_scope(s) as session:
        after = repo.get_job(session, job.id)
    assert after.status == "succeeded" and after.result == {"n": 1}
    assert after.message.startswith("ok · not logged to MLflow: ") and "nosuch" in after.message, after.message
