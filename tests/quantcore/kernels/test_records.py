"""Tests of quantcore.kernels.records: which stored kernel records a new benchmark reuses (the store's rows as the
worker reads them)."""

from __future__ import annotations

from quantcore.kernels.paths import PATHS
from quantcore.kernels.records import DEFAULT_MS, reusable_records
from store import repo
from store.db import session_scope


def _usable(s, device_name, torch_version=None, **kw):
    """What the bench job body reuses: the policy over the device's stored records, newest job first."""
    return reusable_records(repo.kernel_results(s, device_name=device_name, torch_version=torch_version),
                            job_runs=lambda ids: repo.params_and_results(s, ids), **kw)


def test_a_failed_or_over_budget_record_is_measured_again_and_an_older_time_stands(qp_settings):
    def rec(path, ms, skipped=None, torch_version="2.13"):
        return {"device": "cuda", "device_name": "GPU X", "torch_version": torch_version, "m": 16, "n": 64,
                "k": 32, "path": path, "ms": ms, "tflops": None, "pct_peak": None, "speedup": None,
                "native": True, "max_rel_err": None, "padded_m": None, "skipped": skipped}

    with session_scope(qp_settings) as s:
        old = repo.create_job(s, kind="bench", params={}, queue="gpu", user="ann")
        new = repo.create_job(s, kind="bench", params={}, queue="gpu", user="ann")
        other = repo.create_job(s, kind="bench", params={}, queue="gpu", user="ann")
        repo.save_kernel_results(s, job_id=old.id, records=[
            rec("baseline", 2.0), rec("fp8_row", 1.0), rec("int8_row", None, "not supported on cuda: sm80")])
        repo.save_kernel_results(s, job_id=new.id, records=[
            rec("baseline", 1.9), rec("fp8_row", None, "over budget: 60 s"),
            rec("fp8_tensor", None, "failed on cuda: x")])
        repo.save_kernel_results(s, job_id=other.id, records=[rec("baseline", 5.0, torch_version="2.11")])

        usable = {r.path: r for r in _usable(s, "GPU X", "2.13")}
        assert (usable["baseline"].ms, usable["baseline"].job_id) == (1.9, new.id)
        assert usable["fp8_row"].ms == 1.0 and usable["fp8_row"].job_id == old.id  # the older time stands
        assert "fp8_tensor" not in usable  # failed: measured again, nothing to reuse
        assert usable["int8_row"].skipped.startswith("not supported")  # final answers are kept


def test_a_case_skipped_for_time_is_reused_unless_the_budget_is_now_larger(qp_settings):
    """A case skipped "over budget" under a budget per shape of 60 s: asked again with 60 s or less, measuring
    it would skip it again, so the skip is reused; with 120 s it is measured; a time (even older) comes first."""
    def rec(path, ms, skipped=None, m=16):
        return {"device": "cpu", "device_name": "CPU X", "torch_version": "2.13", "m": m, "n": 64, "k": 32,
                "path": path, "ms": ms, "tflops": None, "pct_peak": None, "speedup": None, "native": True,
                "max_rel_err": None, "padded_m": None, "skipped": skipped}

    with session_scope(qp_settings) as s:
        timed = repo.create_job(s, kind="bench", params={}, queue="cpu", user="ann")
        repo.save_kernel_results(s, job_id=timed.id, records=[rec("w8_row", 3.0, m=1)])
        repo.finish_job(s, timed.id, status="succeeded", result={"budget_s": 600.0})
        job = repo.create_job(s, kind="bench", params={}, queue="cpu", user="ann")
        repo.save_kernel_results(s, job_id=job.id, records=[
            rec("baseline", 2.0), rec("w8_row", None, "over budget: ~90 s needed"),
            rec("w8_row", None, "over budget: ~90 s needed", m=1), rec("w4_ch", None, "failed on cpu: x")])
        repo.finish_job(s, job.id, status="succeeded", result={"budget_s": 60.0})
        older = repo.create_job(s, kind="bench", params={}, queue="cpu", user="ann")  # a result without budget_s
        repo.save_kernel_results(s, job_id=older.id, records=[rec("int8_row", None, "over budget: ~1 s needed")])
        repo.finish_job(s, older.id, status="succeeded", result={})

        def usable(budget):
            return {(r.m, r.path): r for r in _usable(s, "CPU X", budget_s=budget)}

        for budget in (30.0, 60.0):
            got = usable(budget)
            assert got[(16, "w8_row")].skipped.startswith("over budget") and got[(16, "w8_row")].job_id == job.id
            assert got[(1, "w8_row")].ms == 3.0  # a time, though older, before a skip
            assert (16, "w4_ch") not in got and (16, "int8_row") not in got  # failed; budget unknown
        assert (16, "w8_row") not in usable(120.0)
        assert (16, "w8_row") not in {(r.m, r.path) for r in _usable(s, "CPU X")}  # no budget asked: every skip is
        # measured again

        # per case: that job timed the default 4 M values x every path (and the baseline) in its 60 s per shape
        def usable_for(budget, cases):
            return {(r.m, r.path) for r in _usable(s, "CPU X", budget_s=budget, cases=cases)}

        broad = len(DEFAULT_MS) * len(PATHS)
        assert (16, "w8_row") in usable_for(60.0, broad)  # asked as it was: the skip stands
        # the same 60 s for w8_row and the baseline at 4 M values: each case gets far more of it, so it is measured
        assert (16, "w8_row") not in usable_for(60.0, len(DEFAULT_MS) * 2)
        assert (16, "w8_row") not in usable_for(30.0, 2)  # even with half the budget per shape
        assert (16, "w8_row") in usable_for(1.0, 2)  # 0.5 s a case: less than that job gave it; it would skip again


def test_the_job_runs_are_read_only_when_a_skip_for_time_is_weighed() -> None:
    from store.records import KernelRecordRow

    def row(job_id, path, ms, skipped=None):
        return KernelRecordRow(job_id=job_id, device="cpu", device_name="CPU X", torch_version="2.13", m=1, n=8, k=8,
                               path=path, ms=ms, tflops=None, pct_peak=None, speedup=None, native=True,
                               max_rel_err=None, padded_m=None, padded_k=None, padded_n=None, skipped=skipped)

    asked: list[set[int]] = []

    def runs(ids):
        asked.append(ids)
        return {}

    stored = [row(2, "baseline", 1.0), row(2, "w8_row", None, "over budget: x"), row(1, "w8_row", 3.0)]
    assert [r.ms for r in reusable_records(stored, budget_s=60.0, job_runs=runs)] == [1.0, 3.0]
    assert asked == []  # an older time stands: no skip left to weigh
    assert reusable_records(stored[:2], budget_s=60.0, job_runs=runs) == stored[:1] and asked == [{2}]
