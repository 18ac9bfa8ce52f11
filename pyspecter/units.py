"""Sizes as people read them: in the unit family they typed (MiB/GiB for binary input, MB/GB for decimal)."""

from __future__ import annotations

import re

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB")
_DECIMAL = ("B", "KB", "MB", "GB", "TB")


def fmt_bytes(n: float) -> str:
    """Binary units with two decimals (``1.50 MiB``): tables and inspect."""
    for unit in _BINARY:
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def family(text: str | None, default: str = "decimal") -> str:
    """"binary" for sizes given as KiB/MiB/GiB/TiB (or Ki, Mi...), "decimal" for KB/MB/GB/TB, else ``default``
    (a percentage or a plain byte count says nothing)."""
    if text is None:
        return default
    s = text.strip().lower()
    if re.search(r"[kmgt]ib?$", s):
        return "binary"
    if re.search(r"[kmgt]b?$", s):
        return "decimal"
    return default


def fmt_size(n: float, fam: str = "decimal") -> str:
    """One decimal, in the largest unit of ``fam`` that keeps the figure at least 1 (45.7 MiB, not 0.0 GB)."""
    base, units = (1024, _BINARY) if fam == "binary" else (1000, _DECIMAL)
    for unit in units:
        if abs(n) < base or unit == units[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= base
    raise AssertionError


def fmt_budget_arg(n: float, fam: str, *, up: bool) -> str:
    """A size to type after --budget, rounded to 0.1 of its unit (up: a minimum that must be met; down: a
    maximum that must not be passed), with no space (``12.5MiB``)."""
    import math

    base, units = (1024, _BINARY) if fam == "binary" else (1000, _DECIMAL)
    i = 0
    while i + 1 < len(units) and abs(n) >= base ** (i + 1):
        i += 1
    v = n / base**i
    v = math.ceil(v * 10) / 10 if up else math.floor(v * 10) / 10
    return f"{int(n)}" if i == 0 else f"{v:.1f}{units[i]}"
