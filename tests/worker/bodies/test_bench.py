"""The bench body: the real GEMMs of the model's shapes timed on this worker, stored results reused."""

from __future__ import annotations

import pytest

from jobs.specs import BenchSpec
from store import repo
from store.db import session_scope

QUICK = {"m": [1], "paths": ["int8_row"], "budget_s": 20.0}


def test_the_models_shapes_are_timed_against_the_baseline_and_stored(run_body, tiny_llama, qp_settings):
    job = run_body("bench", BenchSpec(**QUICK), model_id=tiny_llama)
    assert job.status == "succeeded", job.error
    r = job.result
    # the tiny Llama's distinct (N, K): q/o 64x64, k/v 32x64, gate/up 128x64, down 64x128, lm_head 26x64
    assert r["reused"] == 0 and r["measured"] == len(r["records"]) == 5 * 2
    assert {rec["path"] for rec in r["records"]} == {"baseline", "int8_row"} and r["budget_s"] == 20.0
    assert job.message.startswith(f"{r['measured']} cases measured, 0 reused on ")
    with session_scope(qp_settings) as s:
        stored = repo.kernel_results(s, device_name=r["device"]["name"], torch_version=r["device"]["torch_version"])
    assert len(stored) == r["measured"]
    again = run_body("bench", BenchSpec(**QUICK), model_id=tiny_llama)  # asked again: all of it stored
    assert (again.result["measured"], again.result["reused"]) == (0, r["measured"])


@pytest.mark.slow
def test_a_forced_benchmark_measures_again_what_is_stored(run_body, tiny_llama):
    first = run_body("bench", BenchSpec(**QUICK), model_id=tiny_llama)
    forced = run_body("bench", BenchSpec(force=True, **QUICK), model_id=tiny_llama)
    assert (forced.result["measured"], forced.result["reused"]) == (first.result["measured"], 0)


def test_without_a_model_the_default_shapes_are_timed(run_body):
    job = run_body("bench", BenchSpec(m=[1], paths=["w8_row"], budget_s=20.0))
    assert job.status == "succeeded", job.error
    assert {(rec["n"], rec["k"]) for rec in job.result["records"]} == {(576, 576), (192, 576), (1536, 576),
                                                                      (576, 1536)}


def test_a_split_over_gpus_without_a_model_fails_saying_why(run_body):
    job = run_body("bench", BenchSpec(tensor_parallel=2, **QUICK))
    assert job.status == "failed" and "needs a model: its layers say how they split" in job.error


def test_each_gemm_case_is_counted_in_the_progress_message():
    """run_benchmarks reports (cases done / cases, "N=… K=… M=… path") as each case starts: the body's messages
    count the cases, the unit the runner times (jobs.progress)."""
    from worker.bodies.bench import _counted

    heard: list[tuple[float, str]] = []
    report = _counted(lambda f, m: heard.append((f, m)))
    for done in range(4):
        report(done / 4, f"N=8 K=8 M={done} int8_row")
    report(1.0, "kernel benchmark done")
    assert [m for _, m in heard] == ["N=8 K=8 M=0 int8_row", "GEMM case 2 of 4: N=8 K=8 M=1 int8_row",
                                     "GEMM case 3 of 4: N=8 K=8 M=2 int8_row", "GEMM case 4 of 4: N=8 K=8 M=3 int8_row",
                                     "kernel benchmark done"]
