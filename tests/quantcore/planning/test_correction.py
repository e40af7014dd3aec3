"""The predicted -> measured correction of automatic plans, and Spearman's rank correlation (issue 43)."""

from __future__ import annotations

import math

import pytest

from quantcore.planning.correction import MAX_FACTOR, fit_correction, spearman


def test_the_correction_is_the_geometric_mean_ratio_and_says_what_it_rests_on():
    fit = fit_correction([(0.01, 0.02), (0.02, 0.08)])  # ratios 2 and 4
    assert fit is not None and fit.verifications == 2
    assert fit.factor == pytest.approx(math.sqrt(8))
    assert fit.spread == pytest.approx(math.exp(math.log(2) / math.sqrt(2)))  # sd of ln 2, ln 4 (ddof 1)
    assert fit.corrected(0.01) == pytest.approx(0.01 * math.sqrt(8))
    assert fit.corrected(fit.search_budget(0.05)) == pytest.approx(0.05)
    assert fit.text().endswith("from 2 verified plans")
    one = fit_correction([(0.01, 0.013), (0.0, 0.01), (0.02, math.nan)])  # only positive, finite pairs count
    assert one is not None and one.verifications == 1 and one.spread == 1.0 and one.factor == pytest.approx(1.3)
    assert one.text().endswith("from 1 verified plan")
    assert fit_correction([]) is None and fit_correction([(0.0, 0.1)]) is None
    assert fit_correction([(1e-9, 1.0)]).factor == pytest.approx(MAX_FACTOR)  # a stray score cannot run away


def test_spearman_of_known_rankings():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(0.8207826816681233)  # a tie: mean ranks
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="one length"):
        spearman([1, 2], [1, 2, 3])
