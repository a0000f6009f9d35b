"""The suite's one percentile rule (nearest rank), as every service and benchmark reports it."""

from __future__ import annotations

import math

import pytest

from cotserve.common.stats import percentile


def test_nearest_rank():
    values = [15, 20, 35, 40, 50]  # the textbook example: p30 = 20, p40 = 20, p50 = 35, p100 = 50
    assert [percentile(values, q) for q in (0, 5, 30, 40, 50, 95, 100)] == [15, 15, 20, 20, 35, 50, 50]
    assert percentile([2.0, 1.0], 50) == 1.0 and percentile(range(1, 101), 99) == 99  # order does not matter


def test_empty_and_bad_q():
    assert math.isnan(percentile([], 50)) and percentile([], 95, empty=0.0) == 0.0
    with pytest.raises(ValueError, match="q: 101"):
        percentile([1.0], 101)
