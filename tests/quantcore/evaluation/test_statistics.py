"""quantcore.evaluation.statistics against independent computations on synthetic per-position arrays: block errors
(and why tokens are not independent), llama.cpp's percentile set, Δp's RMS, paired differences, the error-aware
front; and summarize's report built from them."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from quantcore.evaluation import statistics as stats


def _loop_block_error(rows: list[list[float]]) -> tuple[float, float]:
    """Mean of all values and the standard error of the per-row means, with plain loops (no numpy)."""
    means = [sum(r) / len(r) for r in rows]
    m = sum(means) / len(means)
    var = sum((x - m) ** 2 for x in means) / (len(means) - 1)
    total = sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    return total, math.sqrt(var / len(means))


def _loop_percentile(values: list[float], p: float) -> float:
    """Linear interpolation between the two order statistics around index (N-1) p / 100, by hand."""
    v = sorted(values)
    h = (len(v) - 1) * p / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (h - lo) * (v[hi] - v[lo])


def test_block_mean_is_the_standard_error_of_the_sequence_means():
    rng = random.Random(3)
    rows = [[rng.expovariate(20.0) for _ in range(31)] for _ in range(6)]
    want_mean, want_err = _loop_block_error(rows)
    got = stats.block_mean(np.array(rows))
    assert got.value == pytest.approx(want_mean, rel=1e-12) and got.err == pytest.approx(want_err, rel=1e-12)
    assert stats.sequence_means(np.array(rows)) == pytest.approx([sum(r) / len(r) for r in rows])
    # unequal lengths: the ratio estimator; with equal counts it is the formula above
    assert stats.block_mean(np.array(rows), counts=[31] * 6).err == pytest.approx(want_err, rel=1e-12)
    counts = [31, 20, 5, 31, 12, 1]
    cut = [r[:n] for r, n in zip(rows, counts, strict=True)]
    total = sum(sum(r) for r in cut) / sum(counts)
    resid = [sum(r) - total * len(r) for r in cut]
    err = math.sqrt(6 / 5 * sum(x * x for x in resid)) / sum(counts)
    ratio = stats.block_mean(np.array(rows), counts=counts)
    assert ratio.value == pytest.approx(total, rel=1e-12) and ratio.err == pytest.approx(err, rel=1e-12)


def test_one_sequence_has_no_error_estimate():
    one = stats.block_mean(np.array([[0.1, 0.2, 0.3]]))
    assert one.value == pytest.approx(0.2) and one.err is None
    assert one.text(".2g") == "0.2 ± —"
    assert stats.paired_difference([0.3], [0.1]).err is None


def test_correlation_along_a_sequence_makes_the_block_error_larger_than_the_iid_one_and_it_is_right():
    """Each sequence has its own level (a hard passage stays hard): the per-token iid error understates the
    uncertainty by far; the block error matches the spread of the mean over repeated evaluation sets."""
    rng = np.random.default_rng(0)
    s, length = 40, 200

    def draw() -> np.ndarray:  # AR(1) with a per-sequence level: strong correlation along each sequence
        level = rng.normal(0.0, 1.0, size=(s, 1))
        noise = np.empty((s, length))
        noise[:, 0] = rng.normal(size=s)
        for t in range(1, length):
            noise[:, t] = 0.9 * noise[:, t - 1] + rng.normal(size=s) * math.sqrt(1 - 0.81)
        return level + 0.5 * noise

    x = draw()
    naive = x.std(ddof=1) / math.sqrt(x.size)
    block = stats.block_mean(x)
    assert block.err is not None and block.err > 5 * naive
    means, errs = zip(*((e.value, e.err) for e in (stats.block_mean(draw()) for _ in range(300))), strict=True)
    # the true spread of the mean over evaluation sets: the block error estimates it, the iid one does not
    assert float(np.mean(errs)) == pytest.approx(float(np.std(means, ddof=1)), rel=0.15)
    assert naive < 0.2 * float(np.std(means, ddof=1))


def test_percentiles_are_numpys_linear_definition_with_llama_cpps_set():
    rng = random.Random(7)
    values = [rng.lognormvariate(-4, 2) for _ in range(997)]
    got = stats.percentiles(np.array(values).reshape(1, -1))
    assert list(got) == ["max", "p999", "p99", "p95", "p90", "p50", "p10", "p05", "p01", "p001", "min"]
    for (p, key) in stats.PERCENTILES:
        assert got[key] == pytest.approx(_loop_percentile(values, p), rel=1e-12), key
    assert (got["max"], got["min"]) == (max(values), min(values))
    small = stats.percentiles([5.0, 1.0, 4.0, 2.0, 3.0])  # by hand: h = 4 p / 100 between sorted 1..5
    assert small["p50"] == 3.0 and small["p10"] == pytest.approx(1.4) and small["p999"] == pytest.approx(4.996)
    assert small["p001"] == pytest.approx(1.004) and small["p95"] == pytest.approx(4.8)


def test_rms_and_its_delta_method_error():
    rng = np.random.default_rng(1)
    dp = rng.normal(-0.01, 0.05, size=(8, 50))
    got = stats.rms(dp)
    assert got.value == pytest.approx(math.sqrt(sum(v * v for v in dp.reshape(-1)) / dp.size), rel=1e-12)
    _, sq_err = _loop_block_error((dp**2).tolist())
    assert got.err == pytest.approx(sq_err / (2 * got.value), rel=1e-12)


def test_paired_difference_sees_a_constant_shift_that_independent_errors_hide():
    rng = np.random.default_rng(2)
    hardness = rng.lognormal(-3.5, 1.0, size=16)  # per-sequence KL varies 10x between passages
    a = hardness * rng.uniform(0.95, 1.05, size=16)
    b = a + 0.002  # plan B is worse by a constant 0.002 on every sequence
    paired = stats.paired_difference(b.tolist(), a.tolist())
    d = (b - a).tolist()
    assert paired.value == pytest.approx(sum(d) / 16) and paired.err is not None and paired.err < 1e-12
    assert stats.distinguishable(paired)
    ea, eb = stats.block_mean(a[:, None]), stats.block_mean(b[:, None])
    independent = stats.independent_difference(eb, ea)
    assert independent.err == pytest.approx(math.hypot(ea.err, eb.err))  # type: ignore[arg-type]
    assert not stats.distinguishable(independent)  # the same gap, hidden by the passages' spread
    # the paired error is the standard error of the per-sequence differences, by hand
    noisy = a + rng.normal(0.0, 0.01, size=16)
    _, want = _loop_block_error([[x] for x in (noisy - a).tolist()])
    assert stats.paired_difference(noisy.tolist(), a.tolist()).err == pytest.approx(want, rel=1e-12)


def test_independent_noise_is_indistinguishable():
    rng = np.random.default_rng(4)
    a, b = rng.normal(0.04, 0.01, size=32), rng.normal(0.04, 0.01, size=32)
    diff = stats.paired_difference(a.tolist(), b.tolist())
    assert abs(diff.value) < stats.Z * diff.err  # type: ignore[operator]
    assert not stats.distinguishable(diff)
    with pytest.raises(ValueError, match="match one for one"):
        stats.paired_difference([0.1, 0.2], [0.1])


def test_within_and_the_sequences_that_would_settle_it():
    est = stats.Estimate(0.0367, 0.0021)
    assert stats.within(est, 0.05) is True and stats.within(est, 0.03) is False and stats.within(est, 0.04) is None
    total = stats.sequences_to_settle(est, 0.04, 4)
    assert total is not None and total > 4
    settled = stats.Estimate(0.0367, 0.0021 * math.sqrt(4 / total))  # the error shrinks as 1 / sqrt(sequences)
    assert stats.within(settled, 0.04) is True
    fewer = stats.Estimate(0.0367, 0.0021 * math.sqrt(4 / (total - 1)))
    assert stats.within(fewer, 0.04) is None
    assert stats.sequences_to_settle(stats.Estimate(0.04, 0.001), 0.04, 4) is None  # on the budget: never


def test_the_front_with_error_bars_leaves_off_a_dearer_plan_it_cannot_tell_apart():
    rng = np.random.default_rng(5)
    from quantcore.planning.plans import pareto_front

    for _ in range(50):  # no errors: the point-estimate front exactly
        costs = [float(c) for c in rng.integers(1, 6, size=7)]
        kls = [float(k) for k in rng.integers(0, 6, size=7) / 100]
        got = stats.distinguishable_front(costs, kls, lambda i, j, k=kls: stats.Estimate(k[i] - k[j], 0.0))
        assert got == pareto_front(list(zip(costs, kls, strict=True)))
    # costs 1 < 2 < 3; B's KL is not told apart from A's, C's is: B is off, C stays (B does not hide it)
    costs2, kls2, errs = [1.0, 2.0, 3.0, None], [0.050, 0.046, 0.030, 0.001], [0.003, 0.003, 0.003, 0.0]
    front = stats.distinguishable_front(
        costs2, kls2, lambda i, j: stats.independent_difference(stats.Estimate(kls2[i], errs[i]),
                                                                stats.Estimate(kls2[j], errs[j])))
    assert front == [True, False, True, False]  # no cost: never on it


def test_summarize_reports_every_figure_with_its_error():
    from quantcore.evaluation.scoring import ScoreReport, summarize

    g = torch.Generator().manual_seed(0)
    s, n = 5, 63
    kl = torch.rand(s, n, generator=g).pow(4) * 0.5
    agree = torch.rand(s, n, generator=g) > 0.08
    nll_ref = torch.rand(s, n, generator=g) * 4
    nll = nll_ref + torch.rand(s, n, generator=g) * 0.1
    dp = (torch.rand(s, n, generator=g) - 0.6) * 0.3
    rep = summarize(kl, agree, nll, nll_ref, dp=dp)
    rows = kl.double().tolist()
    mean, err = _loop_block_error(rows)
    assert rep.kl_mean == pytest.approx(mean, rel=1e-12) and rep.kl_mean_err == pytest.approx(err, rel=1e-12)
    flat = [v for r in rows for v in r]
    for key, p in (("kl_p999", 99.9), ("kl_p99", 99.0), ("kl_p95", 95.0), ("kl_p90", 90.0), ("kl_p50", 50.0),
                   ("kl_p10", 10.0), ("kl_p05", 5.0), ("kl_p01", 1.0), ("kl_p001", 0.1)):
        assert getattr(rep, key) == pytest.approx(_loop_percentile(flat, p), rel=1e-12), key
    assert (rep.kl_max, rep.kl_min) == (max(flat), min(flat))
    top1, top1_err = _loop_block_error(agree.double().tolist())
    assert rep.top1_agree == pytest.approx(top1) and rep.top1_agree_err == pytest.approx(top1_err, rel=1e-12)
    ratio, ratio_err = _loop_block_error((nll - nll_ref).double().tolist())
    assert rep.ln_ppl_ratio == pytest.approx(math.log(rep.ppl / rep.ppl_ref), rel=1e-6)
    assert rep.ln_ppl_ratio == pytest.approx(ratio, rel=1e-9)
    assert rep.ln_ppl_ratio_err == pytest.approx(ratio_err, rel=1e-9)
    dp_mean, dp_err = _loop_block_error(dp.double().tolist())
    assert rep.dp_mean == pytest.approx(dp_mean, rel=1e-12) and rep.dp_mean_err == pytest.approx(dp_err, rel=1e-12)
    dp_flat = [v for r in dp.double().tolist() for v in r]
    assert rep.dp_rms == pytest.approx(math.sqrt(sum(v * v for v in dp_flat) / len(dp_flat)), rel=1e-12)
    assert rep.dp_p50 == pytest.approx(_loop_percentile(dp_flat, 50.0)) and rep.dp_min == min(dp_flat)
    assert rep.sequences == s and len(rep.kl_by_sequence or []) == s
    assert rep.kl_by_sequence == pytest.approx([sum(r) / n for r in rows])
    assert rep.nll_diff_by_sequence == pytest.approx([sum(r) / n for r in (nll - nll_ref).double().tolist()])
    # to_dict / from_dict keep every figure; a report stored before them reads None
    assert ScoreReport.from_dict(rep.to_dict()) == rep
    old = {k: rep.to_dict()[k] for k in ("kl_mean", "kl_p50", "kl_p90", "kl_p99", "kl_max", "top1_agree",
                                          "ppl_ref", "ppl", "tokens")}
    back = ScoreReport.from_dict(old)
    assert back.kl_mean_err is None and back.kl_p999 is None and back.ln_ppl_ratio is None
    assert back.dp_mean is None and back.kl_by_sequence is None and back.numerics == 1
    # no Δp given: the Δp figures stay None; one sequence: no errors
    one = summarize(kl[:1], agree[:1], nll[:1], nll_ref[:1])
    assert one.dp_mean is None and one.dp_rms is None and one.kl_mean_err is None and one.top1_agree_err is None
    assert one.ln_ppl_ratio_err is None and one.sequences == 1
