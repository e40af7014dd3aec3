"""`quantplan score --rollouts N`: sequences sampled from the quantized model and their drift from the unquantized
one (quantcore.evaluation.rollouts), in the job's result, its stored score and the printed block."""

from __future__ import annotations

import math

import pytest

from tests.factories import run_cli as run
from tests.factories import run_cli_json as run_json


def test_a_score_with_rollouts_reports_their_drift_and_stores_it(tiny_model, capsys):
    from quantplan.services import models as models_svc
    from quantplan.services import scoring as scoring_svc

    args = ("--local", "--samples", "2", "--seq-len", "16", "--rollouts", "6", "--rollout-len", "12",
            "--clip-eps", "0.1")
    out = run_json(capsys, "score", "tiny", "--scheme", "W4A16", *args, "--json")
    drift = out["rollout"]
    assert (drift["count"], drift["length"], drift["clip_eps"]) == (6, 12, 0.1)
    assert drift["log_ratio_per_token"] == pytest.approx(drift["log_ratio_mean"] / 12)
    assert drift["log_ratio_err"] == pytest.approx(drift["log_ratio_std"] / math.sqrt(6))
    assert 0.0 <= drift["outside_clip"] <= 1.0 and "log_ratios" not in drift  # the result stays small
    stored = next(s for s in scoring_svc.list_scores(models_svc.get_model("tiny").id) if s.job_id == out["job"])
    kept = stored.figure("rollout")
    assert len(kept["log_ratios"]) == 6 and sum(kept["log_ratios"]) / 6 == pytest.approx(drift["log_ratio_mean"])
    assert out["kl_mean"] == pytest.approx(stored.kl_mean)  # the score itself is unchanged by the rollouts
    code, text, _ = run(capsys, "score", "tiny", "--scheme", "W4A16", *args)
    assert code == 0 and "Rollout drift: 6 rollouts of 12 tokens" in text and "outside PPO's clip [0.9, 1.1]" in text
    plain = run_json(capsys, "score", "tiny", "--scheme", "W4A16", "--local", "--samples", "2", "--seq-len", "16",
                     "--json")
    assert "rollout" not in plain and plain["kl_mean"] == pytest.approx(out["kl_mean"])


@pytest.mark.parametrize(("argv", "said"), [
    (("--rollouts", "0"), "argument --rollouts: rollouts must be between 1 and 4096 rollouts, got 0"),
    (("--rollouts", "2", "--rollout-len", "0"), "argument --rollout-len: rollout_len must be between 1 and"),
    (("--rollouts", "2", "--clip-eps", "1"), "argument --clip-eps: clip_eps must be more than 0 and at most 0.99"),
])
def test_rollout_options_a_score_cannot_use_are_refused_when_parsed(qp_settings, capsys, argv, said):
    from quantplan.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["score", "tiny", "--scheme", "FP8", "--local", *argv])
    assert caught.value.code == 2 and said in capsys.readouterr().err
