"""The score body with a plan that rotates the model (transforms.rotation): scored rotated, the identity plan still
exactly the reference's distribution, and a rotated plan that needs calibrated statistics (static scales, SmoothQuant,
GPTQ, AWQ, a calibrated KV cache) calibrated, rounded and searched on the rotated model."""

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


def _jobs_of(qp_settings, model_id, kind):
    with session_scope(qp_settings) as s:
        return [j for j in repo.list_jobs(s) if j.kind == kind and j.model_id == model_id]


def test_a_rotated_static_plan_is_calibrated_rotated_first(run_body, tiny_llama, qp_settings):
    """Static scales and SmoothQuant read statistics of the rotated model: a rotated calibration is run first (and
    reused), the plain score keeps reading the plain one."""
    rotated = _score(run_body, qp_settings, tiny_llama, {"default": "FP8", "transforms": ROTATION, "kv_cache": "FP8"})
    assert rotated.status == "succeeded", rotated.error
    with session_scope(qp_settings) as s:
        cal = repo.get_job(s, rotated.result["calibration_job"])
    assert cal.kind == "calibrate" and cal.params["rotation"] == ROTATION["rotation"] and cal.status == "succeeded"
    again = _score(run_body, qp_settings, tiny_llama, {"default": "INT8_W8A8_SQ", "transforms": ROTATION})
    assert again.status == "succeeded", again.error
    assert again.result["calibration_job"] == cal.id and len(_jobs_of(qp_settings, tiny_llama, "calibrate")) == 1
    plain = run_body("score", ScoreSpec(scheme="FP8", **TOKENS), model_id=tiny_llama)
    assert plain.status == "succeeded", plain.error
    with session_scope(qp_settings) as s:
        assert not repo.get_job(s, plain.result["calibration_job"]).params.get("rotation")
    blocks = _score(run_body, qp_settings, tiny_llama, {"default": "FP8", "transforms": {"rotation": {
        **ROTATION["rotation"], "block_size": 16}}})  # another rotation: its own calibration
    assert blocks.status == "succeeded", blocks.error
    assert blocks.result["calibration_job"] not in (cal.id, plain.result["calibration_job"])


def test_a_rotated_plan_rounds_with_gptq_and_awq_on_the_rotated_model(run_body, tiny_llama, qp_settings):
    rtn = _score(run_body, qp_settings, tiny_llama, {"default": "W4A16", "transforms": ROTATION})
    gptq = _score(run_body, qp_settings, tiny_llama, {"default": "W4A16_GPTQ", "transforms": ROTATION})
    awq = _score(run_body, qp_settings, tiny_llama, {"default": "W4A16_AWQ", "transforms": ROTATION})
    assert rtn.status == gptq.status == awq.status == "succeeded", (rtn.error, gptq.error, awq.error)
    assert gptq.result["gptq"]["layers"] == 15 and gptq.result["kl_mean"] != rtn.result["kl_mean"]
    # R4 rotates down_proj's input online, after up_proj's rows: AWQ leaves both down_proj layers unscaled too
    unrotated_awq = _score(run_body, qp_settings, tiny_llama, {"default": "W4A16_AWQ"})
    assert awq.result["awq"]["unscaled_layers"] == unrotated_awq.result["awq"]["unscaled_layers"] + 2
    assert awq.result["kl_mean"] != rtn.result["kl_mean"]
    plain = _score(run_body, qp_settings, tiny_llama, {"default": "W4A16_GPTQ"})  # its own Hessians, not reused
    assert plain.status == "succeeded" and plain.result["gptq"]["from_cache"] == 0
    again = _score(run_body, qp_settings, tiny_llama, {"default": "W4A16_GPTQ", "transforms": ROTATION})
    assert again.result["gptq"]["from_cache"] == 15 and again.result["kl_mean"] == gptq.result["kl_mean"]


def test_gptq_hessians_are_those_of_the_rotated_input():
    """R4 alone rotates down_proj's input by Q: its Hessian must be Qᵀ H Q of the unrotated one."""
    import torch

    from quantcore.algorithms.hadamard import rotation_matrix
    from quantcore.algorithms.rotation_spec import RotationSpec
    from tests.factories import build_tiny_model
    from worker.bodies import evaluation as ev

    class Ctx:
        def progress(self, *_a, **_k):
            pass

        def should_cancel(self):
            return False

    model = build_tiny_model("llama")
    down = "model.layers.1.mlp.down_proj"
    plan = {down: type("S", (), {"needs_hessians": True})()}
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    plain = ev.hessians(Ctx(), model, plan, ids, "t")[down].double()
    spec = RotationSpec(rotations=("R4",))
    rotated = ev.hessians(Ctx(), model, plan, ids, "t", rotation=spec)[down].double()
    q = rotation_matrix(model.config.intermediate_size, block_size=model.config.intermediate_size).double()
    assert not torch.allclose(rotated, plain, atol=1e-4)
    torch.testing.assert_close(rotated, q.T @ plain @ q, atol=1e-4, rtol=1e-4)


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


def test_a_rotated_sweep_is_stored_apart_from_the_plain_one(run_body, tiny_llama, qp_settings):
    from jobs.specs import SensitivitySpec
    from quantplan.services import sweeps

    sweep = dict(scheme="INT8_W8A8", samples=2, seq_len=16, stream=False)
    rotated = run_body("sensitivity", SensitivitySpec(**sweep, rotation=ROTATION["rotation"]), model_id=tiny_llama)
    assert rotated.status == "succeeded", rotated.error
    assert rotated.result["rotation"] == ROTATION["rotation"]
    plain = run_body("sensitivity", SensitivitySpec(**sweep), model_id=tiny_llama)
    assert plain.status == "succeeded", plain.error
    rows = {j.id: {r.unit: r.kl_mean for r in sweeps.sensitivity_rows(j.id)} for j in (rotated, plain)}
    assert rows[rotated.id].keys() == rows[plain.id].keys() and rows[rotated.id] != rows[plain.id]
    with session_scope(qp_settings) as s:
        model = repo.get_model(s, tiny_llama)
    assert [j.id for j in sweeps.planner_sweeps(model)] == [plain.id]  # plan auto reads the unrotated sweep only
    sq = run_body("sensitivity", SensitivitySpec(**{**sweep, "scheme": "INT8_W8A8_SQ"}, rotation=ROTATION["rotation"]),
                  model_id=tiny_llama)  # R4's down_proj left out, the rest smoothed in the rotated model
    assert sq.status == "succeeded", sq.error
    assert {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"} <= set(sq.result["not_swept"])


def test_a_quip_rotated_plan_is_calibrated_and_scored_with_every_linear_rotated(run_body, tiny_llama, qp_settings):
    quip = {"rotation": {"kind": "hadamard", "rotations": ["V"], "block_size": 16}}
    identity = _score(run_body, qp_settings, tiny_llama, {"default": "BF16", "transforms": quip})
    assert identity.status == "succeeded" and abs(identity.result["kl_mean"]) < 1e-6, identity.error
    job = _score(run_body, qp_settings, tiny_llama, {"default": "INT8_W8A8_SQ", "transforms": quip})
    assert job.status == "succeeded", job.error
    with session_scope(qp_settings) as s:
        assert repo.get_job(s, job.result["calibration_job"]).params["rotation"]["rotations"] == ["V"]
        notes = repo.get_score(s, job.id).figure("notes")
    assert any("SmoothQuant not applied (V rotates every decoder linear's input online" in n for n in notes), notes
