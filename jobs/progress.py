"""What a running job says about its progress: its count in its own units and the time left at its measured rate.

A job body reports ``(fraction, message)``; the numeric core's messages carry a count ("scoring: 12 of 32
sequences", "streamed, block 3/30", "down_proj (40 of 121, …)"). :class:`Pace` reads the count of the step under
way, times it, and appends the time left at the rate measured since that step began: "… · about 40 s left" where
the step fills the rest of the bar, "… · about 40 s left in this step" where another follows. No count, no
estimate (a message without one is passed on as it is). Imports nothing but the standard library: the worker's
runner uses it where progress is written, and the pages read what it wrote.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

# "12 of 32 sequences", "12/32", "block 3/30": the first count in a message, with the word after it if there is one
_COUNT = re.compile(r"(\d+)\s*(?:of|/)\s*(\d+)(?:\s+([a-zA-Z][\w-]*))?")
_DIGITS = re.compile(r"\d+")
MIN_ELAPSED_S = 2.0  # a step measured for less says no time left yet (its first batch includes warm-up)
LAST_STEP = 0.995  # a step whose count ends the bar past this fraction is the job's last: "left", not "in this step"
ETA_MARK = " · about "  # what a message with a time left carries, so a reader can tell the estimate apart


def time_left_text(seconds: float) -> str:
    """"40 s" / "3 min" / "1.5 h": a time left in the unit a person would use."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def read_count(message: str) -> tuple[int, int, str] | None:
    """(done, total, unit word or "") of the first "a of b" / "a/b" count in ``message``; None without one."""
    m = _COUNT.search(message)
    if m is None:
        return None
    done, total = int(m.group(1)), int(m.group(2))
    if total <= 0 or done > total:
        return None
    return done, total, m.group(3) or ""


def _step(message: str) -> str:
    """A message up to its count's unit, numbers taken out: the same step while only its counts (and what follows
    them, such as the layer or GEMM case under way) change."""
    m = _COUNT.search(message)
    return _DIGITS.sub("#", message[: m.end()] if m else message)


@dataclass
class Pace:
    """The rate of the step under way, from the counts of its messages (``clock``: seconds, monotonic)."""

    clock: Callable[[], float] = time.monotonic
    _step: str | None = None
    _start: tuple[float, int, float] = (0.0, 0, 0.0)  # (time, count, fraction) when the step's count first moved

    def left_s(self, fraction: float, message: str) -> tuple[float, bool] | None:
        """(seconds left, whether the job ends with this step) at the rate measured since the step's first count,
        or None: no count, the count has not moved yet, or too little of it measured."""
        count = None if " left" in message else read_count(message)  # a message with an estimate of its own
        step = _step(message)
        now = self.clock()
        if count is None:
            self._step = None
            return None
        done, total, _ = count
        if step != self._step or done < self._start[1]:
            self._step, self._start = step, (now, done, fraction)
            return None
        t0, d0, f0 = self._start
        if done <= d0 or done >= total or now - t0 < MIN_ELAPSED_S:
            return None
        per_unit = (now - t0) / (done - d0)
        # the bar's fraction where this step's count reaches its total: the job's end, or a later step's start
        f_end = f0 + (fraction - f0) * (total - d0) / (done - d0)
        return per_unit * (total - done), f_end >= LAST_STEP or fraction >= LAST_STEP

    def say(self, fraction: float, message: str) -> str:
        """``message`` with the time left appended where :meth:`left_s` has one."""
        left = self.left_s(fraction, message)
        if left is None:
            return message
        seconds, last = left
        return f"{message}{ETA_MARK}{time_left_text(seconds)} left" + ("" if last else " in this step")
