"""A tiny Llama checkpoint registered through the command, for the command tests that run jobs on it."""

from __future__ import annotations

import pytest

from tests.factories import run_cli_json, save_tiny_llama
from tests.hub_server import hub, hub_checkpoints  # noqa: F401 - the local Hub's fixtures


@pytest.fixture
def tiny_model(qp_settings, tmp_path, capsys):
    folder = save_tiny_llama(tmp_path / "tiny-llama")
    res = run_cli_json(capsys, "models", "add", str(folder), "--name", "tiny", "--json")
    assert res["name"] == "tiny" and res["linears"] == 2 * 7 + 1
    return res


@pytest.fixture(autouse=True)
def steady_kernel_timings(monkeypatch):
    """No kernel case is flagged unstable here: on a busy machine a tiny model's microsecond GEMMs often spread wider
    than quantcore.kernels.records.UNSTABLE_SPREAD, and an unstable case is measured again rather than reused, so
    what a test of reuse asserts would follow the machine's load. The flag's own tests set it as they need
    (tests/quantcore/kernels/test_spread.py, tests/quantplan/cli/test_bench_spread.py)."""
    import math

    monkeypatch.setattr("quantcore.kernels.records.UNSTABLE_SPREAD", math.inf)
