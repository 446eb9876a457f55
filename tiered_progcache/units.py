"""Sizes and durations as people write and read them: the one set of units for settings and the command."""

from __future__ import annotations

import re

__all__ = ["format_age", "format_size", "is_size_unit", "parse_duration", "parse_size"]

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}  # fmt: skip
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """``"256M"`` -> 256_000_000, ``"10Gi"`` -> 10 * 2**30, ``"4096"`` -> 4096 (ccache's units).

    ``ValueError`` for anything else, with examples.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 256M, 10G, 10Gi, 4096)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def is_size_unit(text: str) -> bool:
    """True for a unit :func:`parse_size` reads after a number (``G``, ``GB``, ``GiB``, ``b``), any case."""
    return bool(text) and text.lower() in _SIZE_UNITS


def parse_duration(text: str) -> float:
    """``"30d"`` -> seconds. Units: s, m, h, d, w; ``ValueError`` for anything else, with examples."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (examples: 30d, 12h, 90m, 2w)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def format_size(n: int | None) -> str:
    """Bytes in binary units (``"5.4 KiB"``); ``"-"`` for unknown."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def format_age(seconds: float | None) -> str:
    """An age in its largest whole unit (``"40d"``, ``"3h"``); ``"?"`` for unknown."""
    if seconds is None:
        return "?"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
