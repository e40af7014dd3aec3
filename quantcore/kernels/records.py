"""What a kernel benchmark measured (:class:`KernelRecord`), why a case has no time, and which stored records a new
benchmark may reuse instead of measuring again.

torch-free: the Streamlit app, the CLI and the worker read records without pulling torch in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar

from quantcore.kernels.paths import PATH_BASELINE, bench_paths

#: How a case's ``skipped`` reason begins; the app and the reuse policy (:func:`reusable_records`) tell the three
#: apart by these prefixes: the device cannot run the path (final), the case did not fit its time budget, or the
#: kernel raised.
SKIP_NOT_SUPPORTED = "not supported"
SKIP_OVER_BUDGET = "over budget"
SKIP_FAILED = "failed"

# How run_benchmarks times a case; records carry it (KernelRecord.timing) and a benchmark job reuses only stored
# records timed the same way. 1: caches flushed before every timed call on CPU as on CUDA (before: CUDA only).
TIMING = "cold-caches-1"

#: The quantiles a case's time is summed up by, as ``triton.testing.do_bench(quantiles=(0.5, 0.2, 0.8))`` reports
#: them: the median (``KernelRecord.ms``), then the 20th and 80th percentiles (``ms_p20``, ``ms_p80``).
QUANTILES = (0.5, 0.2, 0.8)
#: A case whose p20-p80 band is wider than this share of its median is flagged ``unstable``. A steady kernel on an
#: idle device stays well inside it (CUDA events: a few percent; a flushed CPU GEMM: about 10%), while the choices
#: a step estimate informs hinge on differences of 10-30% between paths (FP8 against INT8, a path against its
#: ``+q``): a band wider than a quarter of the median means the load moved while the case ran by more than the
#: differences it is read for, so it is measured again rather than used.
UNSTABLE_SPREAD = 0.25

DEFAULT_MS: tuple[int, ...] = (1, 16, 128, 2048)
DEFAULT_BUDGET_S = 60.0  # wall-clock seconds per (N, K) shape, all M and paths together


def relative_spread(ms: float | None, p20: float | None, p80: float | None) -> float | None:
    """(p80 - p20) / median; None where a figure is missing (a record from before quantplan kept the spread)."""
    if ms is None or p20 is None or p80 is None or not (math.isfinite(ms) and ms > 0):
        return None
    return (p80 - p20) / ms


def is_unstable(ms: float | None, p20: float | None, p80: float | None) -> bool:
    """Whether a time's p20-p80 band is wider than :data:`UNSTABLE_SPREAD` of its median (False without a spread)."""
    rel = relative_spread(ms, p20, p80)
    return rel is not None and rel > UNSTABLE_SPREAD


def parse_ms(text: str) -> list[int]:
    """The M values (batch x tokens) a person types, ``"1,16,128"``: sorted, each once, empty items passed over.
    ValueError says which item is not a positive integer, before any job is queued."""
    ms: set[int] = set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            value = int(item)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"M values are positive integers separated by commas (batch x tokens), e.g. "
                             f"1,16,128: {item!r} is not one")
        ms.add(value)
    if not ms:
        raise ValueError("no M value given: type positive integers separated by commas, e.g. 1,16,128")
    return sorted(ms)


def cases_per_shape(ms: Sequence[int] | None, paths: Iterable[str] | None) -> int:
    """The cases a benchmark asked for M values ``ms`` (None: :data:`DEFAULT_MS`) and ``paths`` times per (N, K)
    shape, all sharing its budget per shape: what a stored skip for time is weighed by (:func:`reusable_records`)."""
    return len(ms or DEFAULT_MS) * len(bench_paths(paths))


@dataclass
class KernelRecord:
    """One timed GEMM case: shape (M, N, K) x path on one device.

    device:       ``"cpu"`` or ``"cuda"``
    device_name:  CPU description or GPU name
    ms:           median time of one call in milliseconds (None when skipped)
    repeats:      how many timed calls ``ms`` is the median of (None: recorded before quantplan kept it)
    ms_p20/p80:   the 20th / 80th percentile of those calls (:data:`QUANTILES`, as triton's ``do_bench`` reports)
    baseline_ms (_p20, _p80): the baseline's median (and percentiles) at the same shape, timed interleaved with this
                  path (baseline, path, baseline, path, ...): what ``speedup`` is over; None for the baseline itself
    unstable:     the p20-p80 band of this path's calls, or of its interleaved baseline's, is wider than
                  :data:`UNSTABLE_SPREAD` of the median: a step estimate leaves the case out and a new benchmark
                  measures it again (None: recorded before quantplan kept the spread, not flagged)
    tflops:       2*M*N*K / time, on the logical (unpadded) shape, in TFLOP/s (TOPS for INT8)
    pct_peak:     tflops as a percentage of the device's dense peak for the path's dtype
                  (None: device not in the peak table, e.g. any CPU)
    speedup:      baseline_ms / ms, both medians of the same interleaved calls (records from before the
                  interleaving: the baseline record's ms / this ms); None without a baseline time
    native:       the path's low-precision math is hardware-accelerated on this device
    max_rel_err:  max |kernel - emulation| / max |emulation| on up to ERR_MAX_ROWS rows
    padded_m/k/n: the padded size where a kernel required padding, else None
    skipped:      why there is no time: ``"not supported on <device>: ..."``,
                  ``"over budget: ..."`` or ``"failed on <device>: ..."``; None when timed
    timing:       how it was timed (:data:`TIMING` for what :func:`run_benchmarks` measures now; None: before
                  quantplan recorded it, when a CPU's cache was not flushed between calls)
    """

    device: str
    device_name: str
    torch_version: str
    m: int
    n: int
    k: int
    path: str
    ms: float | None
    tflops: float | None
    pct_peak: float | None
    speedup: float | None
    native: bool
    max_rel_err: float | None
    padded_m: int | None
    skipped: str | None
    padded_k: int | None = None
    padded_n: int | None = None
    timing: str | None = None
    repeats: int | None = None
    ms_p20: float | None = None
    ms_p80: float | None = None
    baseline_ms: float | None = None
    baseline_ms_p20: float | None = None
    baseline_ms_p80: float | None = None
    unstable: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (JSON-friendly)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KernelRecord:
        """Inverse of :meth:`to_dict`; unknown keys (e.g. a database id) are ignored."""
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def seconds_text(s: float) -> str:
    """'0.042 s', '3.1 s', '120 s': a duration in a skip reason, never in exponent notation."""
    return f"{s:.2g} s" if s < 1 else f"{s:.1f} s" if s < 100 else f"{s:.0f} s"


def duration_bound(shapes: int, budget_s: float) -> str:
    """'at most 5 shapes × 60 s ≈ 5 min': the longest a benchmark of ``shapes`` (N, K) shapes times, each shape's M
    values and paths within ``budget_s`` (its last case may run over by one call), before loading and probing."""
    total = shapes * budget_s
    about = seconds_text(total) if total < 120 else f"{total / 60:.0f} min" if total < 7200 else f"{total / 3600:.1f} h"
    return f"at most {shapes} shape{'s' * (shapes != 1)} × {seconds_text(budget_s)} ≈ {about}"


def has_time(record: KernelRecord) -> bool:
    """Whether a record carries a usable time (not skipped; a NaN from a table counts as none)."""
    return record.ms is not None and math.isfinite(record.ms) and record.ms > 0


def case_times(records: Iterable[KernelRecord]) -> dict[tuple[int, int, int, str], float]:
    """``{(M, N, K, path): ms}`` of the records that carry a time (:func:`has_time`) that is not flagged ``unstable``
    (a time whose spread is wide is not used until measured again); a later record of a case wins."""
    return {(r.m, r.n, r.k, r.path): r.ms for r in records if r.ms is not None and has_time(r) and not r.unstable}


def unstable_cases(records: Iterable[KernelRecord]) -> dict[tuple[int, int, int, str], KernelRecord]:
    """``{(M, N, K, path): record}`` of the timed records flagged ``unstable``: what :func:`case_times` leaves out."""
    return {(r.m, r.n, r.k, r.path): r for r in records if has_time(r) and r.unstable}


def spread_text(record: KernelRecord) -> str:
    """'p20-p80 0.91-1.40 ms (43% of the median), 5 repeats': a record's spread for a person; '—' where the record
    has none (timed before quantplan kept it, or skipped)."""
    rel = relative_spread(record.ms, record.ms_p20, record.ms_p80)
    if rel is None or record.ms_p20 is None or record.ms_p80 is None:
        return "—"
    reps = f", {record.repeats} repeats" if record.repeats else ""
    return f"p20-p80 {record.ms_p20:.4g}-{record.ms_p80:.4g} ms ({100 * rel:.0f}% of the median){reps}"


def fill_speedups(records: list[KernelRecord]) -> None:
    """Each timed record's ``speedup``: 1 for the baseline; a path's ``baseline_ms / ms`` where the baseline was
    timed interleaved with it, else (a record from before the interleaving) the baseline record's time at the same
    shape over its own."""
    base = {
        (r.device_name, r.m, r.n, r.k): r.ms for r in records if r.path == PATH_BASELINE and has_time(r)
    }
    for r in records:
        if not has_time(r) or r.ms is None:  # has_time: a positive time
            continue
        if r.path == PATH_BASELINE:
            r.speedup = 1.0
            continue
        interleaved = r.baseline_ms is not None and math.isfinite(r.baseline_ms) and r.baseline_ms > 0
        b = r.baseline_ms if interleaved else base.get((r.device_name, r.m, r.n, r.k))
        if b is not None:
            r.speedup = b / r.ms


# --------------------------------------------------------------------------- reuse of stored records


class StoredRecord(Protocol):
    """What :func:`reusable_records` reads of a stored record (the store's kernel rows have it)."""

    @property
    def job_id(self) -> int: ...
    @property
    def m(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def k(self) -> int: ...
    @property
    def path(self) -> str: ...
    @property
    def skipped(self) -> str | None: ...
    @property
    def unstable(self) -> bool | None: ...


StoredT = TypeVar("StoredT", bound=StoredRecord)
#: ``{job id: (its params, its result)}`` of the asked job ids: where :func:`reusable_records` reads the budget
#: (``result["budget_s"]``), M values and paths (``params["m"]``, ``params["paths"]``) of the job that skipped a case.
JobRuns = Callable[[set[int]], Mapping[int, tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]]]


def reusable_records(stored: Iterable[StoredT], *, budget_s: float | None = None, cases: int | None = None,
                     job_runs: JobRuns | None = None) -> list[StoredT]:
    """Of ``stored`` (one device's records, newest job first), the newest per (M, N, K, path) that a new benchmark
    may reuse instead of measuring the case again.

    A record skipped "over budget" or "failed" is passed over (a new run measures it again), so an older time for
    the same case, or none, stands; "not supported" records count (a final answer). A case whose newest time is
    flagged ``unstable`` is not reused at all, an older time of it neither: it is measured again.
    budget_s: a case with no time that a job skipped "over budget" under a budget per shape of at least this many
    seconds (its result's ``budget_s``, read through ``job_runs``) counts too: measuring it again would only skip it
    again. cases (with budget_s): the M values × paths (the baseline's too) the asking job times per shape; a skip
    then counts only where its job's budget per case was no smaller (a job that times fewer paths or M values gives
    each case a larger share of the same budget, so it measures what a broader one skipped). ``job_runs`` is called
    at most once, with the ids of the jobs whose skips are weighed, and only when there are some.
    """
    newest: dict[tuple[int, int, int, str], StoredT] = {}
    over_budget: dict[tuple[int, int, int, str], StoredT] = {}
    remeasure: set[tuple[int, int, int, str]] = set()  # the newest time was unstable: nothing older stands for it
    for r in stored:  # newest first
        case = (r.m, r.n, r.k, r.path)
        if case in remeasure:
            continue
        if r.unstable and not r.skipped and case not in newest:
            remeasure.add(case)
            continue
        if r.skipped and not r.skipped.startswith(SKIP_NOT_SUPPORTED):
            if r.skipped.startswith(SKIP_OVER_BUDGET):
                over_budget.setdefault(case, r)
            continue
        newest.setdefault(case, r)
    untimed = {case: r for case, r in over_budget.items() if case not in newest}
    if budget_s is not None and untimed and job_runs is not None:

        def share(budget: float, params: Mapping[str, Any]) -> float:  # of one case, or of the shape when not asked
            return budget if cases is None else budget / cases_per_shape(params.get("m"), params.get("paths"))

        runs = job_runs({r.job_id for r in untimed.values()})
        under = {j: share(float((res or {}).get("budget_s") or 0.0), params or {}) for j, (params, res) in runs.items()}
        ours = budget_s if cases is None else budget_s / cases
        newest |= {case: r for case, r in untimed.items() if under.get(r.job_id, 0.0) >= ours}
    return list(newest.values())
