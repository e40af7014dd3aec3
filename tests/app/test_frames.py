"""The pages' display frames (app.frames): a KL histogram spans the bins that hold tokens; a heatmap cell with no
time says why."""

from __future__ import annotations

from app import frames
from store.records import ScoreRecord


def _score(job_id: int, counts: list[int]) -> ScoreRecord:
    edges = [0.0, *[10.0 ** e for e in range(-6, 3)]]  # 0, 1e-6 … 100: the stored bins, most of them empty
    return ScoreRecord(id=job_id, job_id=job_id, model_id=1, plan_id=None, plan_label=f"P{job_id}", plan_body={},
                       dataset="t", tokens=sum(counts), kl_mean=0.1, kl_p50=0.1, kl_p90=0.1, kl_p99=0.1, kl_max=0.1,
                       top1_agree=0.9, ppl_ref=1.0, ppl=1.0, predicted_kl=None,
                       details={"kl_hist": {"edges": edges, "counts": counts}})


def test_the_kl_histogram_spans_the_bins_that_hold_tokens_with_one_empty_bin_each_side() -> None:
    a = _score(1, [0, 0, 0, 5, 5, 0, 0, 0, 0])  # tokens in bins 3-4 (1e-4 … 1e-2)
    b = _score(2, [0, 0, 0, 0, 2, 8, 0, 0, 0])  # bins 4-5
    hist, _ = frames.score_frames([a, b])
    assert hist["label"].nunique() == 2
    for _, part in hist.groupby("label"):
        assert len(part) == 5  # bins 2-6: 3-5 occupied between both scores, one empty each side
        assert part["share"].iloc[0] == 0 and part["share"].iloc[-1] == 0
        assert abs(part["share"].sum() - 1) < 1e-12
    assert hist["center"].max() < 1  # not out to the stored last edge of 100 nats
    edge, _ = frames.score_frames([_score(3, [4, 0, 0, 0, 0, 0, 0, 0, 6])])  # occupied at both ends: nothing to trim
    assert len(edge) == 9


def test_a_case_with_no_time_says_why_only_where_the_device_runs_the_path() -> None:
    ms = [0.5, None, None, None, float("nan")]
    why = [None, "over budget: ~20 s needed, 10 s left of 60 s for shape N=1 K=1", "failed on cuda: bad shape",
           "not supported on cpu: no FP4 unit", None]
    # timed; over the budget; refused by the kernel; not run at all (n/a, the chart's default); no reason kept
    assert frames.no_time_notes(ms, why) == ["", "skipped", "failed", "", ""]
