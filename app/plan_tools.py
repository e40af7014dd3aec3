"""Plan page sections that build on scoring and benchmarks: automatic plans and export."""

from __future__ import annotations


def render(model, plans, target) -> None:
    return None
