"""`quantplan plan auto | kv-skip | show | export | choose | import`: automatic plans, a plan's weight memory and what
serving it runs into, export to serving tools, import of plan files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from quantcore.evaluation.kvcache import KV_FORMATS
from quantplan.cli.common import (
    CliError,
    check_target,
    checked_settings,
    comma_items,
    find_model,
    finish_job,
    kv_format_arg,
    print_json,
    start_job,
)
from quantplan.cli.options import (
    GPU_TARGETS,
    SubParsers,
    add_context,
    add_device,
    add_expert_parallel,
    add_ideal_options,
    add_json,
    add_kl_budget,
    add_kv_cache,
    add_local,
    add_model,
    add_plan_model,
    add_rotation,
    add_step_m,
    add_stream,
    add_target,
    add_tensor_parallel,
    add_timeout,
    add_wait,
    stream_param,
)
from quantplan.services.autoplan import AUTO_COSTS, STEP_TOKENS
from quantplan.services.exchange import EXPORT_FORMATS

STORED_PLAN_HELP = "stored plan id or name (name@vN), or a plan .yaml file"


def _stored_or_file(ref: str, model_ref: str | None):
    """(model, plan body, label) from a stored plan id/name or a plan YAML file."""
    model, body, label, _plan = _stored_plan_or_file(ref, model_ref)
    return model, body, label


def _stored_plan_or_file(ref: str, model_ref: str | None):
    """(model, plan body, label, the stored plan version or None for a file) from a plan id/name or YAML file."""
    from quantcore.planning.plans import load_plan_file
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc
    from store.repo import NotFound

    path = Path(ref)
    if path.suffix in (".yaml", ".yml") and path.exists():
        spec = load_plan_file(path)
        mref = model_ref or spec.model
        if not mref:
            raise CliError(f"{path} names no model: add `model: NAME` to it or pass --model")
        return find_model(str(mref)), spec.to_dict(), spec.name or path.stem, None
    try:
        plan = plans_svc.get_plan(ref)
    except NotFound as exc:
        raise CliError(f"{exc} (and {ref} is not a plan .yaml file)") from exc
    return models_svc.get_model(plan.model_id), plan.body, plan.label, plan


def cmd_plan_show(args: argparse.Namespace) -> int:
    """`quantplan plan show PLAN`: a plan's weight memory per scheme, its KV cache, ideal steps and serving warnings."""
    from quantcore.planning.plans import kv_label
    from quantplan.services import plans as plans_svc
    from quantplan.services import serving as serving_svc
    from quantplan.services import units as units_svc

    checked_settings()
    model, body, label = _stored_or_file(args.plan, args.model)
    body = _with_tp(body, args.tensor_parallel, args.expert_parallel)
    try:
        fp = plans_svc.plan_footprint(model, body)
    except ValueError as exc:
        raise CliError(f"{label} does not resolve on {model.name}: {exc}") from exc
    ideal = []
    check_target(args.target)
    if args.target:
        for step, m in (("decode", args.batch), ("prefill", args.prompt)):
            bound = serving_svc.step_bound(model, body, args.target, m)
            bf16 = serving_svc.step_bound(model, plans_svc.bf16_body(body), args.target, m)
            ideal.append({"step": step, "m": m, "ms": bound.ms, "bf16_ms": bf16.ms, "memory_bound": bound.memory_bound,
                          "layers": bound.layers, "not_native": len(bound.not_native),
                          "unsupported": len(bound.unsupported)})
    kvm = serving_svc.kv_memory(model, body, args.target, args.context)
    if kvm is not None and args.target and args.context:
        kvm["decode_with_cache"] = {"batch": args.batch, "context": args.context,
                                    **serving_svc.decode_with_cache(model, body, args.target, args.batch, args.context)}
    tp = int(body.get("tensor_parallel") or 1)
    warnings = serving_svc.serving_warnings(model, body)
    if args.json:
        extra = {"target": args.target, "ideal": ideal} if args.target else {}
        print_json({"plan": label, "model": model.name, "tensor_parallel": tp, **fp.to_dict(), **extra,
                     "per_expert": bool(body.get("per_expert")), "kv_cache": kvm, "serving_warnings": warnings})
        return 0
    print(f"{label} on {model.name}: linear weights {units_svc.mib_text(fp.bits)}, {fp.ratio:.1%} of "
          f"BF16 ({units_svc.mib_text(fp.bf16_bits)})")
    if body.get("per_expert"):
        print("  per_expert: each routed expert of an MoE block may take its own scheme (which experts take what: "
              "the serving warning below; an llm-compressor recipe holds it, vLLM cannot serve it)")
    width = max(len(r.scheme) for r in fp.rows)
    for r in fp.rows:
        print(f"  {r.scheme:<{width}}  {r.layers:>5} layers  {r.params / 1e6:>10,.2f} M weights  "
              f"{units_svc.mib_text(r.bits):>14}  {r.bits_per_weight:6.3f} bits/weight")
    if kvm is not None:
        print(f"KV cache {kv_label(body)}: {kvm['bytes_per_token'] / 1024:,.1f} KiB per token "
              f"(BF16 {kvm['bf16_bytes_per_token'] / 1024:,.1f} KiB)")
        if kvm["skipped_layers"]:
            print(f"  {kvm['skipped_layers']} layer(s) keep their cache in BF16 (kv_cache_skip)")
        note = serving_svc.kv_backend_note(kvm["kv_cache"], args.target) if args.target else None
        if note:
            print(f"  {note}")
        if kvm["windowed_layers"]:
            print(f"  {kvm['windowed_layers']} layer(s) attend to a sliding window of "
                  f"{', '.join(f'{w:,}' for w in kvm['windows'])} tokens and cache only that many")
        if args.context:
            print(f"  one sequence of {args.context:,} tokens: {units_svc.mib_text(8 * kvm['sequence_bytes'])} "
                  f"(BF16 {units_svc.mib_text(8 * kvm['bf16_sequence_bytes'])})"
                  + (f"; {kvm['sequences']:,} such sequences fit (all-BF16: {kvm['bf16_sequences']:,})"
                     if args.target else ""))
        dec = kvm.get("decode_with_cache")
        if dec:
            print(f"  ideal decode step of {args.batch} sequence(s) × {args.context:,} tokens of context: "
                  f"{dec['ms']:.4f} ms ({dec['linear_ms']:.4f} linears + {dec['kv_ms']:.4f} cache read); "
                  f"all-BF16 {dec['bf16_ms']:.4f} ms")
        if args.target:
            gpu = serving_svc.target_names()[args.target]
            print(f"  tokens of cache that fit on {f'{tp} × ' if tp > 1 else ''}{gpu} "
                  "beside the weights (90 % of "
                  f"{kvm['memory_gb']:g} GB, activations not counted"
                  + ("; every layer caching every token, which the sliding-window layers do not: --context counts "
                     "them right" if kvm["windowed_layers"] else "")
                  + f"): {kvm['tokens']:,} (all-BF16: {kvm['bf16_tokens']:,})")
    if ideal:
        gpu = serving_svc.target_names()[args.target]
        on = f"each of {tp} GPUs, {gpu}" if tp > 1 else gpu
        print(f"ideal step on {on} (roofline: weights at "
              f"{serving_svc.target_bandwidth(args.target):g} TB/s or math at the native peak, whichever is longer):")
        for b in ideal:
            print(f"  {b['step']:<7} M={b['m']:<6} {b['ms']:9.4f} ms  x{b['bf16_ms'] / b['ms']:.2f} vs BF16 "
                  f"({b['bf16_ms']:.4f} ms); {b['memory_bound']} of {b['layers']} layers bound by their weight read")
        if ideal[0]["not_native"]:
            print(f"  {ideal[0]['not_native']} layer(s) use a scheme {args.target} does not run natively: their math "
                  "counts at bf16")
        if ideal[0]["unsupported"]:
            print(f"  {ideal[0]['unsupported']} of them have no serving kernel on {args.target} at all: the plan "
                  "cannot be served there as it stands")
        resolved, _ = plans_svc.resolve(model, body)
        for reason in serving_svc.support_reasons(sorted({s.name for s in (resolved or {}).values()}), args.target):
            print(f"  {reason}")
    if tp > 1:
        print(f"tensor_parallel {tp}: the serving checks read each GPU's share of every layer"
              + ("; the step is one GPU's, all-reduces not counted" if ideal else "")
              + ("" if warnings else "; nothing to warn about"))
    for warning in warnings:
        print(f"warning: {warning}")
    return 0


def _with_tp(body: dict, tp: int | None, ep: bool = False) -> dict:
    """The plan body at --tensor-parallel ``tp`` (the plan's own size when None), with --expert-parallel."""
    from quantcore.models.parallel import parse_tp

    if tp is not None:
        tp = parse_tp(tp)
        body = {**{k: v for k, v in body.items() if k != "tensor_parallel"},
                **({"tensor_parallel": tp} if tp > 1 else {})}
    return {**body, "expert_parallel": True} if ep else body


def cmd_plan_export(args: argparse.Namespace) -> int:
    """`quantplan plan export PLAN --format F`: the plan as a recipe, a config or a vLLM command."""
    from quantplan.services import exchange as exchange_svc
    from quantplan.services import serving as serving_svc

    checked_settings()
    model, body, _label, stored = _stored_plan_or_file(args.plan, args.model)
    body = _with_tp(body, args.tensor_parallel, args.expert_parallel)
    text = exchange_svc.export_plan(model, body, args.format, plan=stored)
    for warning in serving_svc.serving_warnings(model, body):
        print(f"quantplan: warning: {warning}", file=sys.stderr)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def cmd_plan_choose(args: argparse.Namespace) -> int:
    """`quantplan plan choose MODEL PLAN [--version N] --why TEXT`: mark a plan version as the one chosen for its
    model (who, when, why); `--clear` (no PLAN) clears the model's choice."""
    from quantplan.services import choices as choices_svc
    from quantplan.services import plans as plans_svc

    checked_settings()
    model = find_model(args.model)
    if args.clear:
        if args.plan or args.version or args.why:
            raise CliError("--clear takes the model only")
        gone = choices_svc.unchoose(model.id)
        out = {"model": model.name, "cleared": gone.label if gone else None}
        if args.json:
            print_json(out)
        else:
            print(f"{model.name}: {'cleared ' + gone.label if gone else 'no choice to clear'}")
        return 0
    if not args.plan or not args.why:
        raise CliError("give the PLAN (its name) and --why TEXT (or --clear)")
    versions = [p for p in plans_svc.list_plans(model.id) if p.name == args.plan]
    if not versions:
        names = sorted({p.name for p in plans_svc.list_plans(model.id)}) or ["none yet"]
        raise CliError(f"{model.name} has no plan {args.plan!r} (its plans: {', '.join(names)})")
    plan = versions[-1] if args.version is None else next((p for p in versions if p.version == args.version), None)
    if plan is None:
        raise CliError(f"plan {args.plan!r} of {model.name} has no version {args.version} (versions: "
                       f"{', '.join(str(p.version) for p in versions)})")
    choice = choices_svc.choose_plan(plan.id, args.why)
    if args.json:
        print_json({"model": model.name, "plan_id": choice.plan_id, **choice.to_dict()})
    else:
        print(f"{choice.label} is the version chosen for {model.name}, by {choice.chosen_by} on "
              f"{choice.chosen_at:%Y-%m-%d %H:%M} UTC: {choice.why}")
    return 0


def cmd_plan_import(args: argparse.Namespace) -> int:
    """`quantplan plan import FILE`: store a plan file, recipe or compressed-tensors config as a plan version."""
    from quantplan.services import exchange as exchange_svc

    checked_settings()
    path = Path(args.file)
    if not path.exists():
        raise CliError(f"{path} does not exist")
    from quantcore.safeload import load_yaml, read_input

    # the bounded loader: a size cap, no YAML aliases, a binary file said to be one, the file named
    text, source = read_input(path, CliError)
    model_ref = args.model
    if model_ref is None and path.suffix in (".yaml", ".yml"):
        data = load_yaml(text, source, CliError)
        model_ref = data.get("model") if isinstance(data, dict) else None
    if model_ref is None:
        raise CliError("say which model the plan is for: --model NAME (or `model:` in the plan file)")
    model = find_model(str(model_ref))
    plan, new = exchange_svc.import_plan(model, path.name, text, name=args.name)
    if args.json:
        print_json({"id": plan.id, "name": plan.name, "version": plan.version, "model": model.name,
                     "body": plan.body, "new_version": new})
    elif not new:
        print(f"already stored as plan #{plan.id} {plan.label} for {model.name}: no new version")
    else:
        print(f"imported plan #{plan.id} {plan.label} for {model.name}")
    if note := exchange_svc.import_note(path.name):
        print(f"quantplan: note: {note}", file=sys.stderr)
    return 0


def cmd_plan_kv_skip(args: argparse.Namespace) -> int:
    """`quantplan plan kv-skip MODEL`: the layers to keep out of a quantized KV cache under a KL budget."""
    from quantplan.services import plan_editor as plan_editor_svc

    checked_settings()
    model = find_model(args.model)
    try:
        out = plan_editor_svc.choose_kv_skip(model, kv_format_arg(args.kv_cache), args.kl_budget, args.context)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if args.json:
        print_json(out)
        return 0
    keep = out["kv_cache_skip"]
    print(f"{model.name}, KV cache {out['kv_cache']} under KL {args.kl_budget:g} (sweep job #{out['sweep_job']}): "
          + (f"keep {', '.join(keep)} in BF16" if keep else "every layer fits in the format")
          + f"; predicted KL {out['predicted_kl']:.4g}")
    print(f"  cache of one {args.context:,}-token sequence: {out['sequence_bytes'] / 2**20:,.1f} MiB "
          f"({out['kv_cache']} everywhere {out['format_sequence_bytes'] / 2**20:,.1f} MiB, "
          f"BF16 {out['bf16_sequence_bytes'] / 2**20:,.1f} MiB)")
    print(f"  plan file: kv_cache: {out['kv_cache']}" + (f"\n             kv_cache_skip: [{', '.join(keep)}]"
                                                         if keep else ""))
    return 0


def _rotation_of(args: argparse.Namespace) -> dict[str, Any] | None:
    """``plan auto``'s --rotation as a transforms.rotation dict, None without it; a CliError naming the problem."""
    from quantplan.cli.options import rotation_param

    try:
        return rotation_param(args).get("rotation")
    except ValueError as exc:
        raise CliError(str(exc)) from exc


AUTO_TARGET = "h100"  # plan auto's GPU when none is named: the most common serving GPU of the table


def cmd_plan_auto(args: argparse.Namespace) -> int:
    """`quantplan plan auto MODEL`: the cheapest plan under a KL budget (quantplan.services.autoplan.AutoPlan), then
    its verifying score, queued, waited for or run here."""
    from quantcore.models.parallel import parse_tp
    from quantplan.services import autoplan as autoplan_svc

    s = checked_settings()
    model = find_model(args.model)
    cands = comma_items(args.candidates) if args.candidates else None
    if not args.target:  # a budget is all a first try needs; which GPU's kernels count is said, not guessed silently
        args.target = AUTO_TARGET
        print(f"target: {AUTO_TARGET} (the default; --target names another: {GPU_TARGETS})", file=sys.stderr)

    def queue_job(kind: str, params: dict, *, model_id: int, plan_id: int):
        return start_job(kind, {**params, **stream_param(args), "user": s.user}, model_id=model_id, plan_id=plan_id,
                         local=args.local)

    command = autoplan_svc.AutoPlan(model, kl_budget=args.kl_budget, target=args.target, m=args.m,
                                    candidates=cands, verify=not args.no_verify, device=args.device or "cpu",
                                    cost=args.cost, kv_cache=kv_format_arg(args.kv_cache),
                                    tensor_parallel=parse_tp(args.tensor_parallel or 1),
                                    expert_parallel=args.expert_parallel, queue_job=queue_job,
                                    sensitivity=args.sensitivity, rotation=_rotation_of(args))
    result, plan, job = command.run()
    out = {"plan_id": plan.id, "plan_label": plan.label, **result.to_dict()}  # "plan": {layer: scheme}
    correction = command.correction
    out.update(sensitivity=command.sensitivity, corrected_kl=command.corrected_kl(result),
               rotation=command.rotation if command.rotated else None,
               correction=None if correction is None else {"factor": correction.factor, "spread": correction.spread,
                                                           "verifications": correction.verifications})
    if not args.json:  # the plan first: it is saved whatever becomes of the verification
        corrected = "" if correction is None else (f" (corrected {out['corrected_kl']:.5f}, from "
                                                   f"{correction.verifications} verification(s))")
        print(f"{plan.label}: predicted KL {result.predicted_kl:.5f}{corrected} ≤ {args.kl_budget:g}; cost "
              f"{autoplan_svc.cost_text(result.cost, result.cost_unit)} vs "
              f"{autoplan_svc.cost_text(result.baseline_cost, result.cost_unit)} all-BF16 on {args.target} "
              f"({result.cost / result.baseline_cost:.0%})")
        counts: dict[str, int] = {}
        for sch in result.plan.values():
            counts[sch] = counts.get(sch, 0) + 1
        print("  " + ", ".join(f"{n} layers {sch}" for sch, n in sorted(counts.items())))
        for note in result.notes:
            print(f"  note: {note}")
        sys.stdout.flush()
    if job is not None:
        out["verify_job"] = job.id
        run_here = job.queue == "local" and job.status == "queued"  # written just now by --local
        if args.wait or run_here:
            done = finish_job(job, local=run_here, quiet=args.json, timeout_s=args.timeout)
            out["measured_kl"] = (done.result or {}).get("kl_mean")
            out["verify_status"] = done.status
            if out["measured_kl"] is not None:  # within the budget only beyond the measurement's error
                check = autoplan_svc.budget_check(done.result or {}, args.kl_budget)
                out.update(measured_kl_err=check.err, within_budget=check.within, budget_check=check.text,
                           settle_sequences=check.more_sequences, settle_tokens=check.more_tokens)
    if args.json:
        print_json(out)
    elif out.get("measured_kl") is not None:
        print(f"  verified by score job #{out['verify_job']}: {out['budget_check']} (predicted "
              f"{result.predicted_kl:.4g})")
    elif "measured_kl" in out:  # the score job ended without a result
        print(f"  verification: score job #{out['verify_job']} {out['verify_status']} (see `quantplan jobs`)")
    elif job is not None:
        print(f"  verification queued: score job #{job.id}")
    return 0


def add_commands(sub: SubParsers) -> None:
    """plan auto | kv-skip | show | export | choose | import."""
    plan = sub.add_parser("plan", help="automatic plans, summaries, export and import").add_subparsers(dest="action",
                                                                                            required=True)
    sp = plan.add_parser("auto", help="cheapest plan whose predicted KL stays under a budget")
    add_model(sp)
    add_kl_budget(sp, "nats per token, e.g. 0.02")
    add_target(sp, f"target GPU: {GPU_TARGETS} (default {AUTO_TARGET}, said on standard error)")
    sp.add_argument("--candidates", help="comma-separated schemes (default: every scheme with a sensitivity sweep)")
    add_step_m(sp, "--m", "tokens per step whose (measured or ideal) time is the cost", STEP_TOKENS)
    sp.add_argument("--cost", default="auto", choices=list(AUTO_COSTS),
                    help="what to minimise: auto = measured kernel times of the target where stored, else weight "
                         "bits; bits = weight memory; ideal = the roofline step time at --m on the target")
    add_kv_cache(sp, f"cache K and V in this format too ({', '.join(KV_FORMATS)}): its KL, scored alone (score "
                 "--scheme BF16 --kv-cache FORMAT), comes off the budget")
    add_tensor_parallel(sp, "GPUs the plan is served on (vLLM --tensor-parallel-size; default 1): no scheme is "
                        "chosen for a layer whose share on one GPU vLLM would refuse")
    add_expert_parallel(sp)
    sp.add_argument("--sensitivity", choices=("fisher", "kl"), default=None,
                    help="the unit KLs to search on: fisher = the fast estimates (sensitivity --method fisher; the "
                         "default where the model has them, else kl, with a note), kl = the exact sweeps; either "
                         "way the prediction is corrected by the verified automatic plans of the same architecture "
                         "family and source, and verified by a score")
    add_rotation(sp, "search on the sweeps made so (sensitivity --rotation) too, keeping the cheaper plan under "
                 "the budget (the output says which)")
    sp.add_argument("--no-verify", action="store_true", help="do not queue the verifying score job")
    add_wait(sp, "wait for the verifying score job")
    add_timeout(sp)
    add_local(sp, "run the verifying score job in this process (no worker)")
    add_device(sp, "device of the verifying score job (default: cpu)")
    add_stream(sp)
    add_json(sp)
    sp.set_defaults(func=cmd_plan_auto)

    sp = plan.add_parser("kv-skip", help="the layers to keep out of a quantized KV cache under a KL budget, with "
                         "the least cache memory (from a KV cache sweep)")
    add_model(sp)
    add_kv_cache(sp, "the KV cache format a sweep measured", required=True)
    add_kl_budget(sp, "the cache's predicted KL may not exceed this")
    add_context(sp, "tokens of context whose cache memory is minimised (sliding-window layers hold at most their "
                "window; default 4096)", 4096)
    add_json(sp, "print the choice as JSON")
    sp.set_defaults(func=cmd_plan_kv_skip)

    sp = plan.add_parser("show", help="a plan's schemes, the memory of its linear weights and of its KV cache")
    sp.add_argument("plan", help=STORED_PLAN_HELP)
    add_plan_model(sp)
    add_ideal_options(sp, "the ideal (roofline) decode and prefill step")
    add_context(sp, "tokens of context a sequence holds: the KV cache of one such sequence, and with --target how "
                "many fit and the ideal decode step of --batch of them")
    add_tensor_parallel(sp, "check and time the plan split over this many GPUs (default: the plan's "
                        "tensor_parallel)")
    add_expert_parallel(sp)
    add_json(sp, "print the summary as JSON")
    sp.set_defaults(func=cmd_plan_show)

    sp = plan.add_parser("export", help="an llm-compressor recipe, a compressed-tensors config or a vLLM command")
    sp.add_argument("plan", help=STORED_PLAN_HELP)
    sp.add_argument("--format", required=True, choices=list(EXPORT_FORMATS),
                    help="llm-compressor recipe YAML, compressed-tensors quantization_config JSON or a vLLM command")
    add_plan_model(sp)
    add_tensor_parallel(sp, "export for this many GPUs (default: the plan's tensor_parallel): the vLLM command gets "
                        "--tensor-parallel-size")
    add_expert_parallel(sp)
    sp.add_argument("--output", "-o", help="write to this file (default: standard output)")
    sp.set_defaults(func=cmd_plan_export)

    sp = plan.add_parser("choose", help="mark a plan version as the one chosen for its model (who, when, why)")
    add_model(sp, "registered model id or name")
    sp.add_argument("plan", nargs="?", help="the plan's name")
    sp.add_argument("--version", type=int, help="its version (default: the newest)")
    sp.add_argument("--why", help="why this version (required): the team reads it beside the choice")
    sp.add_argument("--clear", action="store_true", help="clear the model's choice instead")
    add_json(sp, "print the choice as JSON")
    sp.set_defaults(func=cmd_plan_choose)

    sp = plan.add_parser("import", help="store a plan file, llm-compressor recipe or compressed-tensors config")
    sp.add_argument("file", help="a plan .yaml, an llm-compressor recipe .yaml or a compressed-tensors .json")
    add_plan_model(sp, "model to attach it to, when the file does not name one")
    sp.add_argument("--name", help="plan name (default: from the file)")
    add_json(sp, "print the stored plan as JSON")
    sp.set_defaults(func=cmd_plan_import)
