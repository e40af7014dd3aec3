"""How a benchmark times one call: CUDA events or ``time.perf_counter``, the caches flushed before each call.

torch is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from quantcore.kernels.records import QUANTILES, is_unstable

L2_FLUSH_BYTES = 256 * 1024 * 1024  # triton.testing.do_bench zeroes a 256 MB buffer to clear L2
CPU_FLUSH_MIN_BYTES = 64 * 1024 * 1024  # at least this much on a CPU, twice its last-level caches where larger
CPU_FLUSH_ENV = "QUANTPLAN_CPU_FLUSH_MIB"  # a CPU's flush in MiB, instead of the rule below (flush_bytes)
CPU_FLUSH_MAX_BYTES = 2 * 1024**3  # and at most this (a two-socket server's L3s together can pass 1 GiB)
CPU_SYSFS = "/sys/devices/system/cpu"


def cpu_cache_bytes(sysfs: str = CPU_SYSFS) -> int | None:
    """Every last-level cache of the machine together, from Linux's sysfs: each instance once (CPUs that share one
    list the same ``shared_cpu_list``), so a many-CCD EPYC or a two-socket server counts all of its L3s, which a
    multi-threaded flush writes through in parallel. None where sysfs does not say."""
    from pathlib import Path

    units = {"K": 1024, "M": 1024**2, "G": 1024**3}
    top, instances = 0, dict[str, int]()
    for d in Path(sysfs).glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (d / "type").read_text().strip() == "Instruction":
                continue
            level = int((d / "level").read_text())
            text = (d / "size").read_text().strip()
            size = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
            shared = (d / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError, KeyError):  # a sandbox's partial or unreadable sysfs
            continue
        if level > top:
            top, instances = level, {}
        if level == top:
            instances[shared] = size
    return sum(instances.values()) or None


def flush_bytes(kind: str) -> int:
    """How much a timer writes before each timed call to evict the operands from the caches: on a CPU
    :data:`CPU_FLUSH_ENV` MiB where it is set (a VM that reports its host's last-level cache, hundreds of MiB, would
    spend most of a small model's benchmark flushing), else twice the last-level caches within the bounds above."""
    if kind == "cuda":
        return L2_FLUSH_BYTES
    if asked := os.environ.get(CPU_FLUSH_ENV, "").strip():
        if not asked.isdigit() or not 1 <= int(asked) <= CPU_FLUSH_MAX_BYTES // 2**20:
            raise ValueError(f"{CPU_FLUSH_ENV}={asked!r}: MiB a CPU benchmark writes before each timed call, a whole "
                             f"number from 1 to {CPU_FLUSH_MAX_BYTES // 2**20}")
        return int(asked) * 2**20
    return min(CPU_FLUSH_MAX_BYTES, max(CPU_FLUSH_MIN_BYTES, 2 * (cpu_cache_bytes() or 0)))


class Timer:
    """Times a call on one device: CUDA events or perf_counter, the caches flushed before each call."""

    def __init__(self, device: str, kind: str) -> None:
        import torch

        self.kind = kind
        self.device = device
        self._flush = torch.empty(flush_bytes(kind) // 4, dtype=torch.int32, device=device)
        self._flush.zero_()  # the first write pays the pages' allocation
        self.flush_s = self.once_s(self._flush.zero_)  # what each timed call's flush adds to a case's wall time

    def sync(self) -> None:
        """Wait for the device's queued work (CUDA); nothing on a CPU."""
        import torch

        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)

    def once_s(self, fn: Callable[[], Any]) -> float:
        """Wall seconds of one call, synchronised (also serves as a warm-up call)."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def median_ms(self, fn: Callable[[], Any], repeats: int) -> float:
        """Median milliseconds of ``repeats`` calls of ``fn``, the caches flushed before each."""
        return statistics.median(self.interleaved_ms([fn], repeats)[0])

    def interleaved_ms(self, fns: Sequence[Callable[[], Any]], repeats: int) -> list[list[float]]:
        """Milliseconds of ``repeats`` calls of each of ``fns``, interleaved: fns[0], fns[1], ..., fns[0], fns[1], ...
        (a baseline and a path: b, p, b, p, ...), the caches flushed before every call. A change of load while a
        case runs (another process, a clock that throttles) then hits every function alike, so a ratio of their
        medians is not skewed by it the way timing one after the other is. One list of samples per function."""
        import torch

        n = len(fns)
        if self.kind == "cuda":
            starts = [[torch.cuda.Event(enable_timing=True) for _ in range(repeats)] for _ in range(n)]
            ends = [[torch.cuda.Event(enable_timing=True) for _ in range(repeats)] for _ in range(n)]
            for i in range(repeats):
                for j, fn in enumerate(fns):
                    self._flush.zero_()  # evict the operands from L2
                    starts[j][i].record()
                    fn()
                    ends[j][i].record()
            torch.cuda.synchronize(self.device)
            return [[s.elapsed_time(e) for s, e in zip(starts[j], ends[j], strict=True)] for j in range(n)]
        times: list[list[float]] = [[] for _ in range(n)]
        for _ in range(repeats):
            for j, fn in enumerate(fns):
                self._flush.zero_()  # evict the operands from the last-level cache
                t0 = time.perf_counter()
                fn()
                times[j].append((time.perf_counter() - t0) * 1e3)
        return times


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values``, linearly interpolated between the closest ranks (numpy's and
    ``torch.quantile``'s default, which ``triton.testing.do_bench`` reports through)."""
    if not values:
        raise ValueError("no samples")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Spread:
    """A case's timed calls summed up as ``triton.testing.do_bench(quantiles=(0.5, 0.2, 0.8))`` reports them."""

    repeats: int  # how many timed calls
    ms: float  # their median
    p20: float  # 20th percentile
    p80: float  # 80th percentile

    @property
    def unstable(self) -> bool:
        """Whether the p20-p80 band is wide relative to the median (quantcore.kernels.records.UNSTABLE_SPREAD)."""
        return is_unstable(self.ms, self.p20, self.p80)

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> Spread:
        """The spread of a case's samples, in milliseconds."""
        med, p20, p80 = (quantile(samples_ms, q) for q in QUANTILES)
        return cls(repeats=len(samples_ms), ms=med, p20=p20, p80=p80)
