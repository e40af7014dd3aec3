"""A GPTQ score job that reads every rounding an earlier job kept, against the same job rounding anew.

Usage:
    python benchmarks/gptq_reuse.py                                 # the demo model (SmolLM2-135M), W4A16_GPTQ
    python benchmarks/gptq_reuse.py --scheme INT8_W8A8_SQ_GPTQ
    python benchmarks/gptq_reuse.py --model PATH --samples 2        # another checkpoint folder

Runs quantplan's score job body in this process (``quantplan score --local``, the worker's code) in a fresh
quantplan home, side by side in one run:

- warm-up: a score of the round-to-nearest preset of the same format (W4A16 for W4A16_GPTQ), which computes and
  caches the reference log-probs (and the calibration a SmoothQuant preset needs), untimed
- rtn:  that round-to-nearest score again, the floor of the job
- anew: the GPTQ preset with nothing kept: the input Hessians on the calibration text, the rounding, the score;
  it keeps each rounded layer on disk
- kept: the same GPTQ job again, reading every rounding instead

Prints each job's seconds, kept / anew and kept / rtn, and checks that the kept job's KL is the one rounding anew
gave. No target: the figure says what keeping the roundings saves a second score of a GPTQ plan (an automatic
plan's check after a sweep, the same plan with another KV cache or on more GPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _job(argv: list[str]) -> tuple[float, dict]:
    """(seconds, the job's JSON result) of one in-process ``quantplan`` command."""
    from quantplan.cli import main

    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    seconds = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"quantplan {' '.join(argv)} failed ({code})")
    return seconds, json.loads(out.getvalue())


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="W4A16_GPTQ", help="a *_GPTQ preset")
    ap.add_argument("--model", help="a checkpoint folder to register (default: the demo model)")
    ap.add_argument("--samples", type=int, default=16, help="evaluation sequences")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per evaluation sequence")
    ap.add_argument("--cal-samples", type=int, default=16, help="calibration sequences (the Hessians' tokens)")
    ap.add_argument("--cal-seq-len", type=int, default=256, help="tokens per calibration sequence")
    args = ap.parse_args(argv)
    if not args.scheme.endswith("_GPTQ"):
        raise SystemExit(f"{args.scheme}: give a *_GPTQ preset")
    rtn = args.scheme.removesuffix("_GPTQ")

    from store.settings import get_settings

    before = os.environ.get("QUANTPLAN_HOME")
    with tempfile.TemporaryDirectory(prefix="gptq-reuse-") as home:
        os.environ["QUANTPLAN_HOME"] = home
        get_settings.cache_clear()
        try:
            times, results, model = _run(args, rtn)
        finally:
            if before is None:
                os.environ.pop("QUANTPLAN_HOME", None)
            else:
                os.environ["QUANTPLAN_HOME"] = before
            get_settings.cache_clear()

    anew, kept = results["anew"], results["kept"]
    layers = anew["gptq"]["layers"]
    if anew["gptq"]["from_cache"] != 0 or kept["gptq"]["from_cache"] != layers:
        raise SystemExit(f"the second job did not read every rounding the first kept: {anew['gptq']}, {kept['gptq']}")
    if kept["kl_mean"] != anew["kl_mean"]:
        raise SystemExit(f"the kept roundings score KL {kept['kl_mean']}, rounding anew {anew['kl_mean']}")
    name = args.model or "SmolLM2-135M-Instruct (the demo)"
    print(f"{name} ({model['linears']} linears), {args.scheme} against {rtn}, "
          f"{args.samples} x {args.seq_len} evaluation tokens, {args.cal_samples} x {args.cal_seq_len} calibration")
    for name, what in (("rtn", f"{rtn}, rounded to nearest"), ("anew", f"{args.scheme}, {layers} layers rounded"),
                       ("kept", f"{args.scheme}, {layers} layers read as kept")):
        print(f"  {name:5s} {times[name]:7.2f} s  KL {results[name]['kl_mean']:.4g}  ({what})")
    ratios = {"kept/anew": times["kept"] / times["anew"], "kept/rtn": times["kept"] / times["rtn"]}
    print(f"  kept / anew {ratios['kept/anew']:.2f}x, kept / rtn {ratios['kept/rtn']:.2f}x "
          "(the same KL to the last digit)")
    return ratios


def _run(args, rtn: str) -> tuple[dict[str, float], dict[str, dict], dict]:
    """The jobs, in the fresh home: (seconds by job, results by job, the registered model)."""
    _quiet(["migrate"])
    _, model = _job(["models", "add", *([args.model] if args.model else ["--demo"]), "--name", "bench", "--json"])
    job = ["--local", "--json", "--samples", str(args.samples), "--seq-len", str(args.seq_len),
           "--cal-samples", str(args.cal_samples), "--cal-seq-len", str(args.cal_seq_len)]
    _job(["score", "bench", "--scheme", rtn, *job])  # warm-up: the reference log-probs (and calibration)
    times: dict[str, float] = {}
    results: dict[str, dict] = {}
    for name, scheme in (("rtn", rtn), ("anew", args.scheme), ("kept", args.scheme)):
        times[name], results[name] = _job(["score", "bench", "--scheme", scheme, *job])
    return times, results, model


def _quiet(argv: list[str]) -> None:
    from quantplan.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        if main(argv) != 0:
            raise SystemExit(f"quantplan {' '.join(argv)} failed")


if __name__ == "__main__":
    main()
