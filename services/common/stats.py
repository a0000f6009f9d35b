"""One percentile rule for the whole suite: the engine's step latencies, the gateway's admission and SLO windows,
and every benchmark's tables."""

from __future__ import annotations

import math
from typing import Iterable


def percentile(values: Iterable[float], q: float, empty: float = math.nan) -> float:
    """The `q`th percentile (0..100) by the nearest-rank rule: the smallest value with at least q% of the values at
    or below it (so p100 is the maximum and p50 of [1, 2] is 1); `empty` when there are no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q: {q}, allowed 0..100")
    ordered = sorted(values)
    if not ordered:
        return empty
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


# two-sided 95% quantiles of Student's t by degrees of freedom (beyond the table, the normal's 1.96 is within 4%)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def mean_interval95(values: Iterable[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% interval) by Student's t over independent runs (NaNs left out); the half-width
    is NaN with fewer than two values."""
    xs = [v for v in values if not math.isnan(v)]
    if not xs:
        return math.nan, math.nan
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return mean, math.nan
    df = len(xs) - 1
    t = _T95.get(df) or next((_T95[k] for k in sorted(_T95) if k >= df), 1.96)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / df)
    return mean, t * sd / math.sqrt(len(xs))


def wilson_interval95(successes: int, trials: int) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (NaNs without trials): sound at 0 or all successes, and for few
    trials, where the normal approximation is not."""
    if trials <= 0:
        return math.nan, math.nan
    z, p = 1.96, successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_pm(values: Iterable[float], fmt: str = "{:.3f}", scale: float = 1.0) -> str:
    """'mean ± half-width' of `mean_interval95` over `values` times `scale`, each part in `fmt` ('mean' alone for
    one value, 'n/a' for none): how the benches print a figure over seeds or recordings."""
    mean, half = mean_interval95([v * scale for v in values])
    if math.isnan(mean):
        return "n/a"
    return fmt.format(mean) + ("" if math.isnan(half) else " ± " + fmt.format(half))
