"""History persistence and validation, the learners, their JSON files and the offline evaluation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cotserve.common.errors import InvalidArgument
from cotserve.common.latency import ESTIMATE, LATENCY_FEATURES, ttft_estimate_ms
from cotserve.slo import features as F
from cotserve.slo.history import History, read_records, validate_window, write_records
from cotserve.slo.model import (Forecaster, LatencyModel, Untrained, evaluate, forecast_data, latency_data, lead_times,
                                mape, roc_auc)
from cotserve.slo.v1 import slo_pb2
from tests.slo.synth import simulate


def test_history_survives_restart_and_ignores_a_truncated_tail(tmp_path):
    path = tmp_path / "history.bin"
    windows, requests = simulate(30)
    h = History(path)
    for i in range(0, 30, 10):
        h.add(windows[i:i + 10], requests[i * 5:(i + 10) * 5])
    again = History(path)
    assert list(again.windows) == windows and list(again.requests) == list(h.requests)
    with open(path, "ab") as fh:
        fh.write(b"\x40\x00\x00\x00partial")  # a crash mid-write
    assert list(History(path).windows) == windows
    # the service is lenient with a torn tail; read_records (offline tools) is strict
    with pytest.raises(ValueError, match="truncated record"):
        read_records(path)


def test_corrupt_history_is_set_aside(tmp_path, caplog):
    path = tmp_path / "history.bin"
    path.write_bytes(b"\x05\x00\x00\x00\xff\xff\xff\xff\xff")
    h = History(path)
    assert len(h.windows) == 0 and (tmp_path / "history.bin.corrupt").exists() and "unreadable" in caplog.text


def test_record_files_round_trip(tmp_path):
    windows, requests = simulate(20)
    write_records(tmp_path / "r.bin", [slo_pb2.ReportWindowsRequest(windows=windows[:10], requests=requests),
                                       slo_pb2.ReportWindowsRequest(windows=windows[10:])])
    assert read_records(tmp_path / "r.bin") == (windows, requests)
    (tmp_path / "bad.bin").write_bytes(b"\x02\x00\x00\x00\xff\xff")
    with pytest.raises(ValueError, match="not a windows record"):
        read_records(tmp_path / "bad.bin")


@pytest.mark.parametrize("field, value, message", [
    ("ttft_p99_ms", math.nan, "windows[0].ttft_p99_ms: must be a finite number >= 0, got nan"),
    ("itl_p50_ms", -1.0, "windows[0].itl_p50_ms: must be a finite number >= 0, got -1.0"),
    ("kv_used_fraction", 1.5, "kv_used_fraction and .utilization: must be within 0..1"),
    ("sla_class", 0, "windows[0].sla_class: must be REALTIME, INTERACTIVE or BATCH, got 0"),
    ("model", "", "windows[0].model and .worker: must not be empty"),
])
def test_bad_windows_name_the_field(field, value, message):
    w = simulate(1)[0][0]
    setattr(w, field, value)
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        validate_window(w, "windows[0]")


def test_forecaster_learns_the_queue_and_beats_the_baseline():
    windows, requests = simulate(900)
    ev, fc, lm = evaluate(windows, requests, horizon_s=30, train_fraction=0.7)
    assert ev.test_positives > 0 and ev.onsets >= 2
    assert ev.auc > 0.85 and ev.auc > ev.baseline_auc
    assert ev.median_lead_s >= 10
    assert ev.ttft_mape < 0.5 and lm.is_trained


def test_too_little_history_says_so():
    with pytest.raises(Untrained, match="too little history: 30 labelled samples, need 120"):
        Forecaster().fit(forecast_data(simulate(60)[0], horizon_s=30))
    quiet = [w for w in simulate(400)[0]]
    for w in quiet:  # never above target
        w.ttft_p99_ms = 10
    with pytest.raises(Untrained, match="preceded a violation"):
        Forecaster().fit(forecast_data(quiet, horizon_s=30))
    with pytest.raises(Untrained, match="too few request observations"):
        LatencyModel().fit(np.zeros((3, len(LATENCY_FEATURES))), np.zeros(3), np.zeros(3))


def test_models_round_trip_through_xgboost_json_and_a_corrupt_file_means_untrained(tmp_path, caplog):
    windows, requests = simulate(400)
    data = forecast_data(windows, 30)
    fc = Forecaster(horizon_s=30)
    fc.fit(data)
    lm = LatencyModel()
    X, lt, lp, _ = latency_data(windows, requests)
    lm.fit(X, lt, lp)
    fc.save(tmp_path)
    lm.save(tmp_path)
    assert (tmp_path / "forecast.json").read_text().startswith("{")  # XGBoost's JSON, not a pickle
    fc2, lm2 = Forecaster.load(tmp_path, 30), LatencyModel.load(tmp_path)
    assert np.array_equal(fc.predict(data.X[:50]), fc2.predict(data.X[:50]))
    for mine, loaded in zip(lm.predict(X[:20]), lm2.predict(X[:20])):  # typical TTFT, TPOT and TTFT's p90
        assert np.array_equal(mine, loaded)
    assert np.all(lm.predict(X[:20])[2] >= lm.predict(X[:20])[0])  # the 90th percentile above the typical value here
    meta = json.loads((tmp_path / "latency.meta.json").read_text())
    (tmp_path / "latency.meta.json").write_text(json.dumps({**meta, "target": "log1p ms, squared error"}))
    assert "another target" in LatencyModel.load(tmp_path).untrained_reason  # a model fit to something else: retrain
    (tmp_path / "latency.meta.json").write_text(json.dumps(meta))
    names = [n for n, _ in fc2.explain(data.X[-1])]
    assert len(names) == 5 and set(names) <= set(F.FEATURES)
    assert "other features or horizon" in Forecaster.load(tmp_path, 60).untrained_reason
    (tmp_path / "forecast.json").write_text("{not xgboost")
    broken = Forecaster.load(tmp_path, 30)
    assert not broken.is_trained and "unreadable" in broken.untrained_reason and "unreadable" in caplog.text
    assert Forecaster.load(tmp_path / "missing", 30).untrained_reason == "no history yet"


def test_auc_and_lead_time_helpers():
    assert roc_auc(np.array([0, 0, 1, 1], bool), np.array([0.1, 0.4, 0.35, 0.8])) == 0.75
    assert roc_auc(np.array([1, 1], bool), np.array([0.1, 0.2])) != roc_auc(np.array([1, 1], bool), np.array([0.1, 0.2]))  # NaN
    windows = simulate(200)[0]
    data = forecast_data(windows, 30)
    perfect = data.y.astype(float)  # a score that is exactly the label foresees every onset by the full horizon
    leads = lead_times(data, perfect, 0.5, 30)
    assert leads and all(lead == 30 for lead in leads)


def test_history_pages_by_time_without_losing_or_repeating_anything():
    windows, requests = simulate(300)
    h = History(None)
    h.add(windows, requests)
    got_w, got_r, since, pages = [], [], 0, 0
    while True:
        w, r, since = h.since(since, max_windows=70)
        got_w += w
        got_r += r
        pages += 1
        assert len(w) <= 70
        if not since:
            break
    assert pages > 4 and got_w == windows and sorted(got_r, key=lambda r: r.start_unix_ms) == sorted(requests, key=lambda r: r.start_unix_ms)


def _series(seconds: int, violating: set[int], scores: dict[int, float]):
    """One (model, class) series of `seconds` seconds: the violating seconds and each second's forecast score."""
    import numpy as np

    from cotserve.slo.model import ForecastData

    t = np.arange(seconds, dtype=np.int64) * 1000
    viol = np.array([s in violating for s in range(seconds)])
    score = np.array([scores.get(s, 0.0) for s in range(seconds)])
    return ForecastData(np.zeros((seconds, 1)), viol, t, [("m", 1)] * seconds, score, viol), score


def test_event_metrics_count_episodes_not_seconds():
    """Two violation episodes (each 20 s long: per second they would count 40 times) and one spurious alarm:
    the first onset foreseen 15 s ahead, the second 5 s; the alarm at 500-505 s has no violation within the
    horizon after it, the alarms before the onsets do; 3,600 s of series is one hour."""
    from cotserve.slo.model import event_metrics

    violating = set(range(100, 120)) | set(range(300, 320))
    scores = {s: 0.9 for s in [*range(85, 120), *range(295, 320), *range(500, 506)]}
    data, score = _series(3600, violating, scores)
    ev = event_metrics(data, score, threshold=0.7, horizon_s=30)
    assert (ev.onsets, ev.forecast_ahead, ev.false_alarms) == (2, 1, 1)
    assert ev.share_ahead == 0.5 and ev.false_alarms_per_hour == 1.0 and ev.median_lead_s == 10.0
    # a forecast that never alarms: nothing foreseen, no false alarm; one that always alarms: every onset foreseen
    # (leads capped at the horizon) and its one long alarm ran into violations, so it is not false
    quiet = event_metrics(data, score * 0, 0.7, 30)
    assert (quiet.onsets, quiet.forecast_ahead, quiet.false_alarms, quiet.median_lead_s) == (2, 0, 0, 0.0)
    loud = event_metrics(data, score * 0 + 1, 0.7, 30)
    assert (loud.forecast_ahead, loud.false_alarms, loud.median_lead_s) == (2, 0, 30.0)


def test_the_evaluation_reports_events_for_the_forecast_and_the_baseline():
    windows, requests = simulate(900)
    ev, _, _ = evaluate(windows, requests, horizon_s=30, train_fraction=0.7)
    assert ev.events.onsets == ev.onsets and ev.baseline_events.onsets == ev.onsets
    assert ev.events.median_lead_s == ev.median_lead_s
    assert 0 <= ev.events.share_ahead <= 1 and ev.events.hours > 0


def held_out_mape_with_and_without(windows, requests, columns: tuple[str, ...]) -> tuple[float, float]:
    """TTFT MAPE on the last 30% of the requests of a latency model fit on the first 70%, with every feature and
    with `columns` zeroed."""
    X, lt, lp, ts = latency_data(windows, requests)
    split = np.quantile(ts, 0.7)
    train, test = ts < split, ts >= split

    def fitted_mape(columns_off: tuple[str, ...]) -> float:
        Xm = X.copy()
        for name in columns_off:
            Xm[:, LATENCY_FEATURES.index(name)] = 0
        col = {name: Xm[:, LATENCY_FEATURES.index(name)] for name in LATENCY_FEATURES}
        Xm[:, ESTIMATE] = [ttft_estimate_ms(*args) for args in zip(col["w_step_ms"], col["waiting_ahead"], col["queued_ahead"],
                                                                     col["w_first_tokens"])]  # without them too
        lm = LatencyModel()
        lm.fit(Xm[train], lt[train], lp[train])
        return mape(np.expm1(lt[test]), lm.predict(Xm[test])[0])

    return fitted_mape(()), fitted_mape(columns)


def test_the_place_in_the_prefill_line_is_what_predicts_ttft_when_the_window_cannot():
    """On a worker whose TTFT is the prefill line ahead of each request, the latency model learns it from the
    request's place in line (prompt tokens ahead, sent by the gateway), and the evaluation reports MAPE by load."""
    from tests.slo.synth import simulate_prefill

    windows, requests = simulate_prefill(600)
    with_line, without = held_out_mape_with_and_without(windows, requests, ("waiting_ahead", "prefill_tokens_ahead",
                                                                            "prefill_tokens_to_first"))
    print(f"TTFT MAPE with the place in line {with_line:.3f}, without {without:.3f}")
    assert with_line <= 0.10 and without >= 2 * with_line, (with_line, without)
    ev, _, _ = evaluate(windows, requests, train_fraction=0.7)
    assert ev.ttft_mape <= 0.10
    assert [name.split(" ")[0] for name, _, _ in ev.ttft_mape_by_load] == ["light", "medium", "heavy"]
    assert sum(n for _, n, _ in ev.ttft_mape_by_load) == ev.latency_test_requests


def test_blocked_cross_validation_holds_out_every_onset_once_without_peeking():
    from cotserve.slo.model import event_metrics, evaluate_folds

    windows, requests = simulate(900)
    folded = evaluate_folds(windows, folds=5)
    everything = forecast_data(windows, 30)
    every_onset = event_metrics(everything, np.zeros(len(everything.y)), 0.7, 30).onsets
    single, _, _ = evaluate(windows, requests, horizon_s=30, train_fraction=0.7)
    assert folded.folds_trained == 5 and folded.events.onsets == every_onset > single.onsets  # all of them, not the last 30%
    assert folded.auc > 0.85 and folded.auc > folded.baseline_auc
    assert folded.events.forecast_ahead >= folded.events.onsets // 2
    # the baseline's threshold, chosen on each fold's training rows, alarms all the time here: it "foresees" every
    # onset, which only the share of time in alarm shows
    assert 0 < folded.events.alarm_share < folded.baseline_events.alarm_share == 1.0
    with pytest.raises(Untrained):
        evaluate_folds([], folds=5)


def test_the_workers_own_batch_and_step_time_predict_ttft_when_this_gateway_sent_it_little():
    """A worker busy with load that did not come through this gateway: its Stats in the window (running batch, step
    time) carry what this gateway's own sparse TTFT samples miss."""
    from tests.slo.synth import simulate_background

    windows, requests = simulate_background(900)
    with_stats, without = held_out_mape_with_and_without(windows, requests, ("w_running", "w_step_ms", "w_gen_tokens_per_s",
                                                                             "steps_ahead_ms"))
    print(f"TTFT MAPE with the worker's batch and step time {with_stats:.3f}, without {without:.3f}")
    assert with_stats <= 0.10 and without >= 2 * with_stats, (with_stats, without)


def test_the_typical_ttft_trees_are_the_larger_size_and_tpots_and_the_routing_trees_the_smaller():
    """TTFT's typical-value booster is fit with `TTFT_TREES` (200 trees up to depth 8); TPOT's and the p90 trees the
    gateway evaluates per candidate keep 120 trees up to depth 5."""
    from tests.slo.synth import simulate_prefill

    from cotserve.slo.model import TTFT_TREES

    windows, requests = simulate_prefill(300)
    X, log_ttft, log_tpot, _ = latency_data(windows, requests)
    lm = LatencyModel()
    lm.fit(X, log_ttft, log_tpot)

    def size(booster) -> tuple[int, int]:
        trees = json.loads(booster.save_raw("json"))["learner"]["gradient_booster"]["model"]["trees"]
        return len(trees), int(json.loads(booster.save_config())["learner"]["gradient_booster"]["tree_train_param"]["max_depth"])

    assert size(lm.ttft) == (TTFT_TREES["rounds"], TTFT_TREES["max_depth"]) == (200, 8)
    assert size(lm.ttft_p90) == (120, 5) and size(lm.tpot) == (120, 5)
