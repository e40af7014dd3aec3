"""The register body: a checkpoint validated, stored by content and summarised; its model row written once."""

from __future__ import annotations

import shutil

from jobs.specs import RegisterSpec
from store import repo
from store.db import session_scope
from tests.factories import save_tiny_llama


def test_a_folder_is_registered_under_the_name_asked_for(run_body, tmp_path, qp_settings):
    job = run_body("register", RegisterSpec(source=str(save_tiny_llama(tmp_path / "tiny-llama")), name="mine",
                                            user="ann"))
    assert job.status == "succeeded", job.error
    assert job.result["name"] == "mine" and job.result["linears"] == 15 and job.result["already"] is False
    assert job.message == "registered mine" and job.model_id == job.result["model_id"]
    with session_scope(qp_settings) as s:
        model = repo.get_model(s, job.model_id)
    assert (model.name, model.source_kind, model.source_name) == ("mine", "folder", "tiny-llama")


def test_without_a_name_the_model_is_named_after_its_file(run_body, tmp_path):
    archive = shutil.make_archive(str(tmp_path / "llama-tiny"), "zip", save_tiny_llama(tmp_path / "x" / "m"))
    job = run_body("register", {"source": archive})
    assert job.status == "succeeded", job.error
    assert job.result["name"] == "llama-tiny"


def test_the_same_content_registered_again_is_the_same_model(run_body, tmp_path):
    folder = save_tiny_llama(tmp_path / "tiny-llama")
    first = run_body("register", {"source": str(folder), "name": "a"})
    again = run_body("register", {"source": str(folder), "name": "b"})
    assert again.status == "succeeded" and again.result["already"] is True
    assert again.result["model_id"] == first.result["model_id"] and again.result["name"] == "a"
    assert again.message == f"already registered as a (#{first.result['model_id']}): same checkpoint content"


def test_a_staged_upload_is_deleted_whatever_the_outcome(run_body, tmp_path):
    staging = tmp_path / "uploads" / "abc"
    staging.mkdir(parents=True)
    (staging / "broken.gguf").write_bytes(b"not a gguf at all")
    job = run_body("register", RegisterSpec(source=str(staging / "broken.gguf"), source_name="broken.gguf",
                                            cleanup_dir=str(staging)))
    assert job.status == "failed" and job.error
    assert not staging.exists()


def test_an_old_row_without_a_source_fails_with_the_reason(run_body, qp_settings):
    from jobs.routing import LOCAL_QUEUE
    from worker.bodies import body_for
    from worker.runner import run_job

    with session_scope(qp_settings) as s:  # written by no client of today: the spec would refuse it
        job = repo.create_job(s, kind="register", params={"name": "x"}, queue=LOCAL_QUEUE, user="t")
    assert run_job(job.id, body_for("register"), settings=qp_settings) == "failed"
    with session_scope(qp_settings) as s:
        assert "needs a source" in repo.get_job(s, job.id).error
