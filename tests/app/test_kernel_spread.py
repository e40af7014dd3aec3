"""The Kernels page shows each case's spread (issue #41, item 3): an unstable case is flagged (a warning naming it,
an outline and a mark in the heatmap, "UNSTABLE" in the table) and left out of the step estimate, whose partial
figure reads its coverage first and is never the headline metric; the heatmap's tooltip gives both times, the
repeats and the spread; a cell the budget skipped is drawn lighter than a measured one; a row stored before the
spread was kept reads "—" and is not flagged."""

from __future__ import annotations

import json
from pathlib import Path

from streamlit.testing.v1 import AppTest

from quantcore.kernels.records import TIMING
from store import repo
from store.db import session_scope
from tests.factories import smol_linears

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")


def _kernels_page(model_id: int) -> AppTest:
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["model_id"] = model_id
    at.session_state["kernels_cases_open"] = True  # the "Every case" table, opened (it builds on open)
    at.run()
    at.switch_page("views/kernels.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _heatmap_rows(at: AppTest) -> list[dict]:
    """The data rows of the page's first chart (the speed-up heatmap) as Vega-Lite receives them."""
    chart = at.get("vega_lite_chart")[0].proto
    rows = [r for data in json.loads(chart.spec).get("datasets", {}).values() for r in data]
    if not rows:  # Streamlit sends the data as Arrow beside the spec
        import pyarrow as pa

        for ds in chart.datasets:
            rows += pa.ipc.open_stream(ds.data.data).read_all().to_pylist()
    return rows


def _seed_spread(model_id: int) -> tuple[int, int]:
    """A newer benchmark of the seeded Test CPU: down_proj's fp8_row+q at M=16 timed with a wide spread (unstable),
    its fp8_tensor at M=16 timed steadily, its int8_row at M=16 skipped over budget. Returns down_proj's (N, K)."""
    down = next(lin for lin in smol_linears() if lin["name"].endswith("mlp.down_proj"))
    n, k = down["out_features"], down["in_features"]

    def rec(path: str, **kw) -> dict:
        return dict(device="cpu", device_name="Test CPU", torch_version="2.13.0", m=16, n=n, k=k, path=path,
                    tflops=0.01, pct_peak=None, native=path != "fp8_row+q", max_rel_err=1e-6, padded_m=None,
                    skipped=None, timing=TIMING, **kw)

    with session_scope() as s:
        job = repo.create_job(s, kind="bench", params={"device": "cpu"}, queue="cpu", user=None)
        repo.save_kernel_results(s, job_id=job.id, records=[
            rec("fp8_row+q", ms=2.0, ms_p20=1.2, ms_p80=3.4, repeats=5, baseline_ms=1.0, baseline_ms_p20=0.98,
                baseline_ms_p80=1.03, speedup=0.5, unstable=True),
            rec("fp8_tensor", ms=0.8, ms_p20=0.79, ms_p80=0.82, repeats=5, baseline_ms=1.0, baseline_ms_p20=0.97,
                baseline_ms_p80=1.01, speedup=1.25, unstable=False),
            {**rec("int8_row", ms=None, speedup=None), "tflops": None, "max_rel_err": None,
             "skipped": "over budget: ~3 s needed, 0.5 s left of 1 s for shape"}])
        repo.finish_job(s, job.id, status="succeeded", result={"budget_s": 1.0})
    return n, k


def test_the_kernels_page_flags_an_unstable_case_and_leaves_it_out_of_the_step(seeded):
    from quantplan.services import kernels as kernels_svc

    n, k = _seed_spread(seeded.id)
    est = kernels_svc.step_estimate(seeded, {"default": "FP8_DYNAMIC"}, "Test CPU", m_prefill=16, m_decode=1)
    downs = [lin["name"] for lin in smol_linears() if lin["name"].endswith("mlp.down_proj")]
    assert est["unstable_prefill"] == downs and est["missing_prefill"] == downs and est["unstable_decode"] == []
    layers = len(est["per_layer"])
    assert est["covered_prefill"] == layers - len(downs) and est["layers"] == layers

    at = _kernels_page(seeded.id)
    flag = next(w.value for w in at.warning if "UNSTABLE" in w.value)
    assert flag.startswith(f"1 case(s) UNSTABLE (fp8_row+q M=16 N={n} K={k}): the 20th-80th percentile band")
    assert "wider than 25% of the median" in flag and "the step estimate below leaves them out" in flag

    # the heatmap: both times, the repeats and the spread in the tooltip; the unstable cell marked, the skip lighter
    rows = {(r["shape"], r["path"]): r for r in _heatmap_rows(at)}
    label = next(s for s, p in rows if s.startswith("down_proj") and s.endswith("M=16") and p == "fp8_row+q")
    shaky, steady, skipped = rows[(label, "fp8_row+q")], rows[(label, "fp8_tensor")], rows[(label, "int8_row")]
    assert shaky["unstable"] is True and steady["unstable"] is False
    assert shaky["time"] == "2 ms (p20-p80 1.2-3.4 ms, 5 repeats)"
    assert shaky["baseline"] == "1 ms (p20-p80 0.98-1.03 ms, 5 repeats)"
    assert shaky["status"].startswith("UNSTABLE: p20-p80 over 25% of the median (path 110%, baseline 5%)")
    assert steady["text"] == "1.25×" and steady["status"] == "measured"
    assert skipped["text"] == "skipped" and skipped["status"].startswith("no time: over budget: ~3 s needed")
    assert skipped["text_color"] != steady["text_color"] == "black"  # lighter than a measured cell
    old = rows[(label.replace("M=16", "M=1"), "fp8_tensor")]  # the seeded rows: stored before the spread was kept
    assert old["time"] == "2 ms (p20-p80 —, repeats —)" and old["unstable"] is False
    assert old["status"] == "measured, but not native on this device: its speed-up is not shown"

    # the table: the spread, repeats, baseline and stability, "—" where a row kept none
    table = next(d.value for d in at.dataframe if "stability" in d.value.columns)
    row = table[(table["path"] == "fp8_row+q") & (table["m"] == 16) & (table["n"] == n) & (table["k"] == k)].iloc[0]
    assert (row["spread"], row["repeats"], row["stability"]) == ("1.2-3.4", "5", "UNSTABLE")
    assert row["baseline"] == "1 (0.98-1.03)"
    seeded_row = table[(table["path"] == "baseline") & (table["m"] == 1)].iloc[0]
    assert (seeded_row["spread"], seeded_row["repeats"], seeded_row["stability"]) == ("—", "—", "—")

    # the step: the prefill's sum rests on fewer than all layers: coverage first, no headline metric
    prefill = f"**Prefill (M=16) covers {layers - len(downs)} of {layers} layers: partial**"
    assert prefill in [md.value for md in at.markdown]
    assert not any(m.label.startswith("Prefill") for m in at.metric)
    said = next(c.value for c in at.caption if "over those layers alone" in c.value)
    assert said.startswith(f"{est['prefill_ms']:.3f} ms over those layers alone") and \
        f"; {len(downs)} left out as unstable" in said
    note = next(c.value for c in at.caption if "no time for their path" in c.value)
    assert "left out as unstable (their timed calls spread too widely): queue the benchmark again" in note
    (decode,) = [m for m in at.metric if m.label == "Decode (M=1)"]  # every layer: the headline figure
    assert decode.value == f"{est['decode_ms']:.3f} ms"
