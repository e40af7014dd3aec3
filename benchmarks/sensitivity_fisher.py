"""The fast (Fisher) sensitivity estimate against the exact sweep: ``sensitivity_cost.py --fisher`` (issue 43).

One run, side by side on the same model and tokens: one plain forward (median of the rounds timed before and after),
:func:`quantcore.evaluation.fisher.fisher_sensitivity` of every unit under the six schemes at once, and
:func:`quantcore.evaluation.sensitivity.sensitivity_sweep` of the same units under each scheme. Per scheme it prints
the Spearman rank correlation of the estimate with the exact KL (target >= 0.85) and, for the units above the
median exact KL, the median and range of estimate / exact (target: within a factor of 2). Targets of the cost: the
estimate <= 0.05 x the exact sweeps' time and <= 10 plain forwards.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from scoring_cost import plain_pass, timed

from quantcore.algorithms.inputs import PlanInputs
from quantcore.evaluation.fisher import fisher_sensitivity
from quantcore.evaluation.scoring import calibrate_kv_cache
from quantcore.evaluation.sensitivity import kv_sensitivity_sweep, sensitivity_sweep
from quantcore.planning.correction import spearman

SCHEMES = ("INT8_PER_TENSOR", "INT8_W8A8", "FP8_DYNAMIC", "W4A16", "NVFP4", "MXFP4")
KV_FORMATS = ("FP8", "FP8_ATTN")  # a calibrated KV cache, and the same with FP8 attention
TARGET_RHO = 0.85
TARGET_COST = 0.05  # x the exact sweeps' time
TARGET_FORWARDS = 10  # plain forwards


def act_amax(model: Any, ids: torch.Tensor, batch_size: int) -> dict[str, float]:
    """{linear: max |x|} of every nn.Linear's input over ``ids`` (NVFP4's static global activation scale)."""
    out: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(_m: Any, args: Any, name: str = name) -> None:
                out[name] = max(out.get(name, 0.0), float(args[0].detach().abs().max()))

            hooks.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for s in range(0, ids.shape[0], batch_size):
                model(input_ids=ids[s:s + batch_size].to(model.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out


def fisher_vs_exact(model: Any, ids: torch.Tensor, ref: Any, plain: list[float], args: Any) -> int:
    inputs = PlanInputs(act_amax=act_amax(model, ids, args.batch_size))
    passes = [int(p) for p in str(args.passes).split(",")]
    box: dict[int, Any] = {}
    t_fisher: dict[int, float] = {}
    for n in passes:
        t_fisher[n] = timed(lambda n=n: box.setdefault(n, fisher_sensitivity(
            model, SCHEMES, ids, ref, inputs=inputs, samples=args.samples, passes=n, batch_size=args.batch_size)),
            args.device)
        print(f"Fisher estimate of every unit x {len(SCHEMES)} schemes, {n} backward pass(es): {t_fisher[n]:.1f} s",
              flush=True)
    if args.no_exact:  # the estimate against plain forwards alone, timed before and after it
        plain += [timed(lambda: plain_pass(model, ids, args.batch_size), args.device) for _ in range(3)]
        t_plain = statistics.median(plain)
        print(f"plain forward   : {t_plain:.3f} s (median of {len(plain)}, spread {min(plain):.3f}-{max(plain):.3f})")
        for n in passes:
            t = t_fisher[n]
            print(f"Fisher estimate, {n} backward pass(es) a batch: {t:.1f} s = {t / t_plain:.1f} plain forwards "
                  f"(target <= {TARGET_FORWARDS}: {'ok' if t / t_plain <= TARGET_FORWARDS else 'OVER'})")
        return 0
    exact: dict[str, dict[str, float]] = {}
    t_exact: dict[str, float] = {}
    swept: dict[str, Any] = {}
    for scheme in SCHEMES:
        t_exact[scheme] = timed(lambda scheme=scheme: swept.setdefault(scheme, sensitivity_sweep(
            model, scheme, ids, ref, inputs=inputs, batch_size=args.batch_size)), args.device)
        exact[scheme] = {r.layer: r.kl_mean for r in swept[scheme]}
        print(f"exact sweep {scheme}: {t_exact[scheme]:.1f} s", flush=True)  # a long run shows its progress
    plain += [timed(lambda: plain_pass(model, ids, args.batch_size), args.device) for _ in range(3)]
    t_plain = statistics.median(plain)
    total_exact = sum(t_exact.values())
    units = len(next(iter(exact.values())))
    print(f"units   : {units} (fusion groups), schemes {', '.join(SCHEMES)}, {args.samples} sampled tokens a "
          "position in each backward pass")
    print(f"plain forward   : {t_plain:.3f} s (median of {len(plain)}, spread {min(plain):.3f}-{max(plain):.3f})")
    print(f"exact sweeps    : {total_exact:.1f} s ({' '.join(f'{s} {t:.0f}' for s, t in t_exact.items())})")
    print(f"exact per unit  : {total_exact / (units * len(SCHEMES) * t_plain):.3f} plain forwards a unit and scheme")
    for n in passes:
        t = t_fisher[n]
        print(f"Fisher estimate, {n} backward pass(es) a batch: {t:.1f} s = {t / total_exact:.3f} x exact (target <= "
              f"{TARGET_COST}: {'ok' if t / total_exact <= TARGET_COST else 'OVER'}) = {t / t_plain:.1f} plain "
              f"forwards (target <= {TARGET_FORWARDS}: {'ok' if t / t_plain <= TARGET_FORWARDS else 'OVER'})")
        print(f"  {'scheme':16s} {'spearman':>8s}  {'est/exact, units above the median: median [min, max]':s}")
        for scheme in SCHEMES:
            print(f"  {scheme:16s} {agreement({r.layer: r.kl_mean for r in box[n][scheme]}, exact[scheme])}")
    kv_vs_exact(model, ids, ref, t_plain, passes, args)
    return 0


def agreement(est: dict[str, float], ex: dict[str, float]) -> str:
    """One line's figures: the estimate's Spearman rank correlation with the exact KL over the exact sweep's units,
    estimate / exact for the units above the median (median [min, max]), and whether the correlation meets
    TARGET_RHO."""
    keys = list(ex)
    rho = spearman([ex[k] for k in keys], [est[k] for k in keys])
    cut = statistics.median(ex.values())
    ratios = [est[k] / ex[k] for k in keys if ex[k] > cut and ex[k] > 0]
    span = (f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]" if ratios else "-")
    return f"{rho:8.3f}  {span}   {'ok' if rho >= TARGET_RHO else 'BELOW'}"


def kv_vs_exact(model: Any, ids: torch.Tensor, ref: Any, t_plain: float, passes: list[int], args: Any) -> None:
    """The KV cache formats: the estimate of every attention layer under KV_FORMATS against their exact KV sweeps
    (K/V maxima from the same tokens, untimed)."""
    amax = calibrate_kv_cache(model, {}, ids, batch_size=args.batch_size)
    box: dict[int, Any] = {}
    t_exact: dict[str, float] = {}
    exact: dict[str, dict[str, float]] = {}
    for fmt in KV_FORMATS:
        t_exact[fmt] = timed(lambda fmt=fmt: exact.setdefault(fmt, {r.layer: r.kl_mean for r in kv_sensitivity_sweep(
            model, fmt, ids, ref, amax=amax, batch_size=args.batch_size)}), args.device)
    total = sum(t_exact.values())
    print(f"KV cache, {len(next(iter(exact.values())))} attention layers x {', '.join(KV_FORMATS)}: exact sweeps "
          f"{total:.1f} s ({total / t_plain:.1f} plain forwards)")
    for n in passes:
        t = timed(lambda n=n: box.setdefault(n, fisher_sensitivity(
            model, [], ids, ref, kv_caches=KV_FORMATS, kv_amax=amax, samples=args.samples, passes=n,
            batch_size=args.batch_size)), args.device)
        print(f"  Fisher estimate, {n} backward pass(es): {t:.1f} s = {t / total:.3f} x exact = "
              f"{t / t_plain:.1f} plain forwards")
        for fmt in KV_FORMATS:
            print(f"  KV {fmt:13s} {agreement({r.layer: r.kl_mean for r in box[n]['KV ' + fmt]}, exact[fmt])}")
