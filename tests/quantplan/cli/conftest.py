"""A tiny Llama checkpoint registered through the command, for the command tests that run jobs on it."""

from __future__ import annotations

import pytest

from tests.factories import run_cli_json, save_tiny_llama
from tests.hub_server import hub, hub_checkpoints  # noqa: F401 - the local Hub's fixtures
from tests.steady_timings import steady_kernel_timings  # noqa: F401 - autouse here


@pytest.fixture
def tiny_model(qp_settings, tmp_path, capsys):
    folder = save_tiny_llama(tmp_path / "tiny-llama")
    res = run_cli_json(capsys, "models", "add", str(folder), "--name", "tiny", "--json")
    assert res["name"] == "tiny" and res["linears"] == 2 * 7 + 1
    return res
