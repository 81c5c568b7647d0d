"""Sizes and figures as the bench reads and prints them (1 GB = 1e9 bytes)."""

from __future__ import annotations

import argparse
import re

GB = 1e9


def parse_size(text: str) -> int:
    """``"1GB"`` -> 1e9 bytes; ``MB``/``KB``/``GB``/``TB`` are decimal, ``MiB`` etc. binary."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        msg = f"not a size: {text!r} (try 1GB, 100MB, 10MB)"
        raise argparse.ArgumentTypeError(msg)
    num, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    power = " KMGT".index(unit or " ")
    value = int(num * (1024 if binary else 1000) ** power)
    if value < 100_000:
        msg = f"size {text!r} is too small (at least 100KB)"
        raise argparse.ArgumentTypeError(msg)
    return value


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.3g}{unit}"
        n /= 1000
    return f"{n}"


def binary(n: float) -> str:
    """``n`` bytes in binary units, as the scale tools print them: ``1014 B``, ``6.5 KB``."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"  # pragma: no cover


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)
