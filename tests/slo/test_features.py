"""Series, violation labels and features from windows."""

from __future__ import annotations

import numpy as np
import pytest

from cotserve.common.v1 import common_pb2
from cotserve.common.windows import worker_total
from cotserve.slo import features as F

I = common_pb2.SLA_CLASS_INTERACTIVE
T0 = 1_800_000_000_000


def win(t: int, worker: str = "w1", cls=I, **kw) -> common_pb2.MetricsWindow:
    return common_pb2.MetricsWindow(start_unix_ms=T0 + t * 1000 + 17, model="m", worker=worker, sla_class=cls, **kw)


def test_series_merges_workers_per_second_and_class():
    s = F.build_series([
        win(0, "w1", arrivals=3, first_tokens=2, ttft_p50_ms=100, ttft_p99_ms=300, queue_depth=1, kv_used_fraction=0.2, worker_waiting=4, preemptions=1),
        win(0, "w2", arrivals=1, first_tokens=1, ttft_p50_ms=400, ttft_p99_ms=900, queue_depth=2, kv_used_fraction=0.6, worker_waiting=1),
        win(0, "w1", cls=common_pb2.SLA_CLASS_BATCH, arrivals=5, kv_used_fraction=0.2, worker_waiting=4, preemptions=1),
        win(2, "w1", arrivals=1),
    ])
    assert (s.t0_ms, s.n) == (T0, 3)
    assert s.arrivals[1].tolist() == [4, 0, 1] and s.arrivals[2].tolist() == [5, 0, 0]
    assert s.ttft_p50[1, 0] == pytest.approx((2 * 100 + 400) / 3)   # weighted by first tokens
    assert s.ttft_p99[1, 0] == 900 and s.queue[1, 0] == 3
    assert s.workers.tolist() == [2, 0, 1] and s.kv[0] == pytest.approx(0.4)
    assert s.worker_waiting[0] == 5 and s.preemptions[0] == 1       # worker-level fields once per worker
    assert s.reported[:, 0].tolist() == [0, 2, 1]


def test_violations_and_labels_look_ahead_over_the_horizon():
    ws = [win(t, first_tokens=1, ttft_p99_ms=1500 if t in (5, 6) else 100, itl_p95_ms=150 if t == 12 else 10) for t in range(15)]
    s = F.build_series(ws)
    viol = F.violations(s)
    assert np.nonzero(viol[1])[0].tolist() == [5, 6, 12]  # TTFT p99 above 1000 ms, ITL p95 above 100 ms
    lab, valid = F.labels(viol, horizon_s=3)
    assert np.nonzero(lab[1])[0].tolist() == [2, 3, 4, 5, 9, 10, 11]  # a violation within (t, t+3]
    assert valid.tolist() == [t + 3 < 15 for t in range(15)]
    no_samples = F.build_series([win(0, ttft_p99_ms=5000)])  # no first tokens: not a violation
    assert not F.violations(no_samples).any()


def test_rolling_helpers():
    x = np.array([1.0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22])
    assert F._mean(x, 3)[:4].tolist() == [1.0, 1.5, 2.0, 3.0]
    assert F._max(x[::-1], 3)[:3].tolist() == [22, 22, 22]
    assert F._sum(np.ones(5), 3).tolist() == [1, 2, 3, 3, 3]
    assert F._slope(x)[-1] == pytest.approx(10.0)  # mean of the last 10 minus the 10 before


def test_feature_matrix_shape_and_meaning():
    ws = [win(t, arrivals=t, first_tokens=1, ttft_p99_ms=500, queue_depth=2) for t in range(70)]
    m = F.feature_matrix(F.build_series(ws))
    assert m.shape == (3, 70, len(F.FEATURES))
    row = dict(zip(F.FEATURES, m[1, -1]))
    assert row["is_interactive"] == 1 and row["is_batch"] == 0
    assert row["ttft_p99_rel"] == 0.5 and row["arrivals"] == 69 and row["queue"] == 2
    assert row["arrivals_mean10"] == pytest.approx(64.5) and row["arrivals_slope"] == pytest.approx(10)


def test_worker_total_sums_classes_into_one_worker_window():
    total = worker_total([win(0, arrivals=2, in_flight=3, first_tokens=2, ttft_p50_ms=100, kv_used_fraction=0.5),
                            win(0, cls=common_pb2.SLA_CLASS_BATCH, arrivals=1, in_flight=5, first_tokens=1, ttft_p50_ms=400,
                                kv_used_fraction=0.5)], "w1", T0)
    assert (total.arrivals, total.in_flight, total.kv_used_fraction) == (3, 8, 0.5)
    assert total.ttft_p50_ms == pytest.approx(200)
