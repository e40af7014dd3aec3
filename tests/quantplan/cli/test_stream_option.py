"""--stream / --no-stream (issue 42): the same option on every command that runs a model, a job's ``stream``
parameter only where one was given (unset: the worker decides by its memory budget)."""

from __future__ import annotations

from quantplan.cli.main import build_parser
from quantplan.cli.options import stream_param
from tests.factories import run_cli_json

COMMANDS = (("calibrate", "m"), ("score", "m", "--scheme", "FP8"), ("sensitivity", "m", "--scheme", "FP8"),
            ("plan", "auto", "m", "--kl-budget", "1", "--target", "h100"))


def test_every_command_that_runs_a_model_takes_stream_or_no_stream() -> None:
    parser = build_parser()
    for command in COMMANDS:
        assert stream_param(parser.parse_args([*command, "--stream"])) == {"stream": True}, command
        assert stream_param(parser.parse_args([*command, "--no-stream"])) == {"stream": False}, command
        assert stream_param(parser.parse_args(list(command))) == {}, command


def test_a_local_calibration_asked_to_stream_streams(qp_settings, tmp_path, capsys) -> None:
    from quantplan.services import jobs as jobs_svc
    from tests.factories import save_tiny_llama

    run_cli_json(capsys, "models", "add", str(save_tiny_llama(tmp_path / "tiny")), "--name", "tiny", "--json")
    out = run_cli_json(capsys, "calibrate", "tiny", "--samples", "2", "--seq-len", "16", "--local", "--json",
                       "--stream")
    job = jobs_svc.get_job(out["job"])
    assert job.params["stream"] is True and job.result["mode"] == "streamed" and len(out["layers"]) == 15
