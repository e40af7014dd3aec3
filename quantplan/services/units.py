"""Sizes and counts as a person reads them (both front ends print them)."""

from __future__ import annotations

MIB = 2**20


def mib_text(bits: float) -> str:
    """A size in bits as a person reads it: "128.6 MiB"."""
    return f"{bits / 8 / MIB:,.1f} MiB"


def fmt_params(n: int) -> str:
    """A parameter count as a person reads it: "91.0 K", "134.5 M", "30.53 B"."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"
