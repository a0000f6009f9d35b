"""The mergeable histogram: bucket layout, quantiles within one bucket of the exact ones, merging."""

from __future__ import annotations

import math
import random

import pytest

from cotserve.telemetry.histogram import NUM_BUCKETS, Histogram, bucket_bounds, bucket_index, bucket_upper_bounds


def nearest_rank(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(1, math.ceil(q * len(s))) - 1]


def test_buckets_are_1ms_below_50ms_then_50ms_then_overflow():
    assert [bucket_bounds(bucket_index(v)) for v in (0.0, 0.4, 7.5, 49.99)] == [(0, 1), (0, 1), (7, 8), (49, 50)]
    assert bucket_bounds(bucket_index(50.0)) == (50, 100)
    assert bucket_bounds(bucket_index(1234.5)) == (1200, 1250)
    assert bucket_bounds(bucket_index(59_999.0)) == (59_950, 60_000)
    assert bucket_index(60_000.0) == bucket_index(1e9) == NUM_BUCKETS - 1
    assert bucket_bounds(NUM_BUCKETS - 1) == (60_000, math.inf)
    uppers = bucket_upper_bounds()
    assert len(uppers) == NUM_BUCKETS and uppers == sorted(uppers)
    for i in range(NUM_BUCKETS):  # contiguous: each bucket starts where the previous ends
        assert bucket_bounds(i)[0] == (uppers[i - 1] if i else 0)


@pytest.mark.parametrize("seed", range(5))
def test_quantiles_fall_in_the_exact_quantiles_bucket(seed):
    rng = random.Random(seed)
    values = [rng.lognormvariate(math.log(rng.choice([3, 40, 300])), 0.8) for _ in range(rng.randint(1, 3000))]
    h = Histogram()
    for v in values:
        h.add(v)
    assert h.count == len(values) and h.sum_ms == pytest.approx(sum(values))
    for q in (0.5, 0.95, 0.99):
        exact = nearest_rank(values, q)
        lo, hi = bucket_bounds(bucket_index(exact))
        assert lo <= h.quantile(q) < hi or (math.isinf(hi) and h.quantile(q) == lo), (q, exact, h.quantile(q))


def test_merge_equals_one_histogram_of_all_values_and_json_round_trips():
    rng = random.Random(7)
    parts = [[rng.uniform(0, 2000) for _ in range(n)] for n in (10, 200, 1)]
    merged, whole = Histogram(), Histogram()
    for part in parts:
        h = Histogram()
        for v in part:
            h.add(v)
            whole.add(v)
        merged.merge(Histogram.from_json(h.to_json()))
    assert merged.counts == whole.counts and merged.count == whole.count == 211
    assert merged.quantile(0.99) == whole.quantile(0.99)
    assert math.isnan(Histogram().quantile(0.5))
    with pytest.raises(ValueError):
        Histogram.from_json([5, 1.0, {"3": 2}])  # count disagrees with the buckets
