"""`quantplan scores | schemes`: the stored scores of a model against their costs, and the preset schemes."""

from __future__ import annotations

import argparse
from typing import Any

from jobs.specs import SERVE_SIZE
from quantplan.cli.common import (
    CliError,
    check_target,
    checked_settings,
    find_model,
    print_json,
)
from quantplan.cli.options import SubParsers, add_ideal_options, add_json, add_model, add_step_m, bounded


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


def cmd_scores(args: argparse.Namespace) -> int:
    """The stored scores of a model on one evaluation set, with each plan's weight memory (and step times on
    a device that has kernel timings), marking the plans on the KL / cost front."""
    import math

    from quantplan.services import kernels as kernels_svc
    from quantplan.services import scoring as scoring_svc
    from quantplan.services import serving as serving_svc

    checked_settings()
    model = find_model(args.model)
    scores = scoring_svc.list_scores(model.id)
    if not scores:
        raise CliError(f"nothing scored on {model.name} yet: `quantplan score {model.name} --scheme FP8_DYNAMIC`")
    sets = scoring_svc.score_sets(scores)
    eval_set = sets[0]
    if args.text:
        eval_set = _score_set(sets, args.text, model.name)
    m_prefill = m_decode = None
    if args.timings:
        measured = kernels_svc.measured_ms(model, kernels_svc.kernel_records(args.timings))
        if not measured:
            known = sorted({d[1] for d in kernels_svc.kernel_devices()})
            raise CliError(f"no kernel timings of {model.name}'s shapes on {args.timings!r}; devices with "
                           f"timings: {', '.join(known) or 'none (run `quantplan bench`)'}")
        m_prefill, m_decode = args.m_prefill or max(measured), args.m_decode or min(measured)
        unmeasured = sorted({m for m in (m_prefill, m_decode) if m not in measured})
        if unmeasured:
            raise CliError(f"{args.timings} has no timings at M={', '.join(map(str, unmeasured))} for "
                           f"{model.name}'s shapes; measured M: {', '.join(map(str, measured))}")
    check_target(args.target)
    frame = scoring_svc.tradeoff_frame(model, [s for s in scores if (s.dataset, s.tokens) == eval_set],
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
    on_set = [s for s in scores if (s.dataset, s.tokens) == eval_set]
    for cost, *_ in costs:  # told apart within the KLs' errors, paired where two scores share their tokens
        frame[f"front_{cost}"] = scoring_svc.with_front(frame, cost, on_set)["front"]
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            for row in frame.to_dict("records")]
    by_job = {s.job_id: s for s in scores}
    for r in rows:  # what each score's job noticed, whether older numerics made it, what GPTQ / KV scales saw
        r["notes"] = scoring_svc.score_notes(model, by_job[r["job"]])
        r["calibration"] = by_job[r["job"]].details.get("calibration")
        sc = by_job[r["job"]]  # the percentiles and errors (quantcore.evaluation.statistics; None: not kept then)
        r.update({"kl_p50": sc.kl_p50, "kl_p90": sc.kl_p90, "kl_p99": sc.kl_p99, "kl_max": sc.kl_max,
                  "ppl_ref": sc.ppl_ref, **sc.statistics(), "kl_mean_err": sc.kl_mean_err})
    if args.json:
        print_json({"model": model.name, "text": eval_set[0], "positions": eval_set[1], "timings": args.timings,
                     "m_prefill": m_prefill, "m_decode": m_decode, "target": args.target,
                     "ideal_m_prefill": args.prompt, "ideal_m_decode": args.batch, "plans": rows})
        return 0
    print(f"{model.name}: {len(rows)} plan(s) scored on {eval_set[0]} ({eval_set[1]:,} positions), lowest KL first; "
          "* = on the front (no other plan has both a lower KL and a lower cost, and a dearer plan's KL is lower "
          "beyond its error); ± one standard error")
    if len(sets) > 1:
        print(f"  also scored on: {', '.join(repr(_set_label(t)) for t in sets if t != eval_set)} (--text)")
    width = max(len(r["plan"]) for r in rows)
    print(f"  {'plan':<{width}}  {'KL mean':>9}  {'± err':>8}  {'top-1':>6}"
          + "".join(f"  {h:>{w}}" for _, h, _, w in costs))

    def cell(row: dict[str, Any], cost: str, fmt: str, w: int) -> str:
        value = row[cost]
        text = "n/a" if value is None else format(value, fmt) + ("*" if row[f"front_{cost}"] else " ")
        return f"  {text:>{w}}"

    for r in rows:
        err = "—" if r["kl_mean_err"] is None else format(r["kl_mean_err"], ".2g")
        print(f"  {r['plan']:<{width}}  {r['kl_mean']:9.5f}  {err:>8}  {r['top1_agree']:6.3f}"
              + "".join(cell(r, c, f, w) for c, _, f, w in costs))
    for r in rows:
        if r["calibration"]:
            print(f"  calibrated on: #{r['job']} {r['plan']}: {r['calibration']}")
        for note in r["notes"]:
            print(f"  note: #{r['job']} {r['plan']}: {note}")
    if args.target:
        gpu = serving_svc.target_names()[args.target]
        print(f"  ideal: the roofline bound on {gpu} from its datasheet (weights read at "
              f"{serving_svc.target_bandwidth(args.target):g} TB/s or math at the native peak, whichever is longer)")
    if args.timings and any(r[c] is None for r in rows for c in ("prefill_ms", "decode_ms")):
        print(f"  n/a: a layer of the plan has no time at that M on {args.timings} (skipped over budget, not "
              "supported, or not measured); a partial sum is never shown. `quantplan bench` at those M (with a "
              "larger --budget, and the plan's paths if --paths left them out) fills it in.")
    return 0


def cmd_schemes(args: argparse.Namespace) -> int:
    """`quantplan schemes`: the preset schemes and the KV cache formats."""
    from quantcore.evaluation.kvcache import KV_FORMATS
    from quantcore.schemes.presets import get_scheme, list_schemes

    for name in list_schemes():
        print(f"{name:20s} {get_scheme(name).describe()}")
    print("\nKV cache formats (a plan's kv_cache, `score --kv-cache`):")
    for name, fmt in KV_FORMATS.items():
        print(f"{name:20s} {fmt.description}")
    return 0


def add_commands(sub: SubParsers) -> None:
    """scores MODEL, schemes."""
    sp = sub.add_parser("scores", help="stored scores with each plan's weight memory and step time; the KL / cost "
                        "front")
    add_model(sp, "registered model (name or id)")
    sp.add_argument("--text", help="evaluation text the scores were measured on (default: the one with most scores)")
    sp.add_argument("--timings", metavar="DEVICE", help="add prefill / decode step times from this device's "
                    "kernel timings (its name as the Kernels page and `quantplan bench` show it)")
    add_step_m(sp, "--m-prefill", "M of the prefill step (default: the largest measured)")
    add_step_m(sp, "--m-decode", "M of the decode step (default: the smallest measured)")
    add_ideal_options(sp, "the ideal (roofline) step times")
    sp.add_argument("--serve", nargs=2, type=bounded(SERVE_SIZE), metavar=("SEQUENCES", "CONTEXT"),
                    help="add the GPU memory of serving SEQUENCES sequences of CONTEXT tokens: every weight plus "
                         "their KV cache in the format each plan was scored with")
    add_json(sp, "machine-readable output")
    sp.set_defaults(func=cmd_scores)

    sp = sub.add_parser("schemes", help="list the preset schemes")
    sp.set_defaults(func=cmd_schemes)
