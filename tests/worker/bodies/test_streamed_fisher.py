"""The Fisher estimate job streamed (quantcore.evaluation.fisher_streamed): asked with ``stream``, it stores the rows
the whole-model Fisher job stores (bit-identical on a CPU), for linear units, a KV cache format and under a rotation,
says it ran streamed, and leaves no scratch files."""

from __future__ import annotations

from jobs.specs import SensitivitySpec
from tests.worker.bodies.test_streamed_sweep_body import stored
from tests.worker.bodies.test_streaming import TOKENS


def test_a_streamed_fisher_job_stores_the_whole_jobs_rows(run_body, tiny_llama, qp_settings):
    # GPTQ: its layers rounded block by block on the calibration text; AWQ: its factors searched streamed
    for scheme in ("FP8_DYNAMIC", "W4A16_GPTQ", "W4A16_AWQ"):
        whole = run_body("sensitivity", SensitivitySpec(scheme=scheme, method="fisher", stream=False, **TOKENS),
                         model_id=tiny_llama)
        streamed = run_body("sensitivity", SensitivitySpec(scheme=scheme, method="fisher", stream=True, **TOKENS),
                            model_id=tiny_llama)
        assert whole.status == streamed.status == "succeeded", (scheme, whole.error, streamed.error)
        assert (whole.result["mode"], streamed.result["mode"]) == ("whole model", "streamed")
        assert whole.result["method"] == streamed.result["method"] == "fisher"
        rows = stored(qp_settings, whole)
        assert stored(qp_settings, streamed) == rows and len(rows) == 9, scheme
        assert all(r["kl_mean"] > 0 for r in rows)
        assert not qp_settings.job_scratch_dir(streamed.id).exists()
        if scheme.endswith("GPTQ"):
            assert streamed.result["gptq"]["layers"] == whole.result["gptq"]["layers"] > 0


def test_a_streamed_fisher_job_of_a_kv_format_or_rotated_stores_the_whole_jobs_rows(run_body, tiny_llama,
                                                                                     qp_settings):
    """A calibrated KV cache format (its K/V maxima from the streamed calibration) and R1 + R2 + R4: nothing refused
    streamed any more; the whole-model job's rows, the rotation recorded."""
    rotation = {"kind": "hadamard", "rotations": ["R1", "R2", "R4"]}
    for asked, units in (({"kv_sweep": "FP8"}, 2), ({"scheme": "FP8_DYNAMIC", "rotation": rotation}, 9)):
        whole, streamed = (run_body("sensitivity", SensitivitySpec(method="fisher", stream=stream, **asked, **TOKENS),
                                    model_id=tiny_llama) for stream in (False, True))
        assert whole.status == streamed.status == "succeeded", (asked, whole.error, streamed.error)
        assert (whole.result["mode"], streamed.result["mode"]) == ("whole model", "streamed")
        assert whole.result["method"] == streamed.result["method"] == "fisher"
        assert whole.result["scheme"] == streamed.result["scheme"]
        assert streamed.result.get("rotation") == whole.result.get("rotation") == asked.get("rotation")
        rows = stored(qp_settings, whole)
        assert stored(qp_settings, streamed) == rows and len(rows) == units, asked
        assert all(r["kl_mean"] > 0 for r in rows)
        assert not qp_settings.job_scratch_dir(streamed.id).exists()
