"""Commands for scoring, sensitivity, kernel benchmarks and plans (added to the main parser)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantplan.cli import (
    CliError,
    _checked_settings,
    _dataset_param,
    _model,
    _print_json,
    _run,
    _settings,
    add_run_options,
    add_text_job_options,
)


def _plan_param(path: str) -> dict[str, Any]:
    from quantcore.plans import load_plan_file

    p = Path(path)
    if not p.exists():
        raise CliError(f"plan file {p} does not exist")
    return {"plan": load_plan_file(p).to_dict()}


def cmd_score(args) -> int:
    _checked_settings()
    model = _model(args.model)
    base: dict[str, Any] = {"samples": args.samples, "seq_len": args.seq_len, "device": args.device,
                            **_dataset_param(args.text, "evaluation")}
    if args.all_presets:
        from quantcore.schemes import list_schemes

        rows = []
        for name in list_schemes():
            job = _run("score", {**base, "scheme": name}, model_id=model.id, local=args.local, quiet=args.json)
            rows.append({"scheme": name, "job": job.id, **job.result})
        if args.json:
            _print_json(rows)
        else:
            print(preset_table(rows, model.name))
        return 0
    if bool(args.scheme) == bool(args.plan):
        raise CliError("give exactly one of --scheme NAME or --plan FILE (or --all-presets)")
    params = {**base, **({"scheme": args.scheme} if args.scheme else _plan_param(args.plan))}
    job = _run("score", params, model_id=model.id, local=args.local, quiet=args.json)
    if args.json:
        _print_json({"job": job.id, **job.result})
    else:
        r = job.result
        print(f"job #{job.id} {r['plan']} on {model.name}: KL mean {r['kl_mean']:.5f} (p50 {r['kl_p50']:.5f}, "
              f"p99 {r['kl_p99']:.4f}, max {r['kl_max']:.3f}), top-1 agreement {r['top1_agree']:.4f}, "
              f"perplexity {r['ppl_ref']:.2f} → {r['ppl']:.2f} over {r['tokens']} tokens")
    return 0


def preset_table(rows: list[dict[str, Any]], model_name: str) -> str:
    lines = [f"Every preset on {model_name} (all linear layers, lm_head included):", "",
             "| scheme | KL mean | KL p99 | top-1 agree | perplexity |", "|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r["kl_mean"]):
        lines.append(f"| {r['scheme']} | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} | {r['top1_agree']:.3f} | "
                     f"{r['ppl']:.2f} (ref {r['ppl_ref']:.2f}) |")
    return "\n".join(lines)


def cmd_sensitivity(args) -> int:
    _checked_settings()
    model = _model(args.model)
    params = {"scheme": args.scheme, "samples": args.samples, "seq_len": args.seq_len, "device": args.device,
              "groups": not args.no_groups, **_dataset_param(args.text, "evaluation")}
    job = _run("sensitivity", params, model_id=model.id, local=args.local, quiet=args.json)
    from store import repo
    from store.db import session_scope

    with session_scope(_settings()) as s:
        rows = repo.list_sensitivity(s, job.id)
    out = [{"layer": r.unit, "layers": r.layers, "kl_mean": r.kl_mean, "top1_agree": r.top1_agree,
            "sqnr_db": r.sqnr_db} for r in rows]
    if args.json:
        _print_json({"job": job.id, "scheme": args.scheme, "layers": out})
    else:
        print(f"job #{job.id}: {args.scheme} one unit at a time on {model.name}, most sensitive first:")
        for r in out[:20]:
            sq = "" if r["sqnr_db"] is None else f"  SQNR {r['sqnr_db']:6.1f} dB"
            print(f"  {r['layer']:56s} KL {r['kl_mean']:.5f}  top-1 {r['top1_agree']:.4f}{sq}")
    return 0


def cmd_bench(args) -> int:
    _checked_settings()
    model = _model(args.model) if args.model else None
    ms = [int(x) for x in args.m.split(",")] if args.m else None
    params: dict[str, Any] = {"device": args.device, "m": ms, "budget_s": args.budget, "force": args.force}
    if args.queue:
        params["queue"] = args.queue
    job = _run("bench", params, model_id=model.id if model else None, local=args.local, quiet=args.json)
    records = job.result.get("records", [])
    if args.json:
        _print_json(records)
    else:
        print(f"job #{job.id} on {job.device}: {len(records)} records "
              f"({job.result.get('measured', 0)} measured now, {job.result.get('reused', 0)} reused)")
        for r in records:
            if r.get("skipped"):
                print(f"  M={r['m']:<5} N={r['n']:<6} K={r['k']:<6} {r['path']:12s} skipped: {r['skipped']}")
            else:
                print(f"  M={r['m']:<5} N={r['n']:<6} K={r['k']:<6} {r['path']:12s} {r['ms']:9.4f} ms "
                      f"{r['tflops']:8.3f} TFLOP/s  x{r['speedup'] or 0:5.2f}  native={r['native']}  "
                      f"err={r['max_rel_err']}")
    return 0


def add_commands(sub) -> None:
    eval_text = "evaluation text (.txt / .jsonl); default: gensim's lee.cor"
    sp = sub.add_parser("score", help="KL / top-1 / perplexity of a plan against the unquantized model")
    add_text_job_options(sp, text=eval_text, samples=16)
    sp.add_argument("--scheme", help="one preset for every linear layer (see `quantplan schemes`)")
    sp.add_argument("--plan", help="a plan YAML file")
    sp.add_argument("--all-presets", action="store_true", help="score every preset and print the table")
    sp.set_defaults(func=cmd_score)

    sp = sub.add_parser("sensitivity", help="KL of quantizing one layer (or fusion group) at a time")
    add_text_job_options(sp, text=eval_text, samples=8)
    sp.add_argument("--scheme", required=True, help="the preset each unit is quantized with, in turn")
    sp.add_argument("--no-groups", action="store_true", help="one layer at a time, not one fusion group")
    sp.set_defaults(func=cmd_sensitivity)

    sp = sub.add_parser("bench", help="time the real FP8 / INT8 GEMMs on the model's shapes")
    sp.add_argument("model", nargs="?", help="registered model (default: SmolLM2-135M's shapes)")
    sp.add_argument("--m", help="comma-separated M values (batch × tokens), default 1,16,128,2048")
    sp.add_argument("--budget", type=float, default=None, help="seconds per shape before a case is skipped")
    sp.add_argument("--queue", help="route to this queue (e.g. gpu.sm90); default from the device")
    sp.add_argument("--force", action="store_true", help="measure again even where results are stored")
    add_run_options(sp)
    sp.set_defaults(func=cmd_bench)

    sp = sub.add_parser("schemes", help="list the preset schemes")
    sp.set_defaults(func=cmd_schemes)

    from quantplan import cli_plans

    cli_plans.add_commands(sub)


def cmd_schemes(args) -> int:
    from quantcore.schemes import get_scheme, list_schemes

    for name in list_schemes():
        print(f"{name:20s} {get_scheme(name).describe()}")
    return 0

