"""The options commands share (quantplan.cli.options): each job size's default is the job spec's (jobs.specs), so
it exists once; and the shared flags read the same on every command that has them."""

from __future__ import annotations

from jobs.specs import QUICK_SWEEP_SAMPLES, BenchSpec, CalibrateSpec, ScoreSpec
from quantplan.cli.main import build_parser


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_the_job_sizes_a_command_queues_by_default_are_the_specs() -> None:
    calibrate = _parse("calibrate", "m")
    assert (calibrate.samples, calibrate.seq_len) == (CalibrateSpec.samples, CalibrateSpec.seq_len)
    score = _parse("score", "m", "--scheme", "FP8")
    assert (score.samples, score.seq_len) == (ScoreSpec.samples, ScoreSpec.seq_len)
    assert (score.cal_samples, score.cal_seq_len) == (None, None)  # unset: the spec's, where the job reads them
    assert _parse("sensitivity", "m", "--scheme", "FP8").samples == QUICK_SWEEP_SAMPLES
    assert _parse("bench").budget is None  # unset: BenchSpec.budget_s


def test_the_help_names_the_defaults_the_specs_give() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    bench = " ".join(sub.choices["bench"].format_help().split())  # as one line: argparse wraps to the terminal
    assert f"(default {BenchSpec.budget_s:g})" in bench and ",".join(map(str, BenchSpec.DEFAULT_MS)) in bench
    score = " ".join(sub.choices["score"].format_help().split())
    assert f"calibration sequences (default {ScoreSpec.cal_samples})" in score


def test_the_shared_run_options_read_the_same_on_every_job_command() -> None:
    for command in (("calibrate", "m"), ("score", "m"), ("sensitivity", "m"), ("bench",)):
        args = _parse(*command, "--device", "cuda", "--local", "--json")
        assert (args.device, args.local, args.json) == ("cuda", True, True)
    for command in (("score", "m"), ("sensitivity", "m"), ("bench",), ("plan", "auto", "m", "--kl-budget", "1",
                                                                        "--target", "h100"),
                    ("plan", "show", "p"), ("plan", "export", "p", "--format", "vllm")):
        args = _parse(*command, "--tp", "2", "--expert-parallel")
        assert (args.tensor_parallel, args.expert_parallel) == (2, True)
