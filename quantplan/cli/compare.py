"""`quantplan compare JOB JOB [...]`: runs side by side (parameters, metrics, paired differences, per-layer views,
outlier drift between two calibrations), as text or ``--json``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from quantplan.cli.common import checked_settings, print_json
from quantplan.cli.options import SubParsers

DRIFT_ROWS = 20  # layers a text report lists per drift (every one with --json)


def _cell(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return format(v, ".4g")
    return str(v)


def _table(rows: Sequence[dict[str, Any]], first: str, keys: Sequence[str], *,
           only_differing: bool = False) -> list[str]:
    shown = [r for r in rows if not only_differing or r.get("differs")]
    width = max([len(first)] + [len(str(r[first])) for r in shown])
    cols = [max([len(k)] + [len(_cell(r.get(k))) for r in shown]) for k in keys]
    out = ["  " + first.ljust(width) + "  " + "  ".join(k.ljust(w) for k, w in zip(keys, cols, strict=True))]
    for r in shown:
        mark = "*" if r.get("differs") else " "
        out.append(mark + " " + str(r[first]).ljust(width) + "  "
                   + "  ".join(_cell(r.get(k)).ljust(w) for k, w in zip(keys, cols, strict=True)))
    return out


def cmd_compare(args: argparse.Namespace) -> int:
    """Compare the runs named; refused with the reason for fewer than two, unknown ids, a baseline not among them."""
    from quantplan.services import compare

    checked_settings()
    ids = compare.parse_job_ids(args.jobs)
    c = compare.compare_runs(ids, baseline=args.baseline, plan_id=args.plan)
    if args.json:
        print_json(c.to_json())
        return 0
    keys = c.keys
    lines = [f"{r.key}: {r.label} ({r.job.status})" for r in c.runs]
    lines += ["", f"== Parameters ({'every row' if args.all else 'rows that differ'}; * differs) =="]
    lines += _table(c.parameters, "parameter", keys, only_differing=not args.all)
    lines += ["", "== Metrics =="] + _table(c.metrics, "metric", keys)
    if c.differences:
        lines += ["", f"== Differences against {c.differences[0]['b']} (± one standard error) =="]
        for d in c.differences:
            if d["difference"] is None:
                lines.append(f"{d['a']} {d['figure']}: {d['why']}")
                continue
            err = "—" if d["err"] is None else format(d["err"], ".2g")
            unpaired = "" if not d["paired"] or d["err_unpaired"] is None else \
                f" (unpaired it would be ± {d['err_unpaired']:.2g})"
            lines.append(f"{d['a']} − {d['b']} {d['figure']}: {d['difference']:.4g} ± {err}{unpaired}; {d['why']}")
            lines.append(f"    {d['verdict']}")
    for title, rows, first in (("Per-layer schemes", c.schemes, "layer"), ("Per-unit KL of the sweeps",
                                                                           c.sensitivity, "unit"),
                               ("Per-layer outlier ratio", c.outliers, "layer")):
        if rows:
            lines += ["", f"== {title} (* differs) =="] + _table(rows, first, [k for k in keys if k in rows[0]])
    for r in c.rank_correlation:
        lines.append(f"rank correlation of {r['a']} with {r['b']} over {r['units']} units: {r['spearman']:.3f}")
    for rep in c.drift:
        lines += ["", f"== Outlier drift {rep.a} → {rep.b} ==", rep.summary]
        moved = [r for r in rep.layers if r["verdict"] != "steady"]
        for r in moved[:DRIFT_ROWS]:
            lines.append(f"  {r['layer']}: {r['verdict']}; ratio {r['ratio_a']:.3g} → {r['ratio_b']:.3g}; "
                         f"appeared {r['appeared']}, gone {r['gone']}, grew {[g[0] for g in r['grew']]}, "
                         f"shrank {[s[0] for s in r['shrank']]}")
        if len(moved) > DRIFT_ROWS:
            lines.append(f"  … {len(moved) - DRIFT_ROWS} more (--json lists every layer)")
        lines.append(f"  calibrated on {rep.a}, {rep.plan}, served on {rep.b}:")
        bad = [t for t in rep.transfer if t["verdict"] != "fits"]
        for t in bad[:DRIFT_ROWS]:
            share = "" if t["clipped_share"] is None else f", {100 * t['clipped_share']:.2f} % of values clipped"
            lines.append(f"  {t['layer']}: {t['verdict']} ({t['wasted_bits']:.2g} bit(s) of range wasted{share}; "
                         f"under-smoothed {t['under_smoothed']}, clipped channels {t['clipped_channels']})")
        if not bad:
            lines.append("  every layer fits")
    for part, said in c.notes.items():
        for note in said:
            lines.append(f"note ({part}): {note}")
    print("\n".join(lines))
    return 0


def add_commands(sub: SubParsers) -> None:
    """compare."""
    sp = sub.add_parser("compare", help="compare two or more runs (jobs) side by side: parameters, metrics, paired "
                                        "differences, per-layer views, outlier drift between two calibrations")
    sp.add_argument("jobs", nargs="+", help="job ids (two or more; '12 15' or '12,15')")
    sp.add_argument("--baseline", type=int, help="the job the others are measured against (default: the first)")
    sp.add_argument("--plan", help="the plan (id or 'name vN') whose SmoothQuant factors and static scales the drift "
                                   "check reads, a plan of the base calibration's model (default: SmoothQuant "
                                   "α 0.5 and static scales on every layer)")
    sp.add_argument("--all", action="store_true", help="list every parameter, not only those that differ")
    sp.add_argument("--json", action="store_true", help="print the whole comparison as JSON")
    sp.set_defaults(func=cmd_compare)
