"""Mergeable latency histograms with fixed buckets, from which P50/P95/P99 are read.

Buckets are 50 ms wide from 50 ms to 60 s, as the design brief asks, and 1 ms wide below 50 ms:
on a serving stack most time-per-output-token and queue samples are a few milliseconds, so a
single 0-50 ms bucket would put every TPOT sample in one cell and say nothing. Above 60 s there
is one overflow bucket. Fixed bounds make two histograms mergeable by adding counts, which is
what lets the service keep one histogram per (time slot, version, class, tenant, occupancy) and
merge any selection of them at query time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FINE_MS = 1.0          # bucket width below FINE_LIMIT_MS
FINE_LIMIT_MS = 50.0
COARSE_MS = 50.0       # bucket width from FINE_LIMIT_MS to MAX_MS
MAX_MS = 60_000.0
NUM_FINE = int(FINE_LIMIT_MS / FINE_MS)
NUM_BUCKETS = NUM_FINE + int((MAX_MS - FINE_LIMIT_MS) / COARSE_MS) + 1  # + the overflow bucket


def bucket_index(value_ms: float) -> int:
    if value_ms < FINE_LIMIT_MS:
        return max(0, int(value_ms / FINE_MS))
    if value_ms < MAX_MS:
        return NUM_FINE + int((value_ms - FINE_LIMIT_MS) / COARSE_MS)
    return NUM_BUCKETS - 1


def bucket_bounds(index: int) -> tuple[float, float]:
    """[lower, upper) of bucket `index` in ms; the overflow bucket's upper bound is +inf."""
    if index < NUM_FINE:
        return index * FINE_MS, (index + 1) * FINE_MS
    if index < NUM_BUCKETS - 1:
        lo = FINE_LIMIT_MS + (index - NUM_FINE) * COARSE_MS
        return lo, lo + COARSE_MS
    return MAX_MS, math.inf


def bucket_upper_bounds() -> list[float]:
    return [bucket_bounds(i)[1] for i in range(NUM_BUCKETS)]


@dataclass(slots=True)
class Histogram:
    """Sparse bucket counts plus count and sum (the sum gives an exact mean)."""

    counts: dict[int, int] = field(default_factory=dict)
    count: int = 0
    sum_ms: float = 0.0

    def add(self, value_ms: float) -> None:
        i = bucket_index(value_ms)
        self.counts[i] = self.counts.get(i, 0) + 1
        self.count += 1
        self.sum_ms += value_ms

    def merge(self, other: Histogram) -> None:
        for i, n in other.counts.items():
            self.counts[i] = self.counts.get(i, 0) + n
        self.count += other.count
        self.sum_ms += other.sum_ms

    def quantile(self, q: float) -> float:
        """The q-quantile (0 < q <= 1) by rank `ceil(q * count)`, placed by linear interpolation
        inside its bucket, so it lies in the same bucket as the exact nearest-rank quantile."""
        if self.count == 0:
            return math.nan
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for i in sorted(self.counts):
            n = self.counts[i]
            if seen + n >= rank:
                lo, hi = bucket_bounds(i)
                if math.isinf(hi):
                    return lo
                return lo + (hi - lo) * (rank - seen - 0.5) / n
            seen += n
        raise AssertionError("unreachable: counts sum to count")

    def to_json(self) -> list:
        return [self.count, self.sum_ms, {str(i): n for i, n in self.counts.items()}]

    @classmethod
    def from_json(cls, data: list) -> Histogram:
        count, sum_ms, counts = data
        h = cls({int(i): int(n) for i, n in counts.items()}, int(count), float(sum_ms))
        if h.count != sum(h.counts.values()) or any(i < 0 or i >= NUM_BUCKETS or n < 0 for i, n in h.counts.items()):
            raise ValueError("histogram counts are inconsistent")
        return h
