"""`quantplan plan ...`: automatic plans, a plan's weight memory, export to serving tools, import of plan files."""

from __future__ import annotations

import sys
from pathlib import Path

from quantcore.evaluation.kvcache import KV_FORMATS
from quantplan.cli import (
    CliError,
    _checked_settings,
    _finish,
    _model,
    _print_json,
    _start,
    add_ideal_options,
    check_target,
    comma_items,
    kv_format_arg,
)


def _stored_or_file(ref: str, model_ref: str | None):
    """(model, plan body, label) from a stored plan id/name or a plan YAML file."""
    from app import services as svc
    from quantcore.planning.plans import load_plan_file
    from store.repo import NotFound

    path = Path(ref)
    if path.suffix in (".yaml", ".yml") and path.exists():
        spec = load_plan_file(path)
        mref = model_ref or spec.model
        if not mref:
            raise CliError(f"{path} names no model: add `model: NAME` to it or pass --model")
        return _model(str(mref)), spec.to_dict(), spec.name or path.stem
    try:
        plan = svc.get_plan(ref)
    except NotFound as exc:
        raise CliError(f"{exc} (and {ref} is not a plan .yaml file)") from exc
    return svc.get_model(plan.model_id), plan.body, plan.label


def cmd_plan_show(args) -> int:
    from app import services as svc
    from quantcore.planning.plans import kv_label

    _checked_settings()
    model, body, label = _stored_or_file(args.plan, args.model)
    body = _with_tp(body, args.tensor_parallel, args.expert_parallel)
    try:
        fp = svc.plan_footprint(model, body)
    except ValueError as exc:
        raise CliError(f"{label} does not resolve on {model.name}: {exc}") from exc
    ideal = []
    check_target(args.target)
    if args.target:
        for step, m in (("decode", args.batch), ("prefill", args.prompt)):
            bound = svc.step_bound(model, body, args.target, m)
            bf16 = svc.step_bound(model, svc.bf16_body(body), args.target, m)
            ideal.append({"step": step, "m": m, "ms": bound.ms, "bf16_ms": bf16.ms, "memory_bound": bound.memory_bound,
                          "layers": bound.layers, "not_native": len(bound.not_native),
                          "unsupported": len(bound.unsupported)})
    kvm = svc.kv_memory(model, body, args.target, args.context)
    if kvm is not None and args.target and args.context:
        kvm["decode_with_cache"] = {"batch": args.batch, "context": args.context,
                                    **svc.decode_with_cache(model, body, args.target, args.batch, args.context)}
    tp = int(body.get("tensor_parallel") or 1)
    warnings = svc.serving_warnings(model, body)
    if args.json:
        extra = {"target": args.target, "ideal": ideal} if args.target else {}
        _print_json({"plan": label, "model": model.name, "tensor_parallel": tp, **fp.to_dict(), **extra,
                     "kv_cache": kvm, "serving_warnings": warnings})
        return 0
    print(f"{label} on {model.name}: linear weights {svc.mib_text(fp.bits)}, {fp.ratio:.1%} of "
          f"BF16 ({svc.mib_text(fp.bf16_bits)})")
    width = max(len(r.scheme) for r in fp.rows)
    for r in fp.rows:
        print(f"  {r.scheme:<{width}}  {r.layers:>5} layers  {r.params / 1e6:>10,.2f} M weights  "
              f"{svc.mib_text(r.bits):>14}  {r.bits_per_weight:6.3f} bits/weight")
    if kvm is not None:
        print(f"KV cache {kv_label(body)}: {kvm['bytes_per_token'] / 1024:,.1f} KiB per token "
              f"(BF16 {kvm['bf16_bytes_per_token'] / 1024:,.1f} KiB)")
        if kvm["skipped_layers"]:
            print(f"  {kvm['skipped_layers']} layer(s) keep their cache in BF16 (kv_cache_skip)")
        note = svc.kv_backend_note(kvm["kv_cache"], args.target) if args.target else None
        if note:
            print(f"  {note}")
        if kvm["windowed_layers"]:
            print(f"  {kvm['windowed_layers']} layer(s) attend to a sliding window of "
                  f"{', '.join(f'{w:,}' for w in kvm['windows'])} tokens and cache only that many")
        if args.context:
            print(f"  one sequence of {args.context:,} tokens: {svc.mib_text(8 * kvm['sequence_bytes'])} "
                  f"(BF16 {svc.mib_text(8 * kvm['bf16_sequence_bytes'])})"
                  + (f"; {kvm['sequences']:,} such sequences fit (all-BF16: {kvm['bf16_sequences']:,})"
                     if args.target else ""))
        dec = kvm.get("decode_with_cache")
        if dec:
            print(f"  ideal decode step of {args.batch} sequence(s) × {args.context:,} tokens of context: "
                  f"{dec['ms']:.4f} ms ({dec['linear_ms']:.4f} linears + {dec['kv_ms']:.4f} cache read); "
                  f"all-BF16 {dec['bf16_ms']:.4f} ms")
        if args.target:
            print(f"  tokens of cache that fit on {f'{tp} × ' if tp > 1 else ''}{svc.target_names()[args.target]} "
                  "beside the weights (90 % of "
                  f"{kvm['memory_gb']:g} GB, activations not counted"
                  + ("; every layer caching every token, which the sliding-window layers do not: --context counts "
                     "them right" if kvm["windowed_layers"] else "")
                  + f"): {kvm['tokens']:,} (all-BF16: {kvm['bf16_tokens']:,})")
    if ideal:
        on = f"each of {tp} GPUs, {svc.target_names()[args.target]}" if tp > 1 else svc.target_names()[args.target]
        print(f"ideal step on {on} (roofline: weights at "
              f"{svc.target_bandwidth(args.target):g} TB/s or math at the native peak, whichever is longer):")
        for b in ideal:
            print(f"  {b['step']:<7} M={b['m']:<6} {b['ms']:9.4f} ms  x{b['bf16_ms'] / b['ms']:.2f} vs BF16 "
                  f"({b['bf16_ms']:.4f} ms); {b['memory_bound']} of {b['layers']} layers bound by their weight read")
        if ideal[0]["not_native"]:
            print(f"  {ideal[0]['not_native']} layer(s) use a scheme {args.target} does not run natively: their math "
                  "counts at bf16")
        if ideal[0]["unsupported"]:
            print(f"  {ideal[0]['unsupported']} of them have no serving kernel on {args.target} at all: the plan "
                  "cannot be served there as it stands")
        resolved, _ = svc.resolve(model, body)
        for reason in svc.support_reasons(sorted({s.name for s in (resolved or {}).values()}), args.target):
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


def cmd_plan_export(args) -> int:
    from app import services as svc

    _checked_settings()
    model, body, _label = _stored_or_file(args.plan, args.model)
    body = _with_tp(body, args.tensor_parallel, args.expert_parallel)
    text = svc.export_plan(model, body, args.format)
    for warning in svc.serving_warnings(model, body):
        print(f"quantplan: warning: {warning}", file=sys.stderr)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def cmd_plan_import(args) -> int:
    from app import services as svc

    _checked_settings()
    path = Path(args.file)
    if not path.exists():
        raise CliError(f"{path} does not exist")
    text = path.read_text()
    model_ref = args.model
    if model_ref is None and path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
        model_ref = data.get("model") if isinstance(data, dict) else None
    if model_ref is None:
        raise CliError("say which model the plan is for: --model NAME (or `model:` in the plan file)")
    model = _model(str(model_ref))
    plan, new = svc.import_plan(model, path.name, text, name=args.name)
    if args.json:
        _print_json({"id": plan.id, "name": plan.name, "version": plan.version, "model": model.name,
                     "body": plan.body, "new_version": new})
    elif not new:
        print(f"already stored as plan #{plan.id} {plan.label} for {model.name}: no new version")
    else:
        print(f"imported plan #{plan.id} {plan.label} for {model.name}")
    if note := svc.import_note(path.name):
        print(f"quantplan: note: {note}", file=sys.stderr)
    return 0


def cmd_plan_kv_skip(args) -> int:
    from app import services as svc

    _checked_settings()
    model = _model(args.model)
    try:
        out = svc.choose_kv_skip(model, kv_format_arg(args.kv_cache), args.kl_budget, args.context)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if args.json:
        _print_json(out)
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


def cmd_plan_auto(args) -> int:
    from app import services as svc
    from quantcore.models.parallel import parse_tp

    s = _checked_settings()
    model = _model(args.model)
    cands = comma_items(args.candidates) if args.candidates else None

    def queue_job(kind: str, params: dict, *, model_id: int, plan_id: int):
        return _start(kind, {**params, "user": s.user}, model_id=model_id, plan_id=plan_id, local=args.local)

    result, plan, job = svc.auto_plan(model, kl_budget=args.kl_budget, target=args.target, m=args.m,
                                      candidates=cands, verify=not args.no_verify, device=args.device or "cpu",
                                      cost=args.cost, kv_cache=kv_format_arg(args.kv_cache),
                                      tensor_parallel=parse_tp(args.tensor_parallel or 1),
                                      expert_parallel=args.expert_parallel, queue_job=queue_job)
    out = {"plan_id": plan.id, "plan_label": plan.label, **result.to_dict()}  # "plan": {layer: scheme}
    if not args.json:  # the plan first: it is saved whatever becomes of the verification
        print(f"{plan.label}: predicted KL {result.predicted_kl:.5f} ≤ {args.kl_budget:g}; cost "
              f"{svc.cost_text(result.cost, result.cost_unit)} vs "
              f"{svc.cost_text(result.baseline_cost, result.cost_unit)} all-BF16 on {args.target} "
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
            done = _finish(job, local=run_here, quiet=args.json)
            out["measured_kl"] = (done.result or {}).get("kl_mean")
            out["verify_status"] = done.status
    if args.json:
        _print_json(out)
    elif out.get("measured_kl") is not None:
        print(f"  verified by score job #{out['verify_job']}: measured KL {out['measured_kl']:.4g} (predicted "
              f"{result.predicted_kl:.4g})")
    elif "measured_kl" in out:  # the score job ended without a result
        print(f"  verification: score job #{out['verify_job']} {out['verify_status']} (see `quantplan jobs`)")
    elif job is not None:
        print(f"  verification queued: score job #{job.id}")
    return 0


def add_commands(sub) -> None:
    plan = sub.add_parser("plan", help="automatic plans, summaries, export and import").add_subparsers(dest="action",
                                                                                            required=True)
    sp = plan.add_parser("auto", help="cheapest plan whose predicted KL stays under a budget")
    sp.add_argument("model", help="registered model id or name, or 'demo'")
    sp.add_argument("--kl-budget", type=float, required=True, help="nats per token, e.g. 0.02")
    sp.add_argument("--target", required=True, help="target GPU: a100, l40s, h100, h100-pcie, h200, b200")
    sp.add_argument("--candidates", help="comma-separated schemes (default: every scheme with a sensitivity sweep)")
    sp.add_argument("--m", type=int, default=2048, help="tokens per step whose (measured or ideal) time is the cost")
    sp.add_argument("--cost", default="auto", choices=["auto", "bits", "ideal"],
                    help="what to minimise: auto = measured kernel times of the target where stored, else weight "
                         "bits; bits = weight memory; ideal = the roofline step time at --m on the target")
    sp.add_argument("--kv-cache", metavar="FORMAT", help=f"cache K and V in this format too ({', '.join(KV_FORMATS)}): its "
                    "KL, scored alone (score --scheme BF16 --kv-cache FORMAT), comes off the budget")
    sp.add_argument("--tensor-parallel", "--tp", type=int, metavar="GPUS", help="GPUs the plan is served on (vLLM --tensor-parallel-size; default 1): no scheme is "
                    "chosen for a layer whose share on one GPU vLLM would refuse")
    sp.add_argument("--expert-parallel", action="store_true", help="an MoE model's experts whole, one GPU each "
                    "(vLLM --enable-expert-parallel), not split over the GPUs")
    sp.add_argument("--no-verify", action="store_true", help="do not queue the verifying score job")
    sp.add_argument("--wait", action="store_true", help="wait for the verifying score job")
    sp.add_argument("--local", action="store_true", help="run the verifying score job in this process (no worker)")
    sp.add_argument("--device", default=None, help="device of the verifying score job (default: cpu)")
    sp.add_argument("--json", action="store_true", help="print the result as JSON")
    sp.set_defaults(func=cmd_plan_auto)

    sp = plan.add_parser("kv-skip", help="the layers to keep out of a quantized KV cache under a KL budget, with "
                         "the least cache memory (from a KV cache sweep)")
    sp.add_argument("model", help="registered model id or name, or 'demo'")
    sp.add_argument("--kv-cache", metavar="FORMAT", required=True, help="the KV cache format a sweep measured")
    sp.add_argument("--kl-budget", type=float, required=True, help="the cache's predicted KL may not exceed this")
    sp.add_argument("--context", type=int, default=4096, help="tokens of context whose cache memory is minimised "
                    "(sliding-window layers hold at most their window; default 4096)")
    sp.add_argument("--json", action="store_true", help="print the choice as JSON")
    sp.set_defaults(func=cmd_plan_kv_skip)

    sp = plan.add_parser("show", help="a plan's schemes, the memory of its linear weights and of its KV cache")
    sp.add_argument("plan", help="stored plan id or name (name@vN), or a plan .yaml file")
    sp.add_argument("--model", help="model of a plan file that does not name one")
    add_ideal_options(sp, "the ideal (roofline) decode and prefill step")
    sp.add_argument("--context", type=int, help="tokens of context a sequence holds: the KV cache of one such "
                    "sequence, and with --target how many fit and the ideal decode step of --batch of them")
    sp.add_argument("--tensor-parallel", "--tp", type=int, metavar="GPUS", help="check and time the plan split over this many GPUs (default: the plan's "
                    "tensor_parallel)")
    sp.add_argument("--expert-parallel", action="store_true", help="an MoE model's experts whole, one GPU each "
                    "(vLLM --enable-expert-parallel), not split over the GPUs")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")
    sp.set_defaults(func=cmd_plan_show)

    sp = plan.add_parser("export", help="an llm-compressor recipe, a compressed-tensors config or a vLLM command")
    sp.add_argument("plan", help="stored plan id or name (name@vN), or a plan .yaml file")
    sp.add_argument("--format", required=True, choices=["llmcompressor", "compressed-tensors", "vllm"],
                    help="llm-compressor recipe YAML, compressed-tensors quantization_config JSON or a vLLM command")
    sp.add_argument("--model", help="model of a plan file that does not name one")
    sp.add_argument("--tensor-parallel", "--tp", type=int, metavar="GPUS", help="export for this many GPUs (default: the plan's tensor_parallel): the "
                    "vLLM command gets --tensor-parallel-size")
    sp.add_argument("--expert-parallel", action="store_true", help="an MoE model's experts whole, one GPU each "
                    "(vLLM --enable-expert-parallel), not split over the GPUs")
    sp.add_argument("--output", "-o", help="write to this file (default: standard output)")
    sp.set_defaults(func=cmd_plan_export)

    sp = plan.add_parser("import", help="store a plan file, llm-compressor recipe or compressed-tensors config")
    sp.add_argument("file", help="a plan .yaml, an llm-compressor recipe .yaml or a compressed-tensors .json")
    sp.add_argument("--model", help="model to attach it to, when the file does not name one")
    sp.add_argument("--name", help="plan name (default: from the file)")
    sp.add_argument("--json", action="store_true", help="print the stored plan as JSON")
    sp.set_defaults(func=cmd_plan_import)
