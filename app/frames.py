"""Display frames of the pages: pandas DataFrames built from what the application layer returns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from quantcore.kernels.records import SKIP_FAILED, SKIP_OVER_BUDGET
from quantplan.services.errors import Refused
from quantplan.services.plans import resolve
from quantplan.services.units import MIB
from store.records import ModelRecord, PlanRecord, ScoreRecord

if TYPE_CHECKING:
    import pandas as pd

    from quantcore.planning.footprint import Footprint


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
