"""Commands for scoring, sensitivity, kernel benchmarks and plans (added to the main parser)."""

from __future__ import annotations


def add_commands(sub) -> None:
    return None
