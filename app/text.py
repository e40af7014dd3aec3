"""Text the pages show beside their tables and charts, built from what the application layer returns."""

from __future__ import annotations

import datetime as dt
from typing import Any

from quantcore.kernels.records import SKIP_OVER_BUDGET
from quantplan.services.jobs import duration_text, progress_cell  # noqa: F401  (the pages read them here)
from store.records import ModelRecord

# every time a page shows is said one way: relative ("12 min ago"), the absolute UTC time (UTC_FORMAT) on hover or
# in the row's details
UTC_FORMAT = "%Y-%m-%d %H:%M:%S UTC"
AGO_HELP = "how long ago, from now; the exact UTC time is in the row's details (select the row)"


def _utc(ts: dt.datetime) -> dt.datetime:
    """A stored time as an aware UTC time (SQLite returns naive UTC ones)."""
    return ts.replace(tzinfo=dt.UTC) if ts.tzinfo is None else ts.astimezone(dt.UTC)


def utc_text(ts: dt.datetime | None) -> str:
    """"2026-12-05 16:22:03 UTC"; "" for none."""
    return "" if ts is None else _utc(ts).strftime(UTC_FORMAT)


def ago(ts: dt.datetime | None, now: dt.datetime | None = None) -> str:
    """"just now" / "40 s ago" / "12 min ago" / "3 h ago" / "5 d ago" / "2026-10-01" past 30 days; "" for none."""
    if ts is None:
        return ""
    s = ((now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC) - _utc(ts)).total_seconds()
    if s < 5:
        return "just now"
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 90 * 60:
        return f"{s / 60:.0f} min ago"
    if s < 36 * 3600:
        return f"{s / 3600:.0f} h ago"
    if s < 30 * 86400:
        return f"{s / 86400:.0f} d ago"
    return _utc(ts).strftime("%Y-%m-%d")


def ago_html(ts: dt.datetime | None, now: dt.datetime | None = None) -> str:
    """:func:`ago` with the absolute UTC time on hover (a ``title``), for st.markdown(unsafe_allow_html=True)."""
    return f'<span title="{utc_text(ts)}">{ago(ts, now)}</span>' if ts is not None else ""




def thin_estimate_note(est: dict[str, Any]) -> str | None:
    """A warning when a step estimate rests on fewer than half the plan's layers (for the step missing most), yet on
    some: its sums and speed-ups are then those few layers', not the plan's. None otherwise (none measured: the
    metrics say "not measured" themselves)."""
    n = len(est["per_layer"])
    worst = max(len(est["missing_prefill"]), len(est["missing_decode"]))
    if not n or worst == n or 2 * worst <= n:
        return None
    return (f"Only {n - worst} of this plan's {n} layers have a time for their path at these M values: the step "
            "times and speed-ups above are of those layers alone, not of the plan. Benchmark the paths it uses "
            "(named below) before reading them as the plan's.")


def missing_times_note(est: dict[str, Any], plan_tp: int = 1) -> str:
    """What a step estimate leaves out (layers with no time for their path at its M values), named, and what to do
    about each: a case skipped over the time budget wants a larger budget, not the same benchmark again; a path the
    device does not run, or that failed at that shape, says why; a case never measured wants a benchmark."""
    from quantcore.errors import name_list

    missing = list(dict.fromkeys([*est["missing_prefill"], *est["missing_decode"]]))
    why = {**est.get("skipped_prefill", {}), **est.get("skipped_decode", {})}
    over = [n for n in missing if why.get(n, "").startswith(SKIP_OVER_BUDGET)]
    cannot = [n for n in missing if n in why and n not in over]
    # timed, but with a p20-p80 band too wide to add up (quantcore.kernels.records.UNSTABLE_SPREAD)
    shaky_set = {*est.get("unstable_prefill", []), *est.get("unstable_decode", [])}
    shaky = [n for n in missing if n in shaky_set and n not in why]
    unmeasured = [n for n in missing if n not in why and n not in shaky_set]
    gpus = f" on {plan_tp} GPUs" if plan_tp > 1 else ""
    parts = []
    if over:
        parts.append(f"{name_list(over, 3)} skipped over the time budget per shape: queue the benchmark again with a "
                     "larger budget to time them")
    if cannot:
        reasons = list(dict.fromkeys(why[n] for n in cannot))
        parts.append(f"{name_list(cannot, 3)} with no time on this device ({'; '.join(reasons[:2])}"
                     + (f"; and {len(reasons) - 2} more reasons" if len(reasons) > 2 else "") + ")")
    if shaky:
        parts.append(f"{name_list(shaky, 3)} left out as unstable (their timed calls spread too widely): queue the "
                     "benchmark again to measure them")
    if unmeasured:  # the M values were asked for other paths, or never: name both
        paths = list(dict.fromkeys(est["per_layer"][n]["path"] for n in unmeasured if n in est["per_layer"]))
        parts.append(f"{name_list(unmeasured, 3)} not measured: queue a benchmark with these M values{gpus}"
                     + (f" and path{'s' if len(paths) > 1 else ''} {', '.join(paths)}" if paths else ""))
    counts = " and ".join(f"{len(est[f'missing_{step}'])} of the {step}'s (M={est.get(f'm_{step}', '?')})"
                          for step in ("prefill", "decode") if est[f"missing_{step}"])
    return (f"Layers with no time for their path: {counts}; the sums and speed-ups above leave them out: "
            + "; ".join(parts) + ".")


FUSION_REASON = ("q/k/v (and gate/up) of a block read the same input and are fused into one GEMM when "
                 "served, so they share one weight format and one activation scale: a scheme set on one "
                 "of them is set on the whole group. The routed experts of an MoE block are one fused MoE "
                 "layer when served, with one quantization method, so they too share one scheme, unless the plan "
                 "takes experts one by one (per_expert: for targets other than vLLM).")


def preset_options(model: ModelRecord) -> dict[str, str]:
    """{preset: "PRESET: what it does"} of every preset scheme, as the Results page offers them."""
    from quantcore.schemes.presets import get_scheme, list_schemes

    return {name: f"{name}: {get_scheme(name).describe()}" for name in list_schemes()}


# the Models and Results pages' "Run the model" choice: a job's ``stream`` (jobs.specs)
STREAM_CHOICES: dict[str, bool | None] = {"as the worker's memory allows": None, "block by block (streamed)": True,
                                          "whole model": False}
STREAM_HELP = ("Streamed: one decoder block at a time, read from the stored safetensors, for a model larger than the "
               "worker's memory (QUANTPLAN_MODEL_MEMORY_GIB, else its free memory); the same results as whole. By "
               "default a model whose weights fit runs whole, a larger one streamed.")
