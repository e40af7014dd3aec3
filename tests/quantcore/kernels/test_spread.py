"""Tests of a kernel case's spread (issue #41, item 3): repeats, median, p20 / p80 as triton's ``do_bench`` reports
them, the ``unstable`` flag of a case whose calls vary, a path timed interleaved with its baseline and its speed-up
from those two medians; a step estimate that leaves an unstable case out and says what it covers; a stored unstable
time that a new benchmark measures again.

The benchmark runs its real kernels; only its clock is the fake of ``test_kernels.fake_clock``'s kind, advanced by a
cost this file states per call (so a case is made to vary, or the load to change mid-benchmark, without depending on
how busy the machine is).
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable

import pytest

from quantcore.kernels import bench
from quantcore.kernels.bench import run_benchmarks
from quantcore.kernels.estimate import step_estimate
from quantcore.kernels.ops import Case
from quantcore.kernels.records import (
    UNSTABLE_SPREAD,
    KernelRecord,
    case_times,
    fill_speedups,
    is_unstable,
    relative_spread,
    reusable_records,
    spread_text,
)
from quantcore.kernels.report import format_markdown, format_records, unstable_summary
from quantcore.kernels.timing import Spread, Timer, quantile


class CallClock:
    """A clock advanced only by the kernel calls, each costing ``cost(path, rows, nth)`` seconds (``nth``: how many
    calls of that path came before); ``calls`` logs (path, rows) of every call, in order."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[tuple[str, int]] = []
        self.cost: Callable[[str, int, int], float] = lambda path, rows, nth: 1e-3

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> CallClock:
    from quantcore.kernels import timing

    clk = CallClock()
    fake_time = types.SimpleNamespace(perf_counter=clk.perf_counter)
    monkeypatch.setattr(bench, "time", fake_time)
    monkeypatch.setattr(timing, "time", fake_time)
    build = bench.build_case
    counts: dict[str, itertools.count] = {}

    def build_costed(ops, path, x, kind):
        case = build(ops, path, x, kind)
        real, rows = case.fn, x.shape[0]

        def fn():
            out = real()
            clk.now += clk.cost(path, rows, next(counts.setdefault(path, itertools.count())))
            clk.calls.append((path, rows))
            return out

        return Case(fn=fn, emulate=case.emulate, padded=case.padded)

    monkeypatch.setattr(bench, "build_case", build_costed)
    return clk


def _record(path: str, ms: float | None, *, m: int = 16, unstable: bool | None = False, **kw) -> KernelRecord:
    return KernelRecord(device="cpu", device_name="CPU X", torch_version="t", m=m, n=64, k=32, path=path, ms=ms,
                        tflops=None, pct_peak=None, speedup=None, native=True, max_rel_err=None, padded_m=None,
                        skipped=None if ms is not None else "over budget: test", unstable=unstable, **kw)


# --------------------------------------------------------------------------- the figures


def test_quantiles_interpolate_as_torch_quantile_does_and_the_flag_follows_the_band() -> None:
    import torch

    samples = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    for q in (0.5, 0.2, 0.8, 0.0, 1.0):
        assert quantile(samples, q) == pytest.approx(torch.quantile(torch.tensor(samples), q).item())
    spread = Spread.of(samples)
    assert (spread.repeats, spread.ms, spread.p20, spread.p80) == (6, 3.5, 2.0, 5.0)
    assert spread.unstable  # (5 - 2) / 3.5 = 86% of the median
    steady = Spread.of([1.0, 1.01, 0.99, 1.02, 1.0])
    assert not steady.unstable and relative_spread(steady.ms, steady.p20, steady.p80) < 0.05
    # the threshold: a band of exactly UNSTABLE_SPREAD is not flagged, anything wider is
    assert not is_unstable(1.0, 1.0, 1.0 + UNSTABLE_SPREAD) and is_unstable(1.0, 1.0, 1.0 + UNSTABLE_SPREAD + 1e-9)
    assert not is_unstable(1.0, None, None) and relative_spread(None, 1.0, 2.0) is None  # no spread kept: no flag
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_the_timer_interleaves_its_functions_and_flushes_before_each_call() -> None:
    timer = Timer("cpu", "cpu")
    order: list[str] = []

    def call(name: str) -> Callable[[], None]:
        def fn() -> None:
            assert bool((timer._flush == 0).all())  # written over just before this call
            timer._flush.fill_(1)
            order.append(name)
        return fn

    samples = timer.interleaved_ms([call("b"), call("p")], 4)
    assert order == ["b", "p"] * 4
    assert [len(s) for s in samples] == [4, 4] and all(t >= 0 for s in samples for t in s)


# --------------------------------------------------------------------------- the benchmark


def test_a_case_whose_calls_vary_is_flagged_unstable_and_a_steady_one_is_not(clock) -> None:
    """int8_row's calls alternate between 1 ms and 3 ms of the fake clock: its p20-p80 band is twice its median;
    w8_row and the baseline cost the same every call. The records keep the repeats and the spread of each."""
    clock.cost = lambda path, rows, nth: (1e-3 + 2e-3 * (nth % 2)) if path == "int8_row" else 1e-3
    recs = {r.path: r for r in run_benchmarks([(64, 64)], ms=(16,), paths=["int8_row", "w8_row"], repeats=5,
                                              budget_s_per_shape=60)}
    shaky, steady, base = recs["int8_row"], recs["w8_row"], recs["baseline"]
    assert shaky.unstable is True and steady.unstable is False and base.unstable is False
    assert shaky.repeats == steady.repeats == base.repeats == 5
    assert (shaky.ms_p20, shaky.ms_p80) == (pytest.approx(1.0), pytest.approx(3.0))
    assert shaky.ms in (pytest.approx(1.0), pytest.approx(3.0))
    assert steady.ms == steady.ms_p20 == steady.ms_p80 == pytest.approx(1.0)
    assert spread_text(shaky) == f"p20-p80 1-3 ms ({100 * 2 / shaky.ms:.0f}% of the median), 5 repeats"
    assert spread_text(_record("w8_row", 1.0, unstable=None)) == "—"  # stored before the spread was kept
    text = format_records(recs.values())
    assert sum("UNSTABLE" in line for line in text.splitlines()) == 1
    assert next(line for line in text.splitlines() if " int8_row " in line).split()[4:8] == [
        f"{shaky.ms:.4f}", "1.0000", "3.0000", "5"]
    assert unstable_summary(recs.values()).startswith("1 of 3 timed case(s) UNSTABLE")
    assert unstable_summary([steady, base]) is None
    assert format_markdown(recs.values()).count("(unstable)") == 1


def test_a_path_alternates_with_its_baseline_and_its_speedup_is_of_those_medians(clock) -> None:
    """The load quadruples once the path's case begins (another job starts on the machine): the baseline's own case
    ran at 1 ms a call, the path runs at 2 ms, and the baseline between its calls at 4 ms. Timed one after the other,
    the speed-up would read 0.5x; interleaved (baseline, path, baseline, path, ...) it is the true 2x."""
    load = {"x": 1.0}

    def cost(path: str, rows: int, nth: int) -> float:
        if path == "int8_row":
            load["x"] = 4.0
        return load["x"] * (1e-3 if path == "baseline" else 0.5e-3)

    clock.cost = cost
    repeats = 4
    base, path = run_benchmarks([(64, 64)], ms=(16,), paths=["int8_row"], repeats=repeats, budget_s_per_shape=60)
    assert (base.path, path.path) == ("baseline", "int8_row")
    assert base.ms == pytest.approx(1.0) and base.speedup == 1.0 and base.baseline_ms is None
    assert path.ms == pytest.approx(2.0)
    assert (path.baseline_ms, path.baseline_ms_p20, path.baseline_ms_p80) == tuple(pytest.approx(4.0) for _ in "abc")
    assert path.speedup == pytest.approx(2.0)  # not base.ms / path.ms = 0.5
    # the timed calls alternate: the longest run of baseline, path, baseline, path ... is the repeats, each pair once
    names = [p for p, _ in clock.calls]
    longest = max(
        next((n for n in range(len(names) - i) if names[i + n] != ("baseline", "int8_row")[n % 2]), len(names) - i)
        for i in range(len(names)))
    assert longest == 2 * repeats
    start = next(i for i in range(len(names)) if names[i:i + 2 * repeats] == ["baseline", "int8_row"] * repeats)
    assert names[start - 1] == "baseline" and names[start - 2] == "int8_row"  # the baseline warmed, after the path


def test_fill_speedups_prefers_the_interleaved_baseline() -> None:
    recs = [_record("baseline", 4.0), _record("int8_row", 1.0, baseline_ms=3.0), _record("w8_row", 2.0)]
    fill_speedups(recs)
    assert [r.speedup for r in recs] == [1.0, 3.0, 2.0]  # w8_row: a record from before, over the baseline record


# --------------------------------------------------------------------------- what reads the flag


def test_a_step_estimate_leaves_an_unstable_case_out_and_says_what_it_covers() -> None:
    recs = [_record("baseline", 4.0), _record("int8_row+q", 1.0, unstable=True), _record("w8_row", 2.0),
            _record("baseline", 1.0, m=1), _record("int8_row+q", 0.5, m=1), _record("w8_row", 0.8, m=1),
            _record("w8_row", 9.0, m=1, unstable=None)]  # a later record from before the flag: not flagged
    shapes = {"a": (64, 32), "b": (64, 32), "c": (64, 32)}
    paths = {"a": "int8_row", "b": "w8_row"}  # c: the baseline
    assert (16, 64, 32, "int8_row+q") not in case_times(recs)
    est = step_estimate(recs, shapes, paths, m_prefill=16, m_decode=1)
    assert est["layers"] == 3
    assert est["missing_prefill"] == ["a"] and est["unstable_prefill"] == ["a"] and est["skipped_prefill"] == {}
    assert est["covered_prefill"] == 2 and est["prefill_ms"] == pytest.approx(2.0 + 4.0)
    assert est["common_baseline_prefill_ms"] == pytest.approx(8.0)  # b and c, measured both ways
    assert est["covered_decode"] == 3 and est["unstable_decode"] == [] and est["complete"] is False
    assert est["decode_ms"] == pytest.approx(0.5 + 9.0 + 1.0)


def test_a_stored_unstable_time_is_measured_again_and_no_older_time_stands_for_it(qp_settings) -> None:
    from store import repo
    from store.db import session_scope

    def rec(path: str, ms: float, unstable: bool | None) -> dict:
        return {**_record(path, ms, unstable=unstable).to_dict(), "ms_p20": ms, "ms_p80": 2 * ms if unstable else ms,
                "repeats": 5}

    with session_scope(qp_settings) as s:
        old = repo.create_job(s, kind="bench", params={}, queue="cpu", user="ann")
        repo.save_kernel_results(s, job_id=old.id, records=[rec("int8_row", 1.0, False), rec("w8_row", 2.0, False),
                                                            rec("baseline", 3.0, None)])
        new = repo.create_job(s, kind="bench", params={}, queue="cpu", user="ann")
        repo.save_kernel_results(s, job_id=new.id, records=[rec("int8_row", 0.7, True), rec("baseline", 2.9, False)])
        newer = repo.create_job(s, kind="bench", params={}, queue="cpu", user="ann")
        repo.save_kernel_results(s, job_id=newer.id, records=[rec("w8_row", 1.8, True)])
        newest = repo.create_job(s, kind="bench", params={}, queue="cpu", user="ann")
        repo.save_kernel_results(s, job_id=newest.id, records=[rec("w8_row", 1.9, False)])
        usable = {r.path: r for r in reusable_records(repo.kernel_results(s, device_name="CPU X"))}
    assert "int8_row" not in usable  # its newest time is unstable: measured again, the older 1.0 ms does not stand
    assert (usable["w8_row"].ms, usable["w8_row"].job_id) == (1.9, newest.id)  # measured again since: stable
    assert (usable["baseline"].ms, usable["baseline"].job_id) == (2.9, new.id)
