"""`quantplan calibrate | score | sensitivity | bench`: the commands that queue a job (or run it here with
--local) and print what it found."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from jobs.specs import QUICK_SWEEP_SAMPLES, SHARDS, BenchSpec, CalibrateSpec, ScoreSpec, context_problem
from quantcore.errors import name_list
from quantcore.evaluation.kvcache import KV_FORMATS
from quantplan.cli.common import (
    CliError,
    checked_settings,
    comma_items,
    dataset_param,
    find_model,
    kv_format_arg,
    print_json,
    run_job,
    scheme_arg,
    text_sizes,
)
from quantplan.cli.options import (
    SubParsers,
    add_budget,
    add_calibration_options,
    add_expert_parallel,
    add_gpu_options,
    add_kv_cache,
    add_model,
    add_rollout_options,
    add_rotation,
    add_run_options,
    add_tensor_parallel,
    add_text_job_options,
    bounded,
    m_values,
    rotation_param,
    stream_param,
)


def _rotation_param(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`rotation_param`, a CliError naming the problem (whole or streamed alike: a streamed job rotates each
    block as it loads)."""
    try:
        return rotation_param(args)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def cmd_calibrate(args: argparse.Namespace) -> int:
    """`quantplan calibrate MODEL`: activation statistics of every linear layer; the largest outlier ratios."""
    checked_settings()
    model = find_model(args.model)
    _check_context(args, model, CalibrateSpec.seq_len)
    params = {**text_sizes(args), "device": args.device, **dataset_param(args.text, "calibration"),
              **stream_param(args), **_rotation_param(args)}
    job = run_job("calibrate", params, model_id=model.id, local=args.local, quiet=args.json,
                  timeout_s=args.timeout)
    from quantplan.services import calibration as calibration_svc

    rows = calibration_svc.stats_overview(job.id)
    kv = (job.result or {}).get("kv_amax") or {}
    experts = (job.result or {}).get("experts") or {}  # an MoE model: calibration tokens routed to each expert
    if args.json:
        print_json({"job": job.id, "model": model.name, "layers": rows, "kv_amax": kv,
                    **({"experts": experts} if experts else {})})
    else:
        rows.sort(key=lambda r: r["outlier_ratio"], reverse=True)
        print(f"job #{job.id}: {len(rows)} linears calibrated; largest outlier ratios:")
        for r in rows[:10]:
            print(f"  {r['name']:48s} K={r['in_features']:<6d} ratio {r['outlier_ratio']:10.1f}")
        for line in _kv_lines(kv):
            print(line)
        if experts:
            from quantcore.evaluation.experts import MIN_EXPERT_TOKENS, thin_experts

            thin = thin_experts(experts)
            total = sum(len(r.get("counts") or []) for r in experts.values())
            print(f"MoE: {len(thin)} of {total} experts were routed fewer than {MIN_EXPERT_TOKENS} calibration tokens"
                  + (f" (e.g. {thin[0][0]}.{thin[0][1]}: {thin[0][2]}); their statistics rest on few tokens: "
                     "calibrate on more text" if thin else ""))
    return 0


def _check_context(args: argparse.Namespace, model: Any, default_seq_len: int) -> None:
    """Refuse, before any job, a --seq-len / --cal-seq-len longer than the model's context (its config's
    max_position_embeddings, from the stored summary; jobs.specs.context_problem): the job would read positions
    the model never learned (or fail inside the job row). A default it was not asked for is not refused."""
    asked = [("--seq-len", args.seq_len if args.seq_len != default_seq_len else None),
             ("--cal-seq-len", getattr(args, "cal_seq_len", None))]
    for option, tokens in asked:
        if tokens is not None and (problem := context_problem(option, tokens, model.context, model.name)):
            raise CliError(problem)


def _kv_lines(kv_amax: dict) -> list[str]:
    """What a calibration says of the KV cache, for people: the largest |K|, |V| and |Q| against what E4M3 holds at
    scale 1.0, and how far the KV heads of one layer differ (what per-head scales would change)."""
    from quantcore.evaluation.kvcache import kv_head_spread

    largest = {t: max(kv_amax[t].items(), key=lambda item: item[1]) for t in ("k", "v", "q") if kv_amax.get(t)}
    if not largest:
        return []
    out = ["K, V and Q as the KV cache and FP8 attention hold them: " + "; ".join(
        f"largest |{t.upper()}| {a:,.4g} ({layer})" + (" > 448: clipped at scale 1.0" if a > 448 else "")
        for t, (layer, a) in largest.items())]
    spread = kv_head_spread(kv_amax)
    if spread:
        layer, tensor, ratio = spread[0]
        out.append(f"KV heads of one layer differ by up to {ratio:,.1f}x ({tensor} of {layer}): one scale per layer "
                   "makes its smallest head's grid that much coarser; FP8_ATTN_HEAD gives each head its own scale")
    return out


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
    """The calibration text of a score or sensitivity job (GPTQ Hessians, AWQ scales, KV cache scales, a first
    calibration when none is stored), as the options give it; the job spec's defaults (jobs.specs.ScoreSpec:
    cal_samples x cal_seq_len tokens of the built-in text) otherwise."""
    out: dict[str, Any] = {}
    if args.cal_text:
        out["cal_dataset"] = dataset_param(args.cal_text, "calibration")["dataset"]
    for key, value in (("cal_samples", args.cal_samples), ("cal_seq_len", args.cal_seq_len)):
        if value is not None:
            out[key] = value  # bounded when parsed (options.add_text_job_options)
    return out


def cmd_score(args: argparse.Namespace) -> int:
    """`quantplan score MODEL --scheme S | --plan FILE | --all-presets`: KL, top-1 and perplexity against the
    unquantized model."""
    checked_settings()
    model = find_model(args.model)
    _check_context(args, model, ScoreSpec.seq_len)
    base: dict[str, Any] = {**text_sizes(args), "device": args.device, **stream_param(args),
                            **dataset_param(args.text, "evaluation"), **_calibration_params(args)}
    if args.kv_cache:
        base["kv_cache"] = kv_format_arg(args.kv_cache)
    base.update(_gpus_param(args, model))
    if args.all_presets:
        from quantcore.schemes.presets import list_schemes

        rows = []
        for name in list_schemes():
            job = run_job("score", {**base, "scheme": name}, model_id=model.id, local=args.local, quiet=args.json,
                          timeout_s=args.timeout)
            rows.append({**job.result, "scheme": name, "job": job.id})
        if args.json:
            print_json(rows)
        else:
            print(preset_table(rows, model.name))
        return 0
    if bool(args.scheme) == bool(args.plan):
        raise CliError("give exactly one of --scheme NAME or --plan FILE (or --all-presets)")
    params = {**base, **({"scheme": scheme_arg(args.scheme)} if args.scheme else _plan_param(args.plan))}
    if args.rollouts:
        params.update(rollouts=args.rollouts, rollout_len=args.rollout_len, clip_eps=args.clip_eps)
    if "plan" in params:  # refused here, before a job loads the model, when it does not fit this model
        from quantplan.services import plans as plans_svc
        from quantplan.services import serving as serving_svc

        _, problem = plans_svc.resolve(model, params["plan"])
        if problem:
            raise CliError(problem)
        if "tensor_parallel" not in params:  # the plan file's own GPUs, as the job will score it
            par = plans_svc.parallelism(model, params["plan"])
            if refusals := serving_svc.split_refusals(model, par.tp, par.expert_parallel):
                raise CliError("; ".join(refusals))
    job = run_job("score", params, model_id=model.id, local=args.local, quiet=args.json,
                  timeout_s=args.timeout)
    if args.json:
        print_json({"job": job.id, **job.result})
    else:
        r = job.result
        # the job names a --kv-cache override in its label ("FP8_DYNAMIC + KV FP8"), not a plan file's own cache
        named = r.get("kv_cache", "AUTO") == "AUTO" or "kv_cache" in params
        kv = "" if named else f" (KV cache {r['kv_cache']})"
        print(f"job #{job.id} {r['plan']}{kv} on {model.name}: KL mean {r['kl_mean']:.4g} (p50 {r['kl_p50']:.4g}, "
              f"p99 {r['kl_p99']:.4g}, max {r['kl_max']:.4g}), top-1 agreement {r['top1_agree']:.4f}, "
              f"perplexity {r['ppl_ref']:.2f} → {r['ppl']:.2f} over {r['tokens']} tokens")
        from quantplan.services import scoring as scoring_svc

        for line in scoring_svc.statistics_lines(r):  # llama-perplexity --kl-divergence's block, with its ±
            print(f"  {line}" if line else "")
        for line in scoring_svc.rollout_lines(r.get("rollout")):
            print(f"  {line}")
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
    if args.tensor_parallel is None:  # --tp was checked when parsed (jobs.specs.TENSOR_PARALLEL): 0 is refused
        if args.expert_parallel:
            raise CliError("--expert-parallel needs --tp GPUS (more than one GPU to share the experts among)")
        return {}
    from quantcore.models.parallel import parse_tp
    from quantplan.services import serving as serving_svc

    tp = parse_tp(args.tensor_parallel)
    if refusals := serving_svc.split_refusals(model, tp, args.expert_parallel):
        raise CliError("; ".join(refusals))
    return {"tensor_parallel": tp, "expert_parallel": args.expert_parallel}


def _tokens(shape: list[int] | None) -> str:
    return f" ({shape[0]} × {shape[1]} tokens)" if shape else ""


def preset_table(rows: list[dict[str, Any]], model_name: str) -> str:
    """A Markdown table of every preset's score on a model, lowest KL first."""
    kv = {r.get("kv_cache", "AUTO") for r in rows} - {"AUTO"}
    also = f", KV cache {', '.join(sorted(kv))}" if kv else ""
    lines = [f"Every preset on {model_name} (all linear layers, lm_head included{also}):", "",
             "| scheme | KL mean | KL p99 | top-1 agree | perplexity |", "|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r["kl_mean"]):
        lines.append(f"| {r['scheme']} | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} | {r['top1_agree']:.3f} | "
                     f"{r['ppl']:.2f} (ref {r['ppl_ref']:.2f}) |")
    return "\n".join(lines)


def cmd_sensitivity(args: argparse.Namespace) -> int:
    """`quantplan sensitivity MODEL --scheme S | --kv-cache F`: the KL of quantizing one unit at a time."""
    checked_settings()
    model = find_model(args.model)
    _check_context(args, model, ScoreSpec.seq_len)
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
        from quantplan.services import sweeps as sweeps_svc

        if why := sweeps_svc.same_on_any_gpus(what["scheme"], gpus["tensor_parallel"]):
            print(f"note: {why}", file=sys.stderr)
            gpus = {}
    params = {**what, **text_sizes(args), "device": args.device, "groups": not args.no_groups,
              **dataset_param(args.text, "evaluation"), **_calibration_params(args), **gpus, **stream_param(args),
              **_rotation_param(args)}
    if "rotation" in params and "kv_sweep" in params:
        raise CliError("--rotation sweeps linear layers (--scheme) in the rotated model; a KV cache sweep is not built "
                       "rotated")
    if args.shards is not None:  # unset: one shard per live worker on the queue (jobs.shards)
        params["shards"] = args.shards
    if args.per_expert:
        if args.no_groups:
            raise CliError("--per-expert sweeps each expert's gate/up/down as one unit; --no-groups sweeps every layer "
                           "alone already: give one of them")
        params["per_expert"] = True
    if args.method != "kl":  # linear layers (--scheme) or attention layers' KV cache (--kv-cache) alike
        params["method"] = args.method
    job = run_job("sensitivity", params, model_id=model.id, local=args.local, quiet=args.json,
                  timeout_s=args.timeout)
    swept = job.result["scheme"]
    from quantplan.services import sweeps as sweeps_svc

    rows = sweeps_svc.sensitivity_rows(job.id)
    out = [{"layer": r.unit, "layers": r.layers, "kl_mean": r.kl_mean, "kl_mean_err": r.kl_mean_err,
            "top1_agree": r.top1_agree, "sqnr_db": r.sqnr_db} for r in rows]
    compared = None
    if args.method == "fisher" and args.compare:  # against the exact sweep of the same tokens, made if missing
        exact = sweeps_svc.exact_twin(job)
        if exact is None:
            kl_params = {k: v for k, v in params.items() if k not in ("method", "shards")}
            exact = run_job("sensitivity", kl_params, model_id=model.id, local=args.local, quiet=args.json,
                            timeout_s=args.timeout)
        compared = sweeps_svc.rank_correlation(job.id, exact.id)
    if args.json:
        doc = {"job": job.id, "scheme": swept, "method": job.result.get("method", "kl"),
               "tensor_parallel": job.result.get("tensor_parallel", 1), "layers": out,
               "not_swept": job.result.get("not_swept", [])}
        if compared is not None:
            doc["rank_correlation"] = compared
        print_json(doc)
    else:
        from quantplan.services import sweeps as sweeps_svc

        print(f"job #{job.id}: {sweeps_svc.sweep_label(job)} one unit at a time on {model.name}, most sensitive first:")
        for r in out[:20]:
            sq = "" if r["sqnr_db"] is None else f"  SQNR {r['sqnr_db']:6.1f} dB"
            err = "—" if r["kl_mean_err"] is None else format(r["kl_mean_err"], ".2g")
            top = "" if r["top1_agree"] is None else f"  top-1 {r['top1_agree']:.4f}"
            print(f"  {r['layer']:56s} KL {r['kl_mean']:10.4g} ± {err:<8}{top}{sq}")
        if compared is not None:
            print(f"rank correlation (Spearman) with the exact sweep, job #{compared['exact_job']}, over "
                  f"{compared['units']} units: {compared['spearman']:.3f}")
        if left_out := job.result.get("not_swept"):
            print(f"not swept: {len(left_out)} layer(s) no llm-compressor recipe can smooth "
                  f"({name_list(left_out, 3)}); the automatic planner gives them a scheme without SmoothQuant")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """`quantplan bench [MODEL]`: time the real GEMMs of the model's shapes on this job's device."""
    checked_settings()
    model = find_model(args.model) if args.model else None
    params: dict[str, Any] = {"device": args.device, "m": args.m, "budget_s": args.budget, "force": args.force}
    if args.paths:
        from quantcore.kernels.paths import check_paths

        try:
            params["paths"] = check_paths(comma_items(args.paths))
        except ValueError as exc:
            raise CliError(f"--paths: {exc}") from exc
    if args.tensor_parallel is not None:
        from quantcore.models.parallel import parse_tp

        if not model:
            raise CliError("--tp needs a MODEL: its layers say how they split over the GPUs")
        params["tensor_parallel"] = parse_tp(args.tensor_parallel)
        params["expert_parallel"] = args.expert_parallel
    if args.queue:
        params["queue"] = args.queue
    job = run_job("bench", params, model_id=model.id if model else None, local=args.local, quiet=args.json,
                  timeout_s=args.timeout)
    records = job.result.get("records", [])
    if args.json:
        print_json(records)
    else:
        print(f"job #{job.id} on {job.device}: {len(records)} records "
              f"({job.result.get('measured', 0)} measured now, {job.result.get('reused', 0)} reused)")
        from quantcore.kernels.device import PathSupport, describe_probe

        if device := job.result.get("device"):
            print(describe_probe(device))
        for sup in (PathSupport(**p) for p in job.result.get("paths") or []):
            print(f"  {sup.path:11s} {sup.status:22s} {sup.why}")
        from quantcore.kernels.records import KernelRecord
        from quantcore.kernels.report import format_records, unstable_summary

        if records:
            kernel_records = [KernelRecord.from_dict(r) for r in records]
            if shaky := unstable_summary(kernel_records):  # each such row's note says so too
                print(shaky)
            print(format_records(kernel_records))
    return 0


def add_calibrate_command(sub: SubParsers) -> None:
    """calibrate MODEL."""
    sp = sub.add_parser("calibrate", help="collect activation statistics of every linear layer")
    add_text_job_options(sp, text="calibration text (.txt or .jsonl); default: gensim's lee_background.cor",
                         samples=CalibrateSpec.samples, seq_len=CalibrateSpec.seq_len, scored=False)
    add_rotation(sp, "calibrate it (a what-if of the Outliers page; a rotated plan's score reads it)")
    sp.set_defaults(func=cmd_calibrate)


def add_commands(sub: SubParsers) -> None:
    """score, sensitivity, bench."""
    eval_text = "evaluation text (.txt / .jsonl); default: gensim's lee.cor"
    sp = sub.add_parser("score", help="KL / top-1 / perplexity of a plan against the unquantized model")
    add_text_job_options(sp, text=eval_text, samples=ScoreSpec.samples)
    sp.add_argument("--scheme", help="one preset for every linear layer (see `quantplan schemes`)")
    sp.add_argument("--plan", help="a plan YAML file")
    sp.add_argument("--all-presets", action="store_true", help="score every preset and print the table")
    add_kv_cache(sp, f"store K and V in this format too ({', '.join(KV_FORMATS)}; see `quantplan schemes`); "
                 "replaces the plan file's kv_cache")
    add_gpu_options(sp, "score the plan (default: the plan file's tensor_parallel, else one GPU)")
    add_calibration_options(sp)
    add_rollout_options(sp)
    sp.set_defaults(func=cmd_score)

    sp = sub.add_parser("sensitivity", help="KL of quantizing one layer (or fusion group) at a time")
    add_text_job_options(sp, text=eval_text, samples=QUICK_SWEEP_SAMPLES)
    sp.add_argument("--scheme", help="the preset each unit is quantized with, in turn")
    add_kv_cache(sp, "instead: store one attention layer's K and V at a time in this KV cache format (which layers "
                 "a plan's kv_cache_skip should keep in BF16)")
    sp.add_argument("--no-groups", action="store_true", help="one layer at a time, not one fusion group")
    sp.add_argument("--per-expert", action="store_true",
                    help="MoE models: each routed expert of a block one unit (its gate/up/down), not the block as one")
    sp.add_argument("--method", choices=("kl", "fisher"), default="kl",
                    help="kl (default): the exact KL of each unit quantized alone; fisher: the sampled-Fisher estimate "
                         "of every unit (linear units with --scheme, attention layers with --kv-cache) from a few "
                         "backward passes (docs/concepts/sensitivity.md)")
    sp.add_argument("--no-compare", dest="compare", action="store_false",
                    help="with --method fisher: do not print its rank correlation with the exact sweep of the same "
                         "tokens (by default that sweep is read, or run when there is none)")
    sp.add_argument("--shards", type=bounded(SHARDS), metavar="N",
                    help="split the units into N tasks that the queue's workers run side by side, merged into one "
                         "sweep (default: one per live worker on the queue; 1: one task; --local: always one)")
    add_gpu_options(sp, "with --scheme: quantize each unit (default one GPU)", ". `plan auto --tp GPUS` reads the "
                    "sweep made at its GPU count; a scheme without a dynamic activation scale is swept on one GPU, "
                    "as it quantizes the same on any number")
    add_calibration_options(sp)
    add_rotation(sp, "quantize each unit (--scheme) in it, as a rotated plan is scored; stored apart from the "
                 "unrotated sweeps (`plan auto --rotation` reads them)")
    sp.set_defaults(func=cmd_sensitivity)

    sp = sub.add_parser("bench", help="time the real FP8 / INT8 GEMMs on the model's shapes")
    add_model(sp, "registered model (default: SmolLM2-135M's shapes)", optional=True)
    sp.add_argument("--m", type=m_values, help="comma-separated M values (batch × tokens), default "
                    + ",".join(map(str, BenchSpec.DEFAULT_MS)))
    sp.add_argument("--paths", help="comma-separated kernel paths to time (default: all; the baseline is always "
                    "timed), e.g. int8_row,int8_row+q,w8_row: leave out the FP8 a CPU only emulates")
    add_budget(sp)
    sp.add_argument("--queue", help="route to this queue (e.g. gpu.sm90); default from the device")
    sp.add_argument("--force", action="store_true", help="measure again even where results are stored")
    add_tensor_parallel(sp, "time each GPU's share of every layer as vLLM splits it over this many GPUs (the shapes "
                        "a plan for that many GPUs runs)")
    add_expert_parallel(sp, "with --tp: an MoE model's experts whole, one GPU each (vLLM --enable-expert-parallel)")
    add_run_options(sp)
    sp.set_defaults(func=cmd_bench)
