"""Display frames of the pages: pandas DataFrames built from what the application layer returns."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from quantcore.kernels.records import SKIP_FAILED, SKIP_OVER_BUDGET
from quantplan.services.errors import Refused
from quantplan.services.plans import resolve
from quantplan.services.units import MIB
from store.records import JobRecord, ModelRecord, PlanRecord, ScoreRecord

if TYPE_CHECKING:
    import pandas as pd

    from quantcore.planning.footprint import Footprint


# the columns a table shows first, visible at 1400 px; the rest of each row is in its details view (on selection)
JOB_KEY_COLUMNS = ["id", "kind", "model", "status", "progress", "asked by", "device", "age"]
SCORE_KEY_COLUMNS = ["plan", "KL ± error", "top-1", "when", "asked by", "device"]


def jobs_frame(jobs: list[JobRecord], whats: dict[int, str], models: dict[int, str],
               now: dt.datetime | None = None) -> pd.DataFrame:
    """One row per job: the key columns (JOB_KEY_COLUMNS: progress as its final state once ended, the age
    relative) then what the details view shows (what, message, queue, worker, the times in UTC)."""
    import pandas as pd

    from app.text import ago, progress_cell, utc_text

    return pd.DataFrame([{
        "id": j.id, "kind": j.kind, "model": models[j.id], "status": j.status, "progress": progress_cell(j, now),
        "asked by": j.requested_by or "", "device": j.device or f"({j.queue} queue)", "age": ago(j.created_at, now),
        "what": whats[j.id], "ran (s)": j.run_seconds(now),
        # a failed job's message is "failed", which its status says: its error's first line says why
        "message": j.error.splitlines()[0] if j.status == "failed" and j.error else j.message,
        "queue": j.queue, "worker": j.worker_host, "created": utc_text(j.created_at),
        "finished": utc_text(j.finished_at)} for j in jobs],
        columns=[*JOB_KEY_COLUMNS, "what", "ran (s)", "message", "queue", "worker", "created", "finished"])


def capability_frame(paths: list[dict[str, Any]]) -> pd.DataFrame:
    """A stored capability table (PathSupport dicts) as rows for a person: path, verdict, why."""
    import pandas as pd

    from quantcore.kernels.device import PathSupport

    rows = [PathSupport(**p) for p in paths]
    return pd.DataFrame([{"path": r.path, "here": r.status, "why": r.why} for r in rows],
                        columns=["path", "here", "why"])


def timed_otherwise(frame: pd.DataFrame) -> int:
    """How many timings of a :func:`kernel_frame` were taken otherwise than quantplan times now
    (quantcore.kernels.records.TIMING: before a CPU's caches were flushed between calls); a benchmark measures them
    again."""
    from quantcore.kernels.records import TIMING

    return int((frame["timing"] != TIMING).sum()) if "timing" in frame else 0


def step_breakdown(est: dict[str, Any]) -> pd.DataFrame:
    """A step estimate's layers summed per projection type and kernel path (one row each).

    Columns: projection, path, layers, prefill_ms, decode_ms (None where a layer of the row lacks a
    time at that M, so a partial sum is never shown as a total).
    """
    import pandas as pd

    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for name, entry in est["per_layer"].items():
        key = (name.rsplit(".", 1)[-1], entry["path"])
        row = rows.setdefault(key, {"projection": key[0], "path": key[1], "layers": 0,
                                    "prefill_ms": 0.0, "decode_ms": 0.0})
        row["layers"] += 1
        for step in ("prefill_ms", "decode_ms"):
            row[step] = None if row[step] is None or entry[step] is None else row[step] + entry[step]
    return pd.DataFrame(list(rows.values()), columns=["projection", "path", "layers", "prefill_ms", "decode_ms"])


def score_frames(scores: list[ScoreRecord]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(KL histogram frame [label, center, share], KL-by-position frame [position, kl, label]) of scores."""
    import numpy as np
    import pandas as pd

    hist_parts, pos_parts = [], []
    occupied = []  # (first, last) bin holding tokens, per score: the x axis spans these, not every stored bin
    for sc in scores:
        label = f"#{sc.job_id} {sc.plan_label}"
        h = sc.details.get("kl_hist") or {}
        edges, counts = np.asarray(h.get("edges", []), float), np.asarray(h.get("counts", []), float)
        if len(edges) == len(counts) + 1 and counts.sum() > 0:
            lo = np.maximum(edges[:-1], 1e-6)
            hi = np.maximum(edges[1:], lo * 1.0001)
            hist_parts.append(pd.DataFrame({"label": label, "center": np.sqrt(lo * hi),
                                            "share": counts / counts.sum(), "bin": np.arange(len(counts))}))
            held = np.flatnonzero(counts)
            occupied.append((held[0], held[-1]))
        for b in sc.details.get("kl_by_position") or []:
            pos_parts.append({"position": (b["bucket_start"] + b["bucket_end"]) / 2, "kl": b["kl_mean"],
                              "label": label})
    hist = pd.DataFrame()
    if hist_parts:  # one bin kept each side of the occupied span (where there is one), so the lines drop to 0
        first, last = min(a for a, _ in occupied) - 1, max(b for _, b in occupied) + 1
        hist = pd.concat(hist_parts, ignore_index=True)
        hist = hist[hist["bin"].between(first, last)].drop(columns="bin").reset_index(drop=True)
    return hist, pd.DataFrame(pos_parts)


def no_time_notes(ms: Iterable[float | None], skipped: Iterable[str | None]) -> list[str]:
    """What a heatmap cell with no time reads instead of "n/a" (which says the device does not run the path):
    "skipped" where the case did not fit the time budget per shape, "failed" where the kernel refused the shape or
    the torch build (quantcore.kernels.records' ``skipped`` reasons); "" elsewhere."""
    import pandas as pd

    notes = []
    for t, why in zip(ms, skipped, strict=True):
        why = "" if pd.isna(why) else str(why)  # None and NaN alike
        notes.append("" if not pd.isna(t) else "skipped" if why.startswith(SKIP_OVER_BUDGET) else
                     "failed" if why.startswith(SKIP_FAILED) else "")
    return notes


def footprint_frame(fp: Footprint) -> pd.DataFrame:
    """One row per scheme of a Footprint: layers, weights, MiB, bits per weight, share of the plan's bytes."""
    import pandas as pd

    return pd.DataFrame([{"scheme": r.scheme, "layers": r.layers, "weights (M)": r.params / 1e6,
                          "MiB": r.bits / 8 / MIB, "bits / weight": r.bits_per_weight,
                          "share": r.bits / fp.bits if fp.bits else 0.0} for r in fp.rows])


def plan_diff(model: ModelRecord, a: PlanRecord, b: PlanRecord) -> pd.DataFrame:
    """The layers whose scheme differs between two plan versions: layer, then each version's scheme; Refused with
    the problem of a version that does not resolve on the model."""
    import pandas as pd

    from quantcore.planning.plans import diff_plans

    ra, err_a = resolve(model, a.body)
    rb, err_b = resolve(model, b.body)
    if err_a or err_b:
        raise Refused(err_a or err_b)
    return pd.DataFrame(diff_plans(ra, rb), columns=["layer", a.label, b.label])


SCHEME_FAMILIES = ("FP8", "INT8", "FP4", "weight-only", "keep")


def scheme_family(name: str) -> str:
    """The family a preset is listed under in the rules editor: keep (BF16), weight-only (16-bit activations), else
    by its activations' format: FP8 (E4M3, E5M2, MXFP8; W4AFP8's int4 weights run FP8 math), INT8, FP4."""
    from quantcore.schemes.presets import get_scheme

    s = get_scheme(name)
    if s.weights is None:
        return "keep"
    if s.activations is None:
        return "weight-only"
    fmt = s.activations.format
    return "INT8" if fmt.startswith("int8") else "FP4" if "fp4" in fmt else "FP8"


def scheme_catalog() -> pd.DataFrame:
    """Every preset with what a newcomer choosing one needs, grouped by family (SCHEME_FAMILIES order): its one-line
    description (the Results page's "What each preset does"), weight and activation formats, granularity, storage
    bits per weight (elements plus scales, on a 4096 × 4096 layer) and the GPUs that run it natively."""
    import pandas as pd

    from quantcore.kernels.hardware import list_targets, support_on_target
    from quantcore.schemes.presets import get_scheme, list_schemes
    from quantcore.schemes.storage import weight_storage_bits

    rows = []
    for name in list_schemes():
        s = get_scheme(name)
        w, a = s.weights, s.activations
        native = [t.key for t in list_targets()
                  if support_on_target(t.key, w.format if w else None, a.format if a else None) == "native"]
        rows.append({"family": scheme_family(name), "scheme": name, "description": s.description,
                     "weights": w.format if w else "bf16", "activations": a.format if a else "16-bit",
                     "granularity": "; ".join(
                         x for x in (f"W {w.describe(show_static=False).split(' ', 1)[1]}" if w else "",
                                     f"A {a.describe().split(' ', 1)[1]}" if a else "") if x),
                     "storage bits": weight_storage_bits(s, 4096, 4096) / 4096**2,
                     "native on": ", ".join(native) or "none (emulated)"})
    frame = pd.DataFrame(rows)
    frame["order"] = frame["family"].map(SCHEME_FAMILIES.index)
    return frame.sort_values(["order", "scheme"], kind="stable").drop(columns="order").reset_index(drop=True)


def layer_patterns(names: list[str]) -> dict[str, int]:
    """The layer-name patterns a rule is most often written with, each with how many of ``names`` it matches
    (``re.search``, as a plan's rules): every projection's name (``down_proj``), the first and last decoder layer
    (``layers.0.``), ``lm_head`` where there is one; most matched first."""
    import re

    tails = sorted({n.rsplit(".", 1)[-1] for n in names})
    blocks = sorted({int(m.group(1)) for n in names if (m := re.search(r"layers\.(\d+)\.", n))})
    found = [*tails, *([rf"layers\.{blocks[0]}\.", rf"layers\.{blocks[-1]}\."] if blocks else [])]
    counts = {p: pattern_matches(p, names) for p in dict.fromkeys(found)}
    return dict(sorted(((p, c) for p, c in counts.items() if isinstance(c, int) and c),
                       key=lambda pc: (-pc[1], pc[0])))


def pattern_matches(pattern: str, names: list[str]) -> int | str:
    """How many of ``names`` the rule pattern matches (``re.search``), or why it is no regular expression."""
    import re

    try:
        rx = re.compile(pattern)
    except re.error as exc:
        return f"not a regular expression: {exc}"
    return sum(1 for n in names if rx.search(n))


def rules_readback(rows: list[dict[str, Any]], names: list[str]) -> pd.DataFrame:
    """The rules editor's rows as the plan reads them: row, match, scheme, layers matched, and its state in words
    ("incomplete: add a scheme" rather than a warning while the row is being typed)."""
    import pandas as pd

    def filled(cell: Any) -> bool:
        return cell is not None and not pd.isna(cell) and str(cell).strip() != ""

    out = []
    for i, r in enumerate(rows, start=1):
        match, scheme = r.get("match"), r.get("scheme")
        count = pattern_matches(str(match), names) if filled(match) else None
        state = ("incomplete: add a match and a scheme" if not filled(match) and not filled(scheme) else
                 "incomplete: add a scheme" if not filled(scheme) else
                 "incomplete: add a match" if not filled(match) else
                 count if isinstance(count, str) else
                 "matches no layer" if count == 0 else "in the plan")
        out.append({"row": i, "match": str(match) if filled(match) else "", "scheme": str(scheme) if filled(scheme)
                    else "", "layers": count if isinstance(count, int) else None, "state": state})
    return pd.DataFrame(out, columns=["row", "match", "scheme", "layers", "state"])
