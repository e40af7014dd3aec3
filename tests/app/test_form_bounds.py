"""The pages' number inputs offer what the job specs accept (jobs.specs: one rule per parameter, which the CLI's
options and the specs' own checks read too), a sequence no longer than the model's context."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

from jobs.specs import BUDGET_S, CAL_SAMPLES, SAMPLES, TENSOR_PARALLEL
from store import models as m
from store.db import session_scope

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")


def _page(page: str, model_id: int) -> AppTest:
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["model_id"] = model_id
    at.session_state["results_score_open"] = True  # the Results page's score form, built once its section is opened
    at.run()
    at.switch_page(f"views/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _input(at: AppTest, label: str, nth: int = 0):
    return [n for n in at.number_input if n.label == label][nth]


def _with_context(model_id: int, context: int) -> None:
    with session_scope() as s:
        row = s.get(m.Model, model_id)
        row.summary = {**row.summary, "max_position_embeddings": context}


def test_the_forms_bounds_are_the_job_specs_and_a_sequence_fits_the_models_context(seeded):
    at = _page("models", seeded.id)  # a summary from before the context was kept: only the spec's own bound
    assert (_input(at, "Sequences").min, _input(at, "Sequences").max) == SAMPLES.form_bounds()
    assert _input(at, "Tokens per sequence").max == 1 << 20
    _with_context(seeded.id, 128)
    at = _page("models", seeded.id)
    tokens = _input(at, "Tokens per sequence")
    assert (tokens.min, tokens.max, tokens.value) == (1, 128, 128)  # the default 256 would not fit
    at = _page("results", seeded.id)
    assert (_input(at, "Tokens each").min, _input(at, "Tokens each").max) == (2, 128)  # a scored sequence: 2 tokens
    assert _input(at, "Tokens each", 1).max == 128  # the calibration text's sequences too
    assert _input(at, "Calibration sequences").max == CAL_SAMPLES.most
    at = _page("kernels", seeded.id)
    budget = _input(at, "Budget per shape (s)")
    assert (budget.min, budget.max) == BUDGET_S.form_bounds() and budget.min > 0
    gpus = _input(at, "GPUs (tensor parallel)")
    assert (gpus.min, gpus.max) == TENSOR_PARALLEL.form_bounds()
