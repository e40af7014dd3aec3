"""`quantplan bench` records each case's spread (issue #41, item 3): ``repeats``, ``ms`` (the median), ``ms_p20``,
``ms_p80``, the baseline timed interleaved with a path and ``unstable`` in every ``--json`` record, new or reused;
the text output flags an unstable case, and the next benchmark measures it again instead of reusing it."""

from __future__ import annotations

import math

import pytest

from quantcore.kernels import records
from quantcore.kernels.bench import MIN_REPEATS
from quantcore.kernels.records import UNSTABLE_SPREAD, is_unstable
from tests.factories import run_cli as run
from tests.factories import run_cli_json as run_json

QUICK = ("bench", "tiny", "--local", "--m", "1", "--budget", "20", "--paths", "int8_row")
SPREAD_KEYS = {"repeats", "ms", "ms_p20", "ms_p80", "unstable", "baseline_ms", "baseline_ms_p20", "baseline_ms_p80"}


def _bench_message(capsys) -> str:
    bench_jobs = [j for j in run_json(capsys, "jobs", "--json") if j["kind"] == "bench"]
    return max(bench_jobs, key=lambda j: j["id"])["message"]


def test_bench_records_carry_repeats_and_spread_and_an_unstable_case_is_flagged_and_measured_again(
        tiny_model, capsys, monkeypatch):
    monkeypatch.setattr(records, "UNSTABLE_SPREAD", UNSTABLE_SPREAD)  # the real flag (the conftest pins it off)
    first = run_json(capsys, *QUICK, "--json")
    assert len(first) == 5 * 2  # the tiny Llama's 5 shapes x (baseline, int8_row) at M = 1
    for r in first:
        assert SPREAD_KEYS <= r.keys(), r.keys()
        assert r["repeats"] >= MIN_REPEATS and r["ms_p20"] <= r["ms"] <= r["ms_p80"]
        if r["path"] == "baseline":
            assert r["baseline_ms"] is None and r["unstable"] is is_unstable(r["ms"], r["ms_p20"], r["ms_p80"])
        else:  # the speed-up is over the baseline timed between its calls, and its spread counts too
            assert r["baseline_ms_p20"] <= r["baseline_ms"] <= r["baseline_ms_p80"]
            assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["ms"])
            assert r["unstable"] is (is_unstable(r["ms"], r["ms_p20"], r["ms_p80"])
                                     or is_unstable(r["baseline_ms"], r["baseline_ms_p20"], r["baseline_ms_p80"]))

    # a threshold below any spread: every case is made unstable, and the table says so, row by row
    monkeypatch.setattr(records, "UNSTABLE_SPREAD", -1.0)
    code, out, _ = run(capsys, *QUICK, "--force")
    assert code == 0
    rows = [line for line in out.splitlines() if line.split()[3:4] in (["baseline"], ["int8_row"])]
    timed = [line for line in rows if "over budget" not in line]  # a loaded machine may skip one for time
    assert len(rows) == 10 and timed and all("UNSTABLE: p20-p80" in line for line in timed)
    assert f"{len(timed)} of {len(timed)} timed case(s) UNSTABLE: their p20-p80 band is wider than -100% of" in out

    # asked again (nothing flagged now): no unstable time is reused, every case is measured again, then stored
    monkeypatch.setattr(records, "UNSTABLE_SPREAD", math.inf)
    again = run_json(capsys, *QUICK, "--json")
    assert _bench_message(capsys).startswith("10 cases measured, 0 reused")
    assert not any(r["unstable"] for r in again)
    reused = run_json(capsys, *QUICK, "--json")
    assert _bench_message(capsys).startswith("0 cases measured, 10 reused")
    assert [{k: r[k] for k in SPREAD_KEYS} for r in reused] == [{k: r[k] for k in SPREAD_KEYS} for r in again]
