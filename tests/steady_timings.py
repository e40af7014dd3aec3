"""The autouse fixture of the test folders whose jobs time kernels and assert what is reused: no case is flagged
unstable there (the conftests of tests/quantplan/cli and tests/worker/bodies import it)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def steady_kernel_timings(monkeypatch):
    """No kernel case is flagged unstable here: on a busy machine a tiny model's microsecond GEMMs often spread wider
    than quantcore.kernels.records.UNSTABLE_SPREAD, and an unstable case is measured again rather than reused, so
    what a test of reuse asserts would follow the machine's load. The flag's own tests set it as they need
    (tests/quantcore/kernels/test_spread.py, tests/quantplan/cli/test_bench_spread.py)."""
    import math

    monkeypatch.setattr("quantcore.kernels.records.UNSTABLE_SPREAD", math.inf)
