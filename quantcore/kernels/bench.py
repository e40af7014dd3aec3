"""Real low-precision GEMM benchmarks on a model's own linear shapes, checked against emulation.

Each path of :mod:`quantcore.kernels.paths` is timed on the device on every (M, N, K) and compared with an emulation
of the very same quantized operands (:mod:`quantcore.kernels.ops`), so a large ``max_rel_err`` means a kernel bug,
never quantization error.

Timing: on CUDA, CUDA events around each call, warm-up first, the L2 cache flushed
before every timed call; on CPU, ``time.perf_counter``, the last-level cache flushed the same way
(a decode GEMM's weights come from memory when served, and a CPU's 32 MB L3 holds a 4096 x 4096
INT8 weight but not its fp32 one: on a 2-thread EPYC, INT8 timed warm was 20x faster than fp32
at M = 1 x 4096 x 4096, flushed 7x).
Each record keeps its repeats, median, 20th and 80th percentiles (as ``triton.testing.do_bench(quantiles=(0.5, 0.2,
0.8))``), and is flagged ``unstable`` where the p20-p80 band is wide against the median
(quantcore.kernels.records.UNSTABLE_SPREAD). A path's calls alternate with the baseline's at the same shape
(baseline, path, baseline, path, ...), and its speed-up is the ratio of those two medians: a change of load while
the case runs slows both alike instead of one of them.
Each (N, K) shape has a wall-clock budget; a case predicted (from the rates already
measured) not to fit in what is left is not run and comes back with
``skipped="over budget: ..."``. A path the device cannot run comes back with
``skipped="not supported on <device>: ..."`` and ``native=False``, never a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from quantcore.errors import Cancelled
from quantcore.kernels.device import device_paths, probe_device, torch_error_text
from quantcore.kernels.ops import ShapeOperands, build_case, err_rows, max_rel_err
from quantcore.kernels.paths import PATH_BASELINE, PATHS, PEAK_KEY, base_path, bench_paths, kernel_padding
from quantcore.kernels.records import (
    DEFAULT_BUDGET_S,
    DEFAULT_MS,
    SKIP_FAILED,
    SKIP_NOT_SUPPORTED,
    SKIP_OVER_BUDGET,
    TIMING,
    KernelRecord,
    fill_speedups,
    seconds_text,
)
from quantcore.kernels.timing import Spread, Timer

if TYPE_CHECKING:
    import torch

    from quantcore.kernels.device import DeviceInfo

DEFAULT_REPEATS = {"cpu": 5, "cuda": 50}
DEFAULT_WARMUP = {"cpu": 1, "cuda": 10}
MIN_REPEATS = 3  # fewer timed calls than this and the median means little: skip instead
_PROBE_ROWS = 16  # rows of the cheap call that estimates a path's rate before its first case
_PROBE_STEP = 4  # a case's cost is predicted from a rate measured at no less than 1/4 of its M


def _resolve_device(device: str) -> tuple[str, str]:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        index = (
            dev.index
            if dev.index is not None
            else (torch.cuda.current_device() if torch.cuda.is_available() else 0)
        )
        return f"cuda:{index}", "cuda"
    if dev.type == "cpu":
        return "cpu", "cpu"
    raise ValueError(f"unsupported device {device!r}; use 'cpu' or 'cuda[:index]'")


def run_benchmarks(
    shapes: Iterable[tuple[int, int]],
    ms: Sequence[int] = DEFAULT_MS,
    *,
    device: str = "cpu",
    paths: Sequence[str] | None = None,
    budget_s_per_shape: float = DEFAULT_BUDGET_S,
    repeats: int | None = None,
    warmup: int | None = None,
    seed: int = 0,
    progress: Callable[[float, str], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> list[KernelRecord]:
    """Time every path on every (M, N, K) with (N, K) from ``shapes`` and M from ``ms``.

    The baseline is always timed (speed-ups need it), whatever ``paths`` says. Cases run
    shape by shape; within a shape's budget the baselines of every M come first, then the
    paths the device runs natively, then the emulated ones, each M ascending: a budget
    cuts the emulated paths and the largest M first. A case runs only when its predicted cost fits its share:
    its FLOPs over the path's rate, measured at no less than a quarter of its M (single calls at growing M
    learn it, so a small M's fixed cost per call is never scaled up to a large one). A first pass gives each case
    but the baselines an even share of what is left (time a case leaves unused goes to those after it; a
    baseline may take all that is left, as every speed-up needs one); a case that needs more is
    put off to a second pass, which gives the cases put off, in the same order, all that is left: one slow case
    (weight-only INT8 at a prefill M, a quarter of a second a call) cannot starve every case after it. Records
    come back in (shape, M, path) order whatever order they ran in.
    Repeats and warm-up default to 50 / 10 on CUDA and 5 / 1 on CPU; fewer repeats are
    run when the budget is tight, never fewer than MIN_REPEATS (the case is skipped), and warm-up calls
    beyond the first stop once they would fill a quarter of the case's share. A path's timed calls alternate with
    the baseline's at its M (b, p, b, p, ...; both within the case's share); its record keeps both medians and
    percentiles, the speed-up is their ratio, and ``unstable`` flags a wide p20-p80 band of either.

    Returns one record per (shape, M, path), timed or skipped with a reason. Raises
    quantcore.errors.Cancelled when ``should_cancel()`` turns True (checked between cases),
    quantcore.errors.UnsupportedOnDevice when ``device`` is CUDA and there is none.
    """
    import torch

    want = bench_paths(paths)
    m_list = sorted({int(m) for m in ms})
    if not m_list or m_list[0] <= 0:
        raise ValueError(f"M values must be positive integers, got {list(ms)!r}")
    shape_list: list[tuple[int, int]] = []
    for n, k in shapes:
        n, k = int(n), int(k)
        if n <= 0 or k <= 0:
            raise ValueError(f"shape (N={n}, K={k}) must be positive")
        if (n, k) not in shape_list:
            shape_list.append((n, k))
    if budget_s_per_shape <= 0:
        raise ValueError("budget_s_per_shape must be > 0 seconds")

    dev, kind = _resolve_device(device)
    info: DeviceInfo = probe_device(dev)  # raises UnsupportedOnDevice without CUDA
    support = device_paths(info)
    n_rep = int(repeats if repeats is not None else DEFAULT_REPEATS[kind])
    n_warm = int(warmup if warmup is not None else DEFAULT_WARMUP[kind])
    if n_rep < 1 or n_warm < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    min_rep = min(MIN_REPEATS, n_rep)
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    peaks = info.peak_tflops or {}
    peak_key = dict(PEAK_KEY)
    if kind == "cpu":
        peak_key[PATH_BASELINE] = "fp32"

    total = len(shape_list) * len(m_list) * len(want)
    done = 0
    records: list[KernelRecord] = []
    rates: dict[str, tuple[int, float]] = {}  # path -> (M, FLOP/s measured at that M), to predict case costs
    timer = Timer(dev, kind)

    def learn_rate(ops: ShapeOperands, x: torch.Tensor, path: str, left_s: Callable[[], float]) -> None:
        """``rates[path]`` measured near ``x``'s M, by single calls at M growing _PROBE_STEP-fold from the
        largest M timed so far (the first at _PROBE_ROWS rows), each made only while its cost predicted from the
        last fits a quarter of what is left. A rate is FLOP/s, which a small M's fixed cost per call drags down:
        scaled from M = 1 to M = 2^17 it can predict a minute for a 20 ms call and skip a case that fits."""
        m, n, k = x.shape[0], ops.n, ops.k

        def probe(rows: int, calls: int = 1) -> None:  # the rate of the last of ``calls`` calls at ``rows``
            fn = build_case(ops, path, x[:rows], kind).fn
            for _ in range(calls - 1):
                fn()
            rates[path] = (rows, 2.0 * rows * n * k / max(timer.once_s(fn), 1e-9))

        if path not in rates:
            probe(min(m, _PROBE_ROWS), calls=2)  # the very first call pays library set-up
        while (rows := rates[path][0] * _PROBE_STEP) < m:
            if 2.0 * rows * n * k / rates[path][1] > left_s() / 4:
                break  # the case's need comes from the last rate: an upper bound
            probe(rows)

    def warm_calls(call_s: float, left: float) -> int:
        """Warm-up calls for a case whose call takes ``call_s``: ``n_warm``, but no more than fill a quarter of
        the ``left`` seconds (at least the first call, which also measures it)."""
        return max(min(n_warm, int(left / 4 / max(call_s, 1e-9))), min(n_warm, 1))

    def measure(
        ops: ShapeOperands, x: torch.Tensor, path: str, left_s: Callable[[], float], base_s: float | None = None
    ) -> dict[str, Any]:
        """Record fields of one case: the timing, or why there is none. ``base_s``: seconds of one baseline call at
        this M (its own case's median), where the baseline was timed; a path's calls then alternate with the
        baseline's, and both count against the case's share."""
        m, k, n = x.shape[0], ops.k, ops.n
        bp = base_path(path)
        sup = support[bp]
        if not sup.runs:
            return {"native": False, "skipped": f"{SKIP_NOT_SUPPORTED} on {kind}: {sup.note}"}
        flops = 2.0 * m * n * k
        budget = f"{budget_s_per_shape:g} s for shape N={n} K={k}"
        try:
            learn_rate(ops, x, path, left_s)
            call_s = flops / rates[path][1]
            pair_s = base_s or 0.0  # what one interleaved baseline call adds to a repeat
            flushes = 1 if base_s is None else 2
            need = (call_s * (warm_calls(call_s, left_s()) + min_rep + 1)
                    + min_rep * (pair_s + flushes * timer.flush_s) + pair_s)
            if need > (left := left_s()):
                return {
                    "native": sup.native,
                    "skipped": (f"{SKIP_OVER_BUDGET}: ~{seconds_text(need)} needed, "
                                + (f"{seconds_text(left)} left of {budget}" if left > 0
                                   else f"the shape's earlier cases took all {budget}")),
                }
            case = build_case(ops, path, x, kind)
            t1 = timer.once_s(case.fn)  # first call: a warm-up, and the real cost of one call
            for _ in range(warm_calls(t1, left_s()) - 1):
                case.fn()
            rates[path] = (m, flops / max(t1, 1e-9))
            fns = [case.fn]
            if base_s is not None:  # the baseline at this M, called once more to warm it here
                base = build_case(ops, PATH_BASELINE, x, kind)
                pair_s = timer.once_s(base.fn)
                fns = [base.fn, case.fn]  # b, p, b, p, ...: a load change hits both
            reps = min(n_rep, int(left_s() / max(t1 + pair_s + flushes * timer.flush_s, 1e-9)))
            if reps < min_rep:
                return {
                    "native": sup.native,
                    "skipped": (
                        f"{SKIP_OVER_BUDGET}: one call takes {t1:.2f} s, {min_rep} repeats do not fit in the "
                        f"{max(left_s(), 0):.1f} s left of {budget}"
                    ),
                }
            samples = timer.interleaved_ms(fns, reps)
            spread = Spread.of(samples[-1])
            base_spread = Spread.of(samples[0]) if len(fns) == 2 else None
            t_ms = spread.ms
            rows = err_rows(m, dev)
            err = max_rel_err(case.fn()[rows], case.emulate(rows))
        except (RuntimeError, ValueError) as exc:  # a kernel this torch build or shape refuses
            return {"native": False, "skipped": f"{SKIP_FAILED} on {kind}: {torch_error_text(exc)}"}
        rates[path] = (m, flops / (t_ms * 1e-3))
        tflops = flops / (t_ms * 1e-3) / 1e12
        peak = peaks.get(peak_key[bp]) if kind == "cuda" else None
        return {
            "ms": t_ms,
            "repeats": spread.repeats,
            "ms_p20": spread.p20,
            "ms_p80": spread.p80,
            # a wide band of the path's calls or of the baseline's between them: the load moved while the case ran
            "unstable": spread.unstable or (base_spread is not None and base_spread.unstable),
            **({"baseline_ms": base_spread.ms, "baseline_ms_p20": base_spread.p20,
                "baseline_ms_p80": base_spread.p80, "speedup": base_spread.ms / t_ms} if base_spread else {}),
            "tflops": tflops,
            "pct_peak": (100.0 * tflops / peak) if peak else None,
            "native": sup.native,
            "max_rel_err": err,
        }

    def case_order(case: tuple[int, str]) -> tuple[int, int, int]:
        """Within a shape's budget: every baseline first (each speed-up needs one), then the paths the
        device accelerates, then the ones it only emulates, each M ascending; so a slow emulated path
        can never starve the cases that serve a step estimate, and a budget cuts the largest M first."""
        m, path = case
        phase = 0 if path == PATH_BASELINE else 1 if support[base_path(path)].native else 2
        return phase, m, PATHS.index(path)

    def bench_shape(n: int, k: int) -> list[KernelRecord]:
        """Every case of one (N, K) shape within its budget, in (M, path) order."""
        t_shape = time.perf_counter()

        def left_s() -> float:
            return budget_s_per_shape - (time.perf_counter() - t_shape)

        gen = torch.Generator().manual_seed(seed + 1_000_003 * n + k)
        ops = ShapeOperands(n, k, dev, dtype, gen)
        xs: dict[int, torch.Tensor] = {}
        shape_records: list[KernelRecord] = []
        base_s: dict[int, float] = {}  # M -> seconds of one baseline call, from its own case (timed first)

        def run_case(m: int, path: str, share: float) -> dict[str, Any]:
            if should_cancel is not None and should_cancel():
                raise Cancelled("kernel benchmark cancelled")
            if progress is not None:
                progress(done / total, f"N={n} K={k} M={m} {path}")
            if m not in xs:  # activations ~ N(0, 1), the same for every path at this M
                xs[m] = torch.randn(m, k, generator=torch.Generator().manual_seed(gen.initial_seed() + m))
                xs[m] = xs[m].to(device=dev, dtype=dtype)
            t_case = time.perf_counter()
            fields = measure(ops, xs[m], path, lambda: share - (time.perf_counter() - t_case),
                             None if path == PATH_BASELINE else base_s.get(m))
            if path == PATH_BASELINE and fields.get("ms") is not None:
                base_s[m] = fields["ms"] * 1e-3
            return fields

        def keep(m: int, path: str, fields: dict[str, Any]) -> None:
            nonlocal done
            done += 1
            pm, pk, pn = kernel_padding(path, m, k, n, kind)
            shape_records.append(
                KernelRecord(
                    device=kind,
                    device_name=info.name,
                    torch_version=info.torch_version,
                    m=m,
                    n=n,
                    k=k,
                    path=path,
                    ms=fields.get("ms"),
                    tflops=fields.get("tflops"),
                    pct_peak=fields.get("pct_peak"),
                    speedup=fields.get("speedup"),  # of the interleaved medians; the baseline's: filled in below
                    native=bool(fields["native"]),
                    max_rel_err=fields.get("max_rel_err"),
                    padded_m=pm if pm != m else None,
                    skipped=fields.get("skipped"),
                    padded_k=pk if pk != k else None,
                    padded_n=pn if pn != n else None,
                    timing=TIMING,
                    repeats=fields.get("repeats"),
                    ms_p20=fields.get("ms_p20"),
                    ms_p80=fields.get("ms_p80"),
                    baseline_ms=fields.get("baseline_ms"),
                    baseline_ms_p20=fields.get("baseline_ms_p20"),
                    baseline_ms_p80=fields.get("baseline_ms_p80"),
                    unstable=fields.get("unstable"),
                )
            )

        cases = sorted(((m, p) for m in m_list for p in want), key=case_order)
        put_off: list[tuple[int, str]] = []
        for i, (m, path) in enumerate(cases):  # first pass: an even share of what is left each, but a baseline
            share = left_s() if path == PATH_BASELINE else left_s() / (len(cases) - i)  # (speed-ups need it)
            fields = run_case(m, path, share)
            over = (fields.get("skipped") or "").startswith(SKIP_OVER_BUDGET)
            if over and path != PATH_BASELINE and i < len(cases) - 1:
                put_off.append((m, path))  # the second pass gives it whatever the others leave
            else:
                keep(m, path, fields)
        for m, path in put_off:
            keep(m, path, run_case(m, path, left_s()))
        return sorted(shape_records, key=lambda r: (r.m, PATHS.index(r.path)))

    with torch.inference_mode():
        for n, k in shape_list:
            records.extend(bench_shape(n, k))
            if kind == "cuda":
                torch.cuda.empty_cache()

    fill_speedups(records)
    if progress is not None:
        progress(1.0, "kernel benchmark done")
    return records
