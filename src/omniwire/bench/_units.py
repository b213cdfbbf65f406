"""Figures for people: sizes in KiB/MiB/GiB, times in ns/µs/ms/s, rates chosen by magnitude."""

from __future__ import annotations

import math

__all__ = [
    "GiB",
    "KiB",
    "MiB",
    "fmt_count",
    "fmt_cpu",
    "fmt_rate",
    "fmt_ratio",
    "fmt_size",
    "fmt_time",
    "parse_size",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def parse_size(text: str) -> int:
    """``"1K"``, ``"64M"``, ``"1KiB"``, ``"4096"`` → bytes.

    Raises:
        ValueError: not a size.
    """
    clean = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    for suffix, factor in (("K", KiB), ("M", MiB), ("G", GiB)):
        if clean.endswith(suffix):
            clean, scale = clean[:-1], factor
            break
    try:
        return int(float(clean) * scale)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 1K, 64M, 4096)") from None


def fmt_size(n: float) -> str:
    """Binary units: ``1 KiB``, ``1.5 MiB``, ``256 MiB``, ``64 B``."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


def _three(value: float) -> str:
    """Three significant digits, no exponent: 1.23, 12.3, 123, 1234."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def fmt_time(seconds: float | None) -> str:
    """``850 ns``, ``612 µs``, ``1.25 ms``, ``2.50 s``; ``—`` for None/NaN."""
    if seconds is None or math.isnan(seconds):
        return "—"
    if seconds == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{_three(seconds / scale)} {unit}"
    return f"{_three(seconds / 1e-9)} ns"


def fmt_rate(bytes_per_s: float | None) -> str:
    """Decimal units by magnitude: ``850 kB/s``, ``4.10 MB/s``, ``7.95 GB/s``."""
    if bytes_per_s is None or math.isnan(bytes_per_s):
        return "—"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{_three(bytes_per_s / scale)} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def fmt_count(per_s: float | None, unit: str = "msgs/s") -> str:
    """``18,400 msgs/s`` (thousands separators)."""
    if per_s is None or math.isnan(per_s):
        return "—"
    return f"{per_s:,.0f} {unit}"


def fmt_ratio(ratio: float | None) -> str:
    """``0.19×``, ``3.6×``, ``12×``; ``—`` when there is no ratio."""
    if ratio is None or math.isnan(ratio) or math.isinf(ratio):
        return "—"
    return f"{_three(ratio)}×"


def fmt_cpu(cpu_s: float, wall_s: float) -> str:
    """CPU time over a wall interval: ``0.40 ms/s (0.04 % of a core)``."""
    per_s = cpu_s / wall_s if wall_s > 0 else float("nan")
    return f"{fmt_time(per_s)}/s ({100 * per_s:.2f} % of a core)"
