"""The score body with a plan that rotates the model (transforms.rotation): scored rotated, the identity plan still
exactly the reference's distribution, and a rotated plan that would need the (unrotated) stored calibration refused."""

from __future__ import annotations

import numpy as np

from jobs.specs import ScoreSpec
from store import repo
from store.db import session_scope

TOKENS = {"samples": 2, "seq_len": 16, "cal_samples": 2, "cal_seq_len": 16}
ROTATION = {"rotation": {"kind": "hadamard", "rotations": ["R1", "R2", "R4"]}}


def _score(run_body, qp_settings, model_id, body):
    with session_scope(qp_settings) as s:
        plan = repo.save_plan(s, model_id=model_id, name=body["default"].lower(), body=body, user="t")
    return run_body("score", ScoreSpec(**TOKENS), model_id=model_id, plan_id=plan.id)


def test_a_rotated_plan_is_scored_rotated(run_body, tiny_llama, qp_settings):
    identity = _score(run_body, qp_settings, tiny_llama, {"default": "BF16", "transforms": ROTATION})
    assert identity.status == "succeeded", identity.error
    assert abs(identity.result["kl_mean"]) < 1e-6  # the rotation alone changes nothing
    plain = _score(run_body, qp_settings, tiny_llama, {"default": "INT8_PER_TENSOR"})
    rotated = _score(run_body, qp_settings, tiny_llama, {"default": "INT8_PER_TENSOR", "transforms": ROTATION})
    assert plain.status == rotated.status == "succeeded", (plain.error, rotated.error)
    assert rotated.result["kl_mean"] != plain.result["kl_mean"]  # the rotation reached the quantized model
    with session_scope(qp_settings) as s:
        stored = [sc.plan_body for sc in repo.list_scores(s, tiny_llama)]
    assert sum("transforms" in b for b in stored) == 2


def test_a_rotated_plan_that_needs_the_stored_calibration_is_refused(run_body, tiny_llama, qp_settings):
    job = _score(run_body, qp_settings, tiny_llama, {"default": "FP8", "transforms": ROTATION})
    assert job.status == "failed"
    assert "rotates the model" in job.error and "unrotated model only" in job.error


def test_a_rotated_calibration_is_a_what_if_that_no_score_reads(run_body, tiny_llama, qp_settings):
    from jobs.specs import CalibrateSpec

    rotated = run_body("calibrate", CalibrateSpec(samples=2, seq_len=16, stream=False, rotation=ROTATION["rotation"]),
                       model_id=tiny_llama)
    assert rotated.status == "succeeded", rotated.error
    assert rotated.result["rotation"] == ROTATION["rotation"]
    plain = run_body("calibrate", CalibrateSpec(samples=2, seq_len=16, stream=False), model_id=tiny_llama)
    with session_scope(qp_settings) as s:
        by_job = {j: {st.name: st for st in repo.load_activation_stats(s, j)} for j in (rotated.id, plain.id)}
    down = "model.layers.0.mlp.down_proj"  # R4 rotates its input: other maxima, same width
    assert by_job[rotated.id][down].in_features == by_job[plain.id][down].in_features
    assert not np.allclose(by_job[rotated.id][down].channel_max, by_job[plain.id][down].channel_max)
    again = run_body("calibrate", CalibrateSpec(samples=2, seq_len=16, stream=False, rotation=ROTATION["rotation"]),
                     model_id=tiny_llama)  # now the newest: a static scheme's score still reads the plain one
    assert again.status == "succeeded"
    score = run_body("score", ScoreSpec(scheme="FP8", **TOKENS), model_id=tiny_llama)
    assert score.status == "succeeded", score.error
    assert score.result["calibration_job"] == plain.id


def test_a_malformed_rotation_fails_the_calibration_saying_why(run_body, tiny_llama):
    from jobs.specs import CalibrateSpec

    job = run_body("calibrate", CalibrateSpec(samples=2, seq_len=16, stream=False, rotation={"kind": "givens"}),
                   model_id=tiny_llama)
    assert job.status == "failed" and "'kind' must be one of hadamard, random-hadamard" in job.error
