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


def test_mean_interval_uses_students_t_over_runs():
    from cotserve.common.stats import mean_interval95

    mean, half = mean_interval95([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / math.sqrt(3))  # t(2) x sd / sqrt(n)
    assert mean_interval95([5.0, float("nan"), 5.0]) == (5.0, 0.0)  # NaN runs left out
    one = mean_interval95([4.0])
    assert one[0] == 4.0 and math.isnan(one[1])
    assert all(math.isnan(v) for v in mean_interval95([]))


def test_wilson_interval_stays_inside_zero_one_and_narrows_with_trials():
    from cotserve.common.stats import wilson_interval95

    lo, hi = wilson_interval95(10, 20)
    assert lo == pytest.approx(0.2993, abs=1e-4) and hi == pytest.approx(0.7007, abs=1e-4)
    assert wilson_interval95(0, 5)[0] == 0.0 and 0 < wilson_interval95(0, 5)[1] < 0.5
    assert wilson_interval95(20, 20)[1] == 1.0 and wilson_interval95(20, 20)[0] > 0.8
    assert wilson_interval95(50, 100)[1] - wilson_interval95(50, 100)[0] < hi - lo
    assert all(math.isnan(v) for v in wilson_interval95(0, 0))


def test_mean_pm_prints_a_figure_over_runs():
    from cotserve.common.stats import mean_pm

    assert mean_pm([1.0, 2.0, 3.0], "{:.2f}") == "2.00 ± 2.48"
    assert mean_pm([0.1], "{:.0f}%", 100) == "10%"  # one run: no interval
    assert mean_pm([], "{:.1f}") == "n/a"
