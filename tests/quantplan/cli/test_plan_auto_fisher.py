"""`quantplan plan auto --sensitivity fisher`: a plan searched on the Fisher estimates, verified by a score that
records where its prediction came from; the next search of a model of that architecture family corrects its
prediction by the verified plans, saying how many it rests on, and never mixes in plans predicted from exact sweeps."""

from __future__ import annotations

import pytest

from tests.factories import run_cli as run
from tests.factories import run_cli_json as run_json

TOKENS = ("--samples", "4", "--seq-len", "32")


def test_a_plan_searched_on_the_estimate_is_verified_and_corrects_the_next(tiny_model, capsys):
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from quantplan.services.predictions import verified_predictions

    code, _, err = run(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100",
                       "--sensitivity", "fisher", "--local")
    assert code == 1 and "no Fisher estimate yet" in err and "--method fisher" in err
    run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", "--method", "fisher", "--no-compare", "--local",
             *TOKENS, "--json")
    auto = ("plan", "auto", "tiny", "--target", "h100", "--sensitivity", "fisher", "--local", "--json")
    first = run_json(capsys, *auto, "--kl-budget", "1000")
    assert first["sensitivity"] == "fisher" and first["plan_label"].startswith("auto-h100-kl1000-fisher")
    assert first["correction"] is None and first["corrected_kl"] is None
    assert set(first["plan"].values()) == {"INT8_W8A8"}  # the budget fits everything
    assert first["measured_kl"] > 0 and first["measured_kl_err"] is not None
    verify = jobs_svc.get_job(first["verify_job"])
    assert verify.params["sensitivity"] == "fisher" and verify.params["predicted_kl"] == first["predicted_kl"]
    assert any("no verified automatic plan" in n for n in first["notes"])

    model = models_svc.get_model("tiny")
    (seen,) = verified_predictions(model, "fisher")
    assert (seen.predicted_kl, seen.measured_kl) == (first["predicted_kl"], first["measured_kl"])
    assert verified_predictions(model, "kl") == []  # the estimate's verifications never correct exact sweeps'

    second = run_json(capsys, *auto, "--kl-budget", "999")
    factor = first["measured_kl"] / first["predicted_kl"]
    assert second["correction"]["verifications"] == 1
    assert second["correction"]["factor"] == pytest.approx(factor)
    assert second["corrected_kl"] == pytest.approx(factor * second["predicted_kl"])
    assert any("from 1 verified plan" in n for n in second["notes"])
    assert len(verified_predictions(model, "fisher")) == 2


def test_plan_auto_searches_on_the_estimate_by_default_and_says_when_it_has_none(tiny_model, capsys):
    """No --sensitivity: the Fisher estimates where the model has any; a model with exact sweeps only is searched on
    those, with a note naming the command that makes estimates; `sensitivity` itself stays exact by default."""
    exact = run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", "--local", *TOKENS, "--json")
    assert exact["method"] == "kl"
    auto = ("plan", "auto", "tiny", "--target", "h100", "--kl-budget", "1000", "--no-verify", "--json")
    on_exact = run_json(capsys, *auto)
    assert on_exact["sensitivity"] == "kl" and not on_exact["plan_label"].endswith("-fisher")
    assert any("no Fisher estimate yet" in n and "--method fisher" in n for n in on_exact["notes"])
    run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", "--method", "fisher", "--no-compare", "--local",
             *TOKENS, "--json")
    on_estimate = run_json(capsys, *auto)
    assert on_estimate["sensitivity"] == "fisher" and "-fisher" in on_estimate["plan_label"]
    assert not any("no Fisher estimate yet" in n for n in on_estimate["notes"])
    assert run_json(capsys, *auto, "--sensitivity", "kl")["sensitivity"] == "kl"  # asked for: the exact sweeps


def test_plan_auto_without_a_target_plans_for_the_default_gpu_and_says_so(tiny_model, capsys):
    """The issue's own command names no GPU: the plan is made for h100 (the CLI's default), said on standard error so
    that --json stays parseable, and is the plan `--target h100` makes."""
    run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", "--method", "fisher", "--no-compare", "--local",
             *TOKENS, "--json")
    code, out, err = run(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--sensitivity", "fisher",
                         "--no-verify", "--json")
    assert code == 0, err
    assert "target: h100 (the default; --target names another:" in err
    import json

    default = json.loads(out)
    named = run_json(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--sensitivity", "fisher", "--target",
                     "h100", "--no-verify", "--json")
    assert default["plan_label"].startswith("auto-h100-") and default["plan"] == named["plan"]
