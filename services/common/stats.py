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
