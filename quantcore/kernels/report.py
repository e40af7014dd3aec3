"""Kernel records as text: a fixed-width table for logs, a Markdown table for reports."""

from __future__ import annotations

from collections.abc import Iterable

from quantcore.kernels import records as kernel_records
from quantcore.kernels.paths import PATH_BASELINE, PATHS
from quantcore.kernels.records import KernelRecord, has_time, relative_spread


def unstable_note(r: KernelRecord) -> str:
    """'UNSTABLE: p20-p80 43% of the median (baseline 12%)' for a record flagged unstable, else ''."""
    if not r.unstable:
        return ""
    own = relative_spread(r.ms, r.ms_p20, r.ms_p80)
    base = relative_spread(r.baseline_ms, r.baseline_ms_p20, r.baseline_ms_p80)
    parts = [f"{100 * own:.0f}% of the median" if own is not None else "?"]
    if base is not None:
        parts.append(f"baseline's {100 * base:.0f}%")
    return (f"UNSTABLE: p20-p80 {', '.join(parts)} (over {100 * kernel_records.UNSTABLE_SPREAD:.0f}%): not used in "
            "a step estimate, measured again by the next benchmark")


def format_records(records: Iterable[KernelRecord]) -> str:
    """A fixed-width text table of records (for logs, the benchmark script and ``quantplan bench``): each time is
    the median of ``reps`` timed calls, with their 20th and 80th percentiles; a path's speed-up is over the
    baseline timed interleaved with it, whose median ``base ms`` gives; an unstable case says so in its note."""
    head = (
        f"{'M':>6} {'N':>6} {'K':>6} {'path':<13} {'ms':>10} {'p20':>10} {'p80':>10} {'reps':>4} "
        f"{'base ms':>10} {'TFLOP/s':>9} {'%peak':>6} {'speedup':>7} {'native':>6} {'max_rel_err':>11} {'pad':>8}  note"
    )
    lines = [head, "-" * len(head)]

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)


    for r in records:
        pad = []
        if r.padded_m:
            pad.append(f"M{r.padded_m}")
        if r.padded_k:
            pad.append(f"K{r.padded_k}")
        if r.padded_n:
            pad.append(f"N{r.padded_n}")
        lines.append(
            f"{r.m:>6} {r.n:>6} {r.k:>6} {r.path:<13} {f(r.ms, '.4f'):>10} {f(r.ms_p20, '.4f'):>10} "
            f"{f(r.ms_p80, '.4f'):>10} {f(r.repeats, 'd'):>4} {f(r.baseline_ms, '.4f'):>10} {f(r.tflops, '.4f'):>9} "
            f"{f(r.pct_peak, '.1f'):>6} {f(r.speedup, '.2f'):>7} {('yes' if r.native else 'no'):>6} "
            f"{f(r.max_rel_err, '.2e'):>11} {','.join(pad) or '-':>8}  {r.skipped or unstable_note(r)}"
        )
    return "\n".join(lines)


def unstable_summary(records: Iterable[KernelRecord]) -> str | None:
    """'2 of 10 timed case(s) UNSTABLE: ...' where any record is flagged unstable, else None: the line a command
    prints above its table."""
    timed = [r for r in records if has_time(r)]
    shaky = sum(bool(r.unstable) for r in timed)
    if not shaky:
        return None
    return (f"{shaky} of {len(timed)} timed case(s) UNSTABLE: their p20-p80 band is wider than "
            f"{100 * kernel_records.UNSTABLE_SPREAD:.0f}% of the median (the load moved while they ran); a step "
            "estimate leaves them out and the next benchmark measures them again")


def _fmt_ratio(x: float) -> str:
    """Two decimals, or two significant digits below 0.1 (a CPU's FP8 path can be 0.0021×)."""
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def format_markdown(records: Iterable[KernelRecord]) -> str:
    """Speed-ups as a Markdown table (one row per shape and M), for the README and reports.

    Each path cell reads ``1.52× · 41%``: speed-up over the baseline at that shape, then
    percent of the device's dense peak for the path's dtype (left out where the device is
    not in the peak table); ``skip`` where the case has no time; `` (unstable)`` after a cell whose case is flagged
    unstable. The baseline column gives
    its own time and percent of peak. A last line gives the largest kernel-vs-emulation
    difference per path. Records from more than one device raise ValueError.
    """
    recs = list(records)
    if not recs:
        return "(no records)"
    names = sorted({r.device_name for r in recs})
    if len(names) > 1:
        raise ValueError(f"records come from several devices ({', '.join(names)}); one table per device")
    paths = [p for p in PATHS if any(r.path == p for r in recs)]
    by_case = {(r.n, r.k, r.m, r.path): r for r in recs}
    rows = sorted({(r.n, r.k, r.m) for r in recs}, key=lambda t: (t[1], t[0], t[2]))

    def pct(r: KernelRecord) -> str:
        return "" if r.pct_peak is None else f" · {r.pct_peak:.0f}%"

    def cell(r: KernelRecord | None) -> str:
        if r is None:
            return ""
        if not has_time(r):
            return "skip"
        flag = " (unstable)" if r.unstable else ""
        if r.path == PATH_BASELINE:
            return f"{r.ms:.4f} ms{pct(r)}{flag}"
        return ("-" if r.speedup is None else f"{_fmt_ratio(r.speedup)}×") + pct(r) + flag

    head = ["N × K", "M"] + [p if p != PATH_BASELINE else "baseline ms" for p in paths]
    lines = [
        f"{names[0]} · torch {recs[0].torch_version}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|",
    ]
    for n, k, m in rows:
        cells = [f"{n} × {k}", str(m)] + [cell(by_case.get((n, k, m, p))) for p in paths]
        lines.append("| " + " | ".join(cells) + " |")
    errs = []
    for p in paths:
        vals = [r.max_rel_err for r in recs if r.path == p and r.max_rel_err is not None]
        if vals:
            errs.append(f"{p} {max(vals):.1e}")
    if errs:
        lines += ["", "max kernel-vs-emulation difference: " + ", ".join(errs)]
    return "\n".join(lines)
