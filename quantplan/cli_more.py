"""Commands for scoring, sensitivity, kernel benchmarks and plans (added to the main parser)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from quantcore.errors import name_list
from quantcore.evaluation.kvcache import KV_FORMATS
from quantplan.cli import (
    CliError,
    _checked_settings,
    _dataset_param,
    _model,
    _print_json,
    _run,
    _settings,
    add_ideal_options,
    add_run_options,
    add_text_job_options,
    check_at_least,
    check_target,
    comma_items,
    kv_format_arg,
    scheme_arg,
    text_sizes,
)


def _plan_param(path: str) -> dict[str, Any]:
    from quantcore.planning.plans import load_plan_file

    p = Path(path)
    if not p.exists():
        raise CliError(f"plan file {p} does not exist")
    spec = load_plan_file(p)
    if not spec.name:  # its scores are labelled by name: the file's, not its default scheme's (a preset's label)
        spec.name = p.name
    return {"plan": spec.to_dict()}


def _calibration_params(args) -> dict[str, Any]:
    """The calibration text of a score or sensitivity job (GPTQ Hessians, AWQ scales, KV cache scales, a first calibration
    when none is stored), as the options give it; the job's defaults (16 x 256 tokens, built-in) otherwise."""
    out: dict[str, Any] = {}
    if args.cal_text:
        out["cal_dataset"] = _dataset_param(args.cal_text, "calibration")["dataset"]
    for key, value in (("cal_samples", args.cal_samples), ("cal_seq_len", args.cal_seq_len)):
        if value is not None:
            out[key] = check_at_least(key, value, 1)
    return out


def add_calibration_options(sp) -> None:
    sp.add_argument("--cal-text", metavar="FILE", help="calibration text for GPTQ Hessians, AWQ scales and KV cache scales "
                    "(.txt / .jsonl); default: gensim's lee_background.cor, never the evaluation text")
    sp.add_argument("--cal-samples", type=int, metavar="N", help="calibration sequences (default 16)")
    sp.add_argument("--cal-seq-len", type=int, metavar="L", help="tokens per calibration sequence (default 256)")


def cmd_score(args) -> int:
    _checked_settings()
    model = _model(args.model)
    base: dict[str, Any] = {**text_sizes(args, scored=True), "device": args.device,
                            **_dataset_param(args.text, "evaluation"), **_calibration_params(args)}
    if args.kv_cache:
        base["kv_cache"] = kv_format_arg(args.kv_cache)
    base.update(_gpus_param(args, model))
    if args.all_presets:
        from quantcore.schemes.specs import list_schemes

        rows = []
        for name in list_schemes():
            job = _run("score", {**base, "scheme": name}, model_id=model.id, local=args.local, quiet=args.json)
            rows.append({**job.result, "scheme": name, "job": job.id})
        if args.json:
            _print_json(rows)
        else:
            print(preset_table(rows, model.name))
        return 0
    if bool(args.scheme) == bool(args.plan):
        raise CliError("give exactly one of --scheme NAME or --plan FILE (or --all-presets)")
    params = {**base, **({"scheme": scheme_arg(args.scheme)} if args.scheme else _plan_param(args.plan))}
    if "plan" in params:  # refused here, before a job loads the model, when it does not fit this model
        from app import services as svc

        _, problem = svc.resolve(model, params["plan"])
        if problem:
            raise CliError(problem)
        if "tensor_parallel" not in params:  # the plan file's own GPUs, as the job will score it
            par = svc.parallelism(model, params["plan"])
            if refusals := svc.split_refusals(model, par.tp, par.expert_parallel):
                raise CliError("; ".join(refusals))
    job = _run("score", params, model_id=model.id, local=args.local, quiet=args.json)
    if args.json:
        _print_json({"job": job.id, **job.result})
    else:
        r = job.result
        # the job names a --kv-cache override in its label ("FP8_DYNAMIC + KV FP8"), not a plan file's own cache
        named = r.get("kv_cache", "AUTO") == "AUTO" or "kv_cache" in params
        kv = "" if named else f" (KV cache {r['kv_cache']})"
        print(f"job #{job.id} {r['plan']}{kv} on {model.name}: KL mean {r['kl_mean']:.4g} (p50 {r['kl_p50']:.4g}, "
              f"p99 {r['kl_p99']:.4g}, max {r['kl_max']:.4g}), top-1 agreement {r['top1_agree']:.4f}, "
              f"perplexity {r['ppl_ref']:.2f} → {r['ppl']:.2f} over {r['tokens']} tokens")
        if r.get("gptq_calibration_text"):
            gptq = r.get("gptq") or {}
            kept = (f"; {gptq['from_cache']} of its {gptq['layers']} layer(s) as an earlier job rounded them"
                    if gptq.get("from_cache") else "")
            print(f"  GPTQ rounded its weights with the input Hessians of {r['gptq_calibration_text']}"
                  f"{_tokens(r.get('calibration_tokens'))}{kept}")
            if gptq.get("not_kept"):
                print(f"  {gptq['not_kept']}: the next job rounds them again")
        if r.get("awq_calibration_text"):
            awq = r.get("awq") or {}
            cut = awq.get("median_error_ratio")
            print(f"  AWQ {'reused the' if awq.get('cached') else 'searched the'} input scales of "
                  f"{awq.get('mappings', '?')} mapping(s) on "
                  f"{r['awq_calibration_text']}{_tokens(r.get('calibration_tokens'))}"
                  + (f": the mappings' output error × {cut:.2f} (median)" if cut is not None else "")
                  + (f"; {awq['unscaled_layers']} layer(s) left unscaled" if awq.get("unscaled_layers") else ""))
    return 0


def _gpus_param(args, model) -> dict[str, Any]:
    """The job params of --tp / --expert-parallel ({} without --tp), refused here with vLLM's reason where the model
    cannot be split over that many GPUs."""
    if not args.tensor_parallel:
        if args.expert_parallel:
            raise CliError("--expert-parallel needs --tp GPUS (more than one GPU to share the experts among)")
        return {}
    from app import services as svc
    from quantcore.models.parallel import parse_tp

    tp = parse_tp(args.tensor_parallel)
    if refusals := svc.split_refusals(model, tp, args.expert_parallel):
        raise CliError("; ".join(refusals))
    return {"tensor_parallel": tp, "expert_parallel": args.expert_parallel}


def add_gpu_options(sp, what: str, more: str = "") -> None:
    sp.add_argument("--tensor-parallel", "--tp", type=int, metavar="GPUS", help=f"{what} as served on this many GPUs: "
                    "each GPU quantizes its share of a row-parallel layer's input (o_proj, down_proj) on its own "
                    f"dynamic scale{more}")
    sp.add_argument("--expert-parallel", action="store_true", help="with --tp: an MoE model's routed experts whole, "
                    "one GPU each (vLLM --enable-expert-parallel)")


def _tokens(shape: list[int] | None) -> str:
    return f" ({shape[0]} × {shape[1]} tokens)" if shape else ""


def preset_table(rows: list[dict[str, Any]], model_name: str) -> str:
    kv = {r.get("kv_cache", "AUTO") for r in rows} - {"AUTO"}
    also = f", KV cache {', '.join(sorted(kv))}" if kv else ""
    lines = [f"Every preset on {model_name} (all linear layers, lm_head included{also}):", "",
             "| scheme | KL mean | KL p99 | top-1 agree | perplexity |", "|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r["kl_mean"]):
        lines.append(f"| {r['scheme']} | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} | {r['top1_agree']:.3f} | "
                     f"{r['ppl']:.2f} (ref {r['ppl_ref']:.2f}) |")
    return "\n".join(lines)


def cmd_sensitivity(args) -> int:
    _checked_settings()
    model = _model(args.model)
    if bool(args.scheme) == bool(args.kv_cache):
        raise CliError("give exactly one of --scheme NAME (linear layers) or --kv-cache FORMAT (attention layers)")
    what = {"scheme": scheme_arg(args.scheme)} if args.scheme else {"kv_sweep": kv_format_arg(args.kv_cache)}
    if what.get("kv_sweep") == "AUTO":
        raise CliError("a KV cache sweep needs a quantized format (FP8, FP8_ATTN, ...); AUTO changes nothing")
    gpus = _gpus_param(args, model)
    if gpus and "kv_sweep" in what:
        raise CliError("--tp sweeps linear layers (--scheme): K and V are quantized per head, the same on any number "
                       "of GPUs, so a KV cache sweep is one GPU's")
    if gpus and "scheme" in what:
        from app import services as svc

        if why := svc.same_on_any_gpus(what["scheme"], gpus["tensor_parallel"]):
            print(f"note: {why}", file=sys.stderr)
            gpus = {}
    params = {**what, **text_sizes(args, scored=True), "device": args.device, "groups": not args.no_groups,
              **_dataset_param(args.text, "evaluation"), **_calibration_params(args), **gpus}
    job = _run("sensitivity", params, model_id=model.id, local=args.local, quiet=args.json)
    swept = job.result["scheme"]
    from store import repo
    from store.db import session_scope

    with session_scope(_settings()) as s:
        rows = repo.list_sensitivity(s, job.id)
    out = [{"layer": r.unit, "layers": r.layers, "kl_mean": r.kl_mean, "top1_agree": r.top1_agree,
            "sqnr_db": r.sqnr_db} for r in rows]
    if args.json:
        _print_json({"job": job.id, "scheme": swept, "tensor_parallel": job.result.get("tensor_parallel", 1),
                     "layers": out, "not_swept": job.result.get("not_swept", [])})
    else:
        from app import services as svc

        print(f"job #{job.id}: {svc.sweep_label(job)} one unit at a time on {model.name}, most sensitive first:")
        for r in out[:20]:
            sq = "" if r["sqnr_db"] is None else f"  SQNR {r['sqnr_db']:6.1f} dB"
            print(f"  {r['layer']:56s} KL {r['kl_mean']:10.4g}  top-1 {r['top1_agree']:.4f}{sq}")
        if left_out := job.result.get("not_swept"):
            print(f"not swept: {len(left_out)} layer(s) no llm-compressor recipe can smooth "
                  f"({name_list(left_out, 3)}); the automatic planner gives them a scheme without SmoothQuant")
    return 0


def cmd_bench(args) -> int:
    _checked_settings()
    model = _model(args.model) if args.model else None
    if args.m is not None:
        from quantcore.kernels.bench import parse_ms

        try:
            ms = parse_ms(args.m)
        except ValueError as exc:
            raise CliError(f"--m: {exc}") from exc
    else:
        ms = None
    params: dict[str, Any] = {"device": args.device, "m": ms, "budget_s": args.budget, "force": args.force}
    if args.paths:
        from quantcore.kernels.bench import check_paths

        try:
            params["paths"] = check_paths(comma_items(args.paths))
        except ValueError as exc:
            raise CliError(f"--paths: {exc}") from exc
    if args.tensor_parallel:
        from quantcore.models.parallel import parse_tp

        if not model:
            raise CliError("--tp needs a MODEL: its layers say how they split over the GPUs")
        params["tensor_parallel"] = parse_tp(args.tensor_parallel)
        params["expert_parallel"] = args.expert_parallel
    if args.queue:
        params["queue"] = args.queue
    job = _run("bench", params, model_id=model.id if model else None, local=args.local, quiet=args.json)
    records = job.result.get("records", [])
    if args.json:
        _print_json(records)
    else:
        print(f"job #{job.id} on {job.device}: {len(records)} records "
              f"({job.result.get('measured', 0)} measured now, {job.result.get('reused', 0)} reused)")
        from quantcore.kernels.hardware import PathSupport, describe_probe

        if device := job.result.get("device"):
            print(describe_probe(device))
        for sup in (PathSupport(**p) for p in job.result.get("paths") or []):
            print(f"  {sup.path:11s} {sup.status:22s} {sup.why}")
        from quantcore.kernels.bench import KernelRecord, format_records

        if records:
            print(format_records(KernelRecord.from_dict(r) for r in records))
    return 0


def _set_label(score_set: tuple[str, int]) -> str:
    """'builtin:lee.cor (4,080)': an evaluation set as `scores --text` prints and takes it."""
    return f"{score_set[0]} ({score_set[1]:,})"


def _score_set(sets: list[tuple[str, int]], text: str, model_name: str) -> tuple[str, int]:
    """The evaluation set ``text`` names: 'TEXT (POSITIONS)' as printed (commas and a trailing 'positions' allowed),
    or a bare TEXT (of its sets, the one with most scores)."""
    import re

    sized = re.fullmatch(r"(.+?)\s*\(\s*([\d,]+)(?:\s+positions)?\s*\)", text.strip())
    name, positions = (sized.group(1), int(sized.group(2).replace(",", ""))) if sized else (text.strip(), None)
    matches = [t for t in sets if t[0] == name and positions in (None, t[1])]
    if not matches:
        raise CliError(f"no score of {model_name} on {text!r}; scored on: "
                       + ", ".join(repr(_set_label(t)) for t in sets))
    return matches[0]


def cmd_scores(args) -> int:
    """The stored scores of a model on one evaluation set, with each plan's weight memory (and step times on
    a device that has kernel timings), marking the plans on the KL / cost front."""
    import math

    from app import services as svc

    _checked_settings()
    model = _model(args.model)
    scores = svc.list_scores(model.id)
    if not scores:
        raise CliError(f"nothing scored on {model.name} yet: `quantplan score {model.name} --scheme FP8_DYNAMIC`")
    sets = svc.score_sets(scores)
    eval_set = sets[0]
    if args.text:
        eval_set = _score_set(sets, args.text, model.name)
    m_prefill = m_decode = None
    if args.timings:
        measured = svc.measured_ms(model, svc.kernel_records(args.timings))
        if not measured:
            known = sorted({d[1] for d in svc.kernel_devices()})
            raise CliError(f"no kernel timings of {model.name}'s shapes on {args.timings!r}; devices with "
                           f"timings: {', '.join(known) or 'none (run `quantplan bench`)'}")
        m_prefill, m_decode = args.m_prefill or max(measured), args.m_decode or min(measured)
        unmeasured = sorted({m for m in (m_prefill, m_decode) if m not in measured})
        if unmeasured:
            raise CliError(f"{args.timings} has no timings at M={', '.join(map(str, unmeasured))} for "
                           f"{model.name}'s shapes; measured M: {', '.join(map(str, measured))}")
    check_target(args.target)
    frame = svc.tradeoff_frame(model, [s for s in scores if (s.dataset, s.tokens) == eval_set],
                               device_name=args.timings, m_prefill=m_prefill, m_decode=m_decode,
                               target=args.target, ideal_m_prefill=args.prompt, ideal_m_decode=args.batch,
                               serve=tuple(args.serve) if args.serve else None)
    # (column, header, format, width) of each cost shown
    costs = [("weight_mib", "weights MiB", ",.1f", 13)]
    if (frame["kv_cache"] != "AUTO").any():
        costs.append(("kv_kib", "KV KiB/token", ",.2f", 13))
    if args.serve:
        costs.append(("serving_gib", f"serving GiB ({args.serve[0]}×{args.serve[1]})", ",.2f", 22))
    if args.timings:
        costs += [("prefill_ms", f"prefill ms (M={m_prefill})", ".4f", 20),
                  ("decode_ms", f"decode ms (M={m_decode})", ".4f", 18)]
    if args.target:
        costs += [("ideal_prefill_ms", f"ideal prefill ms (M={args.prompt})", ".4f", 26),
                  ("ideal_decode_ms", f"ideal decode ms (M={args.batch})", ".4f", 24)]
    for cost, *_ in costs:
        frame[f"front_{cost}"] = svc.with_front(frame, cost)["front"]
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            for row in frame.to_dict("records")]
    by_job = {s.job_id: s for s in scores}
    for r in rows:  # what each score's job noticed, whether older numerics made it, what GPTQ / KV scales saw
        r["notes"] = svc.score_notes(model, by_job[r["job"]])
        r["calibration"] = by_job[r["job"]].details.get("calibration")
    if args.json:
        _print_json({"model": model.name, "text": eval_set[0], "positions": eval_set[1], "timings": args.timings,
                     "m_prefill": m_prefill, "m_decode": m_decode, "target": args.target,
                     "ideal_m_prefill": args.prompt, "ideal_m_decode": args.batch, "plans": rows})
        return 0
    print(f"{model.name}: {len(rows)} plan(s) scored on {eval_set[0]} ({eval_set[1]:,} positions), lowest KL first; "
          "* = on the front (no other plan has both a lower KL and a lower cost)")
    if len(sets) > 1:
        print(f"  also scored on: {', '.join(repr(_set_label(t)) for t in sets if t != eval_set)} (--text)")
    width = max(len(r["plan"]) for r in rows)
    print(f"  {'plan':<{width}}  {'KL mean':>9}  {'top-1':>6}" + "".join(f"  {h:>{w}}" for _, h, _, w in costs))

    def cell(row: dict[str, Any], cost: str, fmt: str, w: int) -> str:
        value = row[cost]
        text = "n/a" if value is None else format(value, fmt) + ("*" if row[f"front_{cost}"] else " ")
        return f"  {text:>{w}}"

    for r in rows:
        print(f"  {r['plan']:<{width}}  {r['kl_mean']:9.5f}  {r['top1_agree']:6.3f}"
              + "".join(cell(r, c, f, w) for c, _, f, w in costs))
    for r in rows:
        if r["calibration"]:
            print(f"  calibrated on: #{r['job']} {r['plan']}: {r['calibration']}")
        for note in r["notes"]:
            print(f"  note: #{r['job']} {r['plan']}: {note}")
    if args.target:
        print(f"  ideal: the roofline bound on {svc.target_names()[args.target]} from its datasheet (weights read at "
              f"{svc.target_bandwidth(args.target):g} TB/s or math at the native peak, whichever is longer)")
    if args.timings and any(r[c] is None for r in rows for c in ("prefill_ms", "decode_ms")):
        print(f"  n/a: a layer of the plan has no time at that M on {args.timings} (skipped over budget, not "
              "supported, or not measured); a partial sum is never shown. `quantplan bench` at those M (with a "
              "larger --budget, and the plan's paths if --paths left them out) fills it in.")
    return 0


def add_commands(sub) -> None:
    eval_text = "evaluation text (.txt / .jsonl); default: gensim's lee.cor"
    sp = sub.add_parser("score", help="KL / top-1 / perplexity of a plan against the unquantized model")
    add_text_job_options(sp, text=eval_text, samples=16)
    sp.add_argument("--scheme", help="one preset for every linear layer (see `quantplan schemes`)")
    sp.add_argument("--plan", help="a plan YAML file")
    sp.add_argument("--all-presets", action="store_true", help="score every preset and print the table")
    sp.add_argument("--kv-cache", metavar="FORMAT", help=f"store K and V in this format too ({', '.join(KV_FORMATS)}; "
                    "see `quantplan schemes`); replaces the plan file's kv_cache")
    add_gpu_options(sp, "score the plan (default: the plan file's tensor_parallel, else one GPU)")
    add_calibration_options(sp)
    sp.set_defaults(func=cmd_score)

    sp = sub.add_parser("sensitivity", help="KL of quantizing one layer (or fusion group) at a time")
    add_text_job_options(sp, text=eval_text, samples=8)
    sp.add_argument("--scheme", help="the preset each unit is quantized with, in turn")
    sp.add_argument("--kv-cache", metavar="FORMAT", help="instead: store one attention layer's K and V at a time in "
                    "this KV cache format (which layers a plan's kv_cache_skip should keep in BF16)")
    sp.add_argument("--no-groups", action="store_true", help="one layer at a time, not one fusion group")
    add_gpu_options(sp, "with --scheme: quantize each unit (default one GPU)", ". `plan auto --tp GPUS` reads the "
                    "sweep made at its GPU count; a scheme without a dynamic activation scale is swept on one GPU, "
                    "as it quantizes the same on any number")
    add_calibration_options(sp)
    sp.set_defaults(func=cmd_sensitivity)

    sp = sub.add_parser("bench", help="time the real FP8 / INT8 GEMMs on the model's shapes")
    sp.add_argument("model", nargs="?", help="registered model (default: SmolLM2-135M's shapes)")
    sp.add_argument("--m", help="comma-separated M values (batch × tokens), default 1,16,128,2048")
    sp.add_argument("--paths", help="comma-separated kernel paths to time (default: all; the baseline is always "
                    "timed), e.g. int8_row,int8_row+q,w8_row: leave out the FP8 a CPU only emulates")
    sp.add_argument("--budget", type=float, default=None, help="seconds per shape before a case is skipped "
                    "(default 60); a case skipped under this budget or a larger one is not measured again")
    sp.add_argument("--queue", help="route to this queue (e.g. gpu.sm90); default from the device")
    sp.add_argument("--force", action="store_true", help="measure again even where results are stored")
    sp.add_argument("--tensor-parallel", "--tp", type=int, metavar="GPUS", help="time each GPU's share of every "
                    "layer as vLLM splits it over this many GPUs (the shapes a plan for that many GPUs runs)")
    sp.add_argument("--expert-parallel", action="store_true", help="with --tp: an MoE model's experts whole, one "
                    "GPU each (vLLM --enable-expert-parallel)")
    add_run_options(sp)
    sp.set_defaults(func=cmd_bench)

    sp = sub.add_parser("scores", help="stored scores with each plan's weight memory and step time; the KL / cost front")
    sp.add_argument("model", help="registered model (name or id)")
    sp.add_argument("--text", help="evaluation text the scores were measured on (default: the one with most scores)")
    sp.add_argument("--timings", metavar="DEVICE", help="add prefill / decode step times from this device's "
                    "kernel timings (its name as the Kernels page and `quantplan bench` show it)")
    sp.add_argument("--m-prefill", type=int, help="M of the prefill step (default: the largest measured)")
    sp.add_argument("--m-decode", type=int, help="M of the decode step (default: the smallest measured)")
    add_ideal_options(sp, "the ideal (roofline) step times")
    sp.add_argument("--serve", nargs=2, type=int, metavar=("SEQUENCES", "CONTEXT"),
                    help="add the GPU memory of serving SEQUENCES sequences of CONTEXT tokens: every weight plus "
                         "their KV cache in the format each plan was scored with")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=cmd_scores)

    sp = sub.add_parser("schemes", help="list the preset schemes")
    sp.set_defaults(func=cmd_schemes)

    from quantplan import cli_plans

    cli_plans.add_commands(sub)


def cmd_schemes(args) -> int:
    from quantcore.evaluation.kvcache import KV_FORMATS
    from quantcore.schemes.specs import get_scheme, list_schemes

    for name in list_schemes():
        print(f"{name:20s} {get_scheme(name).describe()}")
    print("\nKV cache formats (a plan's kv_cache, `score --kv-cache`):")
    for name, fmt in KV_FORMATS.items():
        print(f"{name:20s} {fmt.description}")
    return 0

