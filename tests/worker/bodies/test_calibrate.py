"""The calibrate body: per-channel statistics of every linear layer and the K / V maxima, stored with the job."""

from __future__ import annotations

from jobs.specs import CalibrateSpec
from store import repo
from store.db import session_scope


def test_a_calibration_stores_statistics_of_every_linear_and_the_kv_maxima(run_body, tiny_llama, qp_settings):
    job = run_body("calibrate", CalibrateSpec(samples=2, seq_len=16), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    assert job.result["layers"] == 15 and job.result["tokens"] == 2 * 16
    assert job.result["text"].startswith("builtin:") and len(job.result["top"]) == 5
    assert set(job.result["kv_amax"]["k"]) == {f"model.layers.{b}.self_attn" for b in range(2)}
    assert job.message == "15 layers calibrated"
    with session_scope(qp_settings) as s:
        assert len(repo.load_activation_stats(s, job.id)) == 15


def test_an_old_row_without_token_counts_reads_the_specs_defaults(run_body, tiny_llama, qp_settings):
    """A row an older version wrote with samples 0 ("unset", as its worker read it) runs with the spec's default;
    a 0 asked for now is refused before any row (tests/jobs/test_client.py)."""
    from worker.bodies import body_for
    from worker.runner import run_job

    with session_scope(qp_settings) as s:  # written as that version wrote it, past today's client
        old = repo.create_job(s, kind="calibrate", params={"device": "cpu", "samples": 0}, queue="cpu", user=None,
                              model_id=tiny_llama)
    run_job(old.id, body_for("calibrate"), settings=qp_settings)
    with session_scope(qp_settings) as s:
        job = repo.get_job(s, old.id)
    assert job.status == "succeeded", job.error
    assert job.result["tokens"] == CalibrateSpec().samples * CalibrateSpec().seq_len


def test_a_calibration_reads_the_stored_text_it_names(run_body, tiny_llama, qp_settings, tmp_path):
    path = tmp_path / "domain.txt"
    path.write_text("\n\n".join("the news of the year was said to be in this year" for _ in range(40)))
    with session_scope(qp_settings) as s:  # an absolute path: read where it is
        ds = repo.add_dataset(s, name="domain", role="calibration", sha256="0" * 64, path=str(path), n_documents=40,
                              n_bytes=path.stat().st_size)
    job = run_body("calibrate", CalibrateSpec(samples=2, seq_len=8, dataset=ds.id), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    assert job.result["text"] == ds.name


def test_a_cuda_calibration_on_a_worker_without_cuda_fails_saying_where_to_queue_it(run_body, tiny_llama):
    import torch

    if torch.cuda.is_available():
        return
    job = run_body("calibrate", CalibrateSpec(device="cuda", samples=2, seq_len=8), model_id=tiny_llama)
    assert job.status == "failed" and "no CUDA device" in job.error and "queue 'gpu'" in job.error
