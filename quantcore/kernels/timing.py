"""How a benchmark times one call: CUDA events or ``time.perf_counter``, the caches flushed before each call.

torch is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

L2_FLUSH_BYTES = 256 * 1024 * 1024  # triton.testing.do_bench zeroes a 256 MB buffer to clear L2
CPU_FLUSH_MIN_BYTES = 64 * 1024 * 1024  # at least this much on a CPU, twice its last-level caches where larger
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
    """How much a timer writes before each timed call to evict the operands from the caches."""
    if kind == "cuda":
        return L2_FLUSH_BYTES
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
        import torch

        if self.kind == "cuda":
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            for i in range(repeats):
                self._flush.zero_()  # evict the operands from L2
                starts[i].record()
                fn()
                ends[i].record()
            torch.cuda.synchronize(self.device)
            return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
        times = []
        for _ in range(repeats):
            self._flush.zero_()  # evict the operands from the last-level cache
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
