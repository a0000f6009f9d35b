"""The latency model's trees evaluated without XGBoost: the same predictions as XGBoost's own, what it refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xgboost as xgb

from cotserve.common.latency import LATENCY_FEATURES, TreeEnsemble, latency_row
from cotserve.common.v1 import common_pb2


def _booster(objective: str, rounds: int = 60, **params) -> tuple[xgb.Booster, np.ndarray]:
    rng = np.random.default_rng(0)
    X = rng.random((3000, len(LATENCY_FEATURES))) * 100
    X[rng.random(X.shape) < 0.05] = np.nan  # missing values: each split's default branch
    y = 5 + 3 * np.nan_to_num(X[:, 14]) + np.nan_to_num(X[:, 0]) + 10 * rng.random(3000)
    d = xgb.DMatrix(X, label=y, weight=1 / y, feature_names=list(LATENCY_FEATURES))
    p = {"objective": objective, "max_depth": 5, "eta": 0.1, "nthread": 1, "seed": 0, **params}
    return xgb.train(p, d, rounds), X


@pytest.mark.parametrize("objective", ["reg:absoluteerror", "reg:squarederror"])
def test_predictions_are_xgboosts_own(objective):
    booster, X = _booster(objective)
    trees = TreeEnsemble(bytes(booster.save_raw("json")))
    assert trees.features == LATENCY_FEATURES and len(trees.trees) == 60
    rows = X[:300]
    theirs = booster.predict(xgb.DMatrix(rows, feature_names=list(LATENCY_FEATURES)))
    ours = np.array([trees.predict(list(r)) for r in rows])
    assert np.isnan(rows).any(axis=1).sum() > 100  # many rows take a default branch somewhere
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert len(set(np.round(ours, 3))) > 100  # the rows reach different leaves: not one constant


def test_a_value_on_a_threshold_goes_right_as_in_xgboost():
    """XGBoost sends x < threshold left; a row exactly on a split's float32 threshold goes right."""
    booster, X = _booster("reg:squarederror", rounds=1, max_depth=1)
    trees = TreeEnsemble(bytes(booster.save_raw("json")))
    t = trees.trees[0]
    row = list(np.nan_to_num(X[0]))
    row[t.feature[0]] = t.value[0]
    theirs = booster.predict(xgb.DMatrix(np.array([row]), feature_names=list(LATENCY_FEATURES)))[0]
    assert trees.predict(row) == pytest.approx(float(theirs), rel=1e-6)
    assert trees.predict(row) == pytest.approx(trees.base_score + t.value[t.right[0]], rel=1e-6)


def test_models_it_cannot_evaluate_are_refused_by_name():
    booster, _ = _booster("reg:squarederror", rounds=2)
    model = json.loads(booster.save_raw("json"))
    with pytest.raises(ValueError, match="not an XGBoost model's JSON"):
        TreeEnsemble(b"{}")
    logistic = json.loads(json.dumps(model))
    logistic["learner"]["objective"]["name"] = "binary:logistic"
    with pytest.raises(ValueError, match="objective: 'binary:logistic', must be one of"):
        TreeEnsemble(json.dumps(logistic))
    linear = json.loads(json.dumps(model))
    linear["learner"]["gradient_booster"]["name"] = "gblinear"
    with pytest.raises(ValueError, match="gradient_booster: 'gblinear', only gbtree"):
        TreeEnsemble(json.dumps(linear))


def test_a_row_is_the_window_with_the_requests_place_in_line_and_the_workers_own_load():
    w = common_pb2.MetricsWindow(in_flight=3, worker_waiting=2, waiting_for_first_token=4, prefill_tokens_ahead=100,
                              worker_running=20, worker_step_ms=5.0, worker_tokens_per_s=4000.0, worker_max_num_seqs=4,
                              oldest_wait_ms=120.0, silent_ms=45.0, seat_wait_tokens=13.0)
    row = dict(zip(LATENCY_FEATURES, latency_row(50, 16, common_pb2.SLA_CLASS_REALTIME, w)))
    assert len(row) == len(LATENCY_FEATURES)
    assert (row["is_realtime"], row["is_interactive"], row["prompt_tokens"], row["max_new_tokens"]) == (1, 0, 50, 16)
    assert row["prefill_tokens_to_first"] == 150 and row["w_running"] == 20 and row["w_gen_tokens_per_s"] == 4000
    assert row["steps_ahead_ms"] == 5.0 * (1 + 4 + 2)
    assert (row["oldest_wait_ms"], row["silent_ms"], row["seat_wait_tokens"]) == (120.0, 45.0, 13.0)
    assert (row["w_seats"], row["in_flight_per_seat"], row["busy_per_seat"]) == (4, 0.75, 5.5)
    w.worker_max_num_seqs = 0  # seats unknown (a worker not yet asked for its Info): no per-seat signal, not a division by 0
    row = dict(zip(LATENCY_FEATURES, latency_row(50, 16, common_pb2.SLA_CLASS_REALTIME, w)))
    assert (row["w_seats"], row["in_flight_per_seat"], row["busy_per_seat"]) == (0, 0.0, 0.0)
