"""The predictor's two learners, both XGBoost, both saved in XGBoost's own JSON format (never pickle):

- the *forecaster*: a classifier of "this class misses its target within the horizon" over the
  features of `features.py`, with per-prediction contributions (SHAP values) for the why;
- the *latency model*: two regressors, TTFT and time per output token of one request, from the
  request (prompt tokens, max new tokens, class) and its worker's state in the second before it
  started (as llm-d's latency predictor does per candidate pod).

Plus the offline evaluation both `cotserve slo train` and `cotserve bench slo` print: ROC-AUC,
precision and recall at the threshold, median lead time, the same for a queue-depth baseline,
and the latency models' MAPE, always on a later, held-out stretch of time.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from cotserve.common.latency import ESTIMATE, LATENCY_FEATURES, TTFT_TARGET, latency_row
from cotserve.common.sla import DEFAULT_SLA_TARGETS
from cotserve.common.windows import worker_total
from cotserve.slo import features as F

log = logging.getLogger("cotserve.slo")

MIN_LABELLED = 120      # labelled (class, second) samples before a forecast is trusted
MIN_POSITIVES = 5       # ... of which this many preceded a violation
MIN_REQUESTS = 50       # request observations before latency predictions are trusted


class Untrained(Exception):
    """Not enough (or not the right) history; the message says what is missing."""


# -- datasets ----------------------------------------------------------------------------------

@dataclass(slots=True)
class ForecastData:
    X: np.ndarray
    y: np.ndarray
    t_ms: np.ndarray          # second of each row
    key: list[tuple[str, int]]  # (model, class index) of each row
    baseline: np.ndarray      # the queue-depth baseline's score
    violation: np.ndarray     # whether that row's own second violated (for lead times)


def forecast_data(windows, horizon_s: int, targets=DEFAULT_SLA_TARGETS, until_ms: int | None = None) -> ForecastData:
    """Every labelled (model, class, second) of the history; with `until_ms`, only rows whose
    horizon ends before it (so a training stretch never peeks past its end)."""
    by_model = defaultdict(list)
    for w in windows:
        by_model[w.model].append(w)
    parts = []
    for model, ws in sorted(by_model.items()):
        s = F.build_series(ws)
        feats, viol = F.feature_matrix(s, targets), F.violations(s, targets)
        lab, valid = F.labels(viol, horizon_s)
        t_ms = s.t0_ms + 1000 * np.arange(s.n)
        ok = valid
        if until_ms is not None:
            ok = ok & (t_ms + horizon_s * 1000 < until_ms)
        base = F.baseline_score(s)
        for c in range(3):
            active = F._sum(s.reported[c], F.LOOKBACK_S) > 0  # the class was reported in the last minute
            idx = np.nonzero(ok & active)[0]
            parts.append((feats[c, idx], lab[c, idx], t_ms[idx], [(model, c)] * len(idx), base[idx], viol[c, idx]))
    if not parts:
        return ForecastData(np.zeros((0, len(F.FEATURES))), np.zeros(0, bool), np.zeros(0, np.int64), [], np.zeros(0), np.zeros(0, bool))
    return ForecastData(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                        np.concatenate([p[2] for p in parts]), [k for p in parts for k in p[3]],
                        np.concatenate([p[4] for p in parts]), np.concatenate([p[5] for p in parts]))


def latency_data(windows, requests) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(X, log TTFT, log TPOT (NaN when undefined), start ms) for every request whose worker
    reported a window in the second before it started."""
    by_second = defaultdict(list)
    for w in windows:
        by_second[(w.worker, w.start_unix_ms // 1000 * 1000)].append(w)
    X, ttft, tpot, t = [], [], [], []
    for r in requests:
        ws = by_second.get((r.worker, r.start_unix_ms // 1000 * 1000 - 1000))
        if not ws:
            continue
        state = worker_total(ws)
        state.in_flight, state.queue_depth = r.in_flight_at_start, r.queued_at_start  # as the gateway saw it then
        state.waiting_for_first_token, state.prefill_tokens_ahead = r.waiting_for_first_token_at_start, r.prefill_tokens_ahead_at_start
        state.queued_ahead = r.queued_ahead_at_start
        state.oldest_wait_ms, state.silent_ms = r.oldest_wait_ms_at_start, r.silent_ms_at_start
        state.seat_wait_tokens = r.seat_wait_tokens_at_start
        X.append(latency_row(r.prompt_tokens, r.max_new_tokens, r.sla_class, state))
        ttft.append(math.log1p(r.ttft_ms))
        tpot.append(math.log1p(r.tpot_ms) if r.completion_tokens > 1 and r.tpot_ms > 0 else math.nan)
        t.append(r.start_unix_ms)
    return np.array(X).reshape(-1, len(LATENCY_FEATURES)), np.array(ttft), np.array(tpot), np.array(t)


# -- metrics -----------------------------------------------------------------------------------

def roc_auc(y: np.ndarray, score: np.ndarray) -> float:
    """Mann-Whitney AUC with tied scores sharing their average rank; NaN with one class only."""
    y = np.asarray(y, bool)
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return math.nan
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    s = np.asarray(score)[order]
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i: j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def precision_recall(y: np.ndarray, score: np.ndarray, threshold: float) -> tuple[float, float]:
    pred = score >= threshold
    tp = int((pred & y).sum())
    return (tp / pred.sum() if pred.sum() else math.nan, tp / y.sum() if y.sum() else math.nan)


def _per_key(data: ForecastData, score: np.ndarray, threshold: float):
    """Each (model, class) series of `data` in time order: its seconds, above-threshold flags and violations."""
    keys = np.array([f"{m}\0{c}" for m, c in data.key]) if data.key else np.array([])
    for key in np.unique(keys):
        idx = np.nonzero(keys == key)[0]
        idx = idx[np.argsort(data.t_ms[idx])]
        t = (data.t_ms[idx] // 1000).astype(np.int64).tolist()
        yield t, dict(zip(t, (score[idx] >= threshold).tolist())), dict(zip(t, data.violation[idx].tolist()))


ONSET_QUIET_S = 10
"""A violation onset is a violating second with no violation in the seconds before it (an episode's start)."""


def lead_times(data: ForecastData, score: np.ndarray, threshold: float, horizon_s: int) -> list[float]:
    """Per violation onset (a violating second with none in the 10 s before): seconds from the
    start of the run of above-threshold scores that reaches the second before it (0: not foreseen)."""
    leads = []
    for t, above, viol in _per_key(data, score, threshold):
        for sec in t:
            if not viol[sec] or any(viol.get(sec - k, False) for k in range(1, ONSET_QUIET_S + 1)):
                continue
            lead = 0
            while lead < horizon_s and above.get(sec - lead - 1, False):
                lead += 1
            leads.append(float(lead))
    return leads


@dataclass(slots=True, frozen=True)
class EventMetrics:
    """The forecast judged by episodes, not seconds (a violation lasts many seconds, so per-second figures count
    one episode many times): violation onsets, the share of them forecast at least `ahead_s` ahead, and alarms
    (runs of above-threshold seconds) that no violation followed within the horizon, per hour of series."""

    onsets: int
    forecast_ahead: int
    false_alarms: int
    hours: float
    median_lead_s: float
    alarm_share: float = math.nan  # of the seconds, the share in alarm (an always-on alarm foresees every onset)

    @property
    def share_ahead(self) -> float:
        return self.forecast_ahead / self.onsets if self.onsets else math.nan

    @property
    def false_alarms_per_hour(self) -> float:
        return self.false_alarms / self.hours if self.hours else math.nan


def event_metrics(data: ForecastData, score: np.ndarray, threshold: float, horizon_s: int,
                  ahead_s: int = 10) -> EventMetrics:
    leads = lead_times(data, score, threshold, horizon_s)
    false_alarms, seconds, alarmed = 0, 0, 0
    for t, above, viol in _per_key(data, score, threshold):
        seconds += len(t)
        alarmed += sum(above.values())
        start = None
        for sec in [*t, None]:  # None closes a run still open at the end
            if sec is not None and above[sec]:
                start = sec if start is None else start
                continue
            if start is not None:
                end = sec if sec is not None else t[-1] + 1  # the run covered start .. end - 1
                if not any(viol.get(s, False) for s in range(start, end + horizon_s)):
                    false_alarms += 1
                start = None
    return EventMetrics(len(leads), sum(lead >= ahead_s for lead in leads), false_alarms, seconds / 3600,
                        float(np.median(leads)) if leads else math.nan, alarmed / seconds if seconds else math.nan)


def pooled_events(results: list, which: str = "events") -> tuple[int, int, float, float, float]:
    """(onsets, foreseen >= 10 s ahead, their share, Wilson 95% low, high) summed over `results` (evaluations of
    several runs: anything with `events` / `baseline_events`), `which` naming the forecast's or the baseline's."""
    from cotserve.common.stats import wilson_interval95

    onsets = sum(getattr(r, which).onsets for r in results)
    ahead = sum(getattr(r, which).forecast_ahead for r in results)
    lo, hi = wilson_interval95(ahead, onsets)
    return onsets, ahead, ahead / onsets if onsets else math.nan, lo, hi


def best_threshold(y: np.ndarray, score: np.ndarray) -> float:
    """The score threshold with the best F1 (for the baseline, chosen on the training stretch)."""
    best, best_f1 = float(np.max(score)) if len(score) else 0.0, -1.0
    for thr in np.unique(score):
        p, r = precision_recall(y, score, thr)
        if not (math.isnan(p) or math.isnan(r)) and p + r > 0 and 2 * p * r / (p + r) > best_f1:
            best, best_f1 = float(thr), 2 * p * r / (p + r)
    return best


def mape(true_ms: np.ndarray, pred_ms: np.ndarray) -> float:
    ok = true_ms > 0
    return float(np.mean(np.abs(pred_ms[ok] - true_ms[ok]) / true_ms[ok])) if ok.any() else math.nan


def mape_by_load(X: np.ndarray, true_ms: np.ndarray, pred_ms: np.ndarray) -> list[tuple[str, int, float]]:
    """TTFT MAPE of held-out requests by load level: the worker's requests in flight when each was sent (this gateway's
    count), split at its terciles into light, medium and heavy (fewer levels when the counts do not spread)."""
    load = X[:, LATENCY_FEATURES.index("w_in_flight")]
    if not len(load):
        return []
    cuts = sorted(set(np.quantile(load, [1 / 3, 2 / 3]).tolist()))
    level = np.searchsorted(cuts, load, side="right")  # 0 .. len(cuts)
    out = []
    for i, name in enumerate(("light", "medium", "heavy")[: len(cuts) + 1]):
        rows = level == i
        if rows.any():
            lo, hi = int(load[rows].min()), int(load[rows].max())
            out.append((f"{name} ({lo}-{hi} in flight)", int(rows.sum()), mape(true_ms[rows], pred_ms[rows])))
    return out


# -- the learners ------------------------------------------------------------------------------

def _train_booster(X: np.ndarray, y: np.ndarray, names, objective: str, rounds: int, weight: np.ndarray | None = None,
                   **params):
    import xgboost as xgb

    dtrain = xgb.DMatrix(X, label=y, weight=weight, feature_names=list(names))
    p = {"objective": objective, "max_depth": 4, "eta": 0.1, "subsample": 0.9, "colsample_bytree": 0.9,
         "min_child_weight": 2, "nthread": 1, "seed": 0, **params}
    return xgb.train(p, dtrain, num_boost_round=rounds)


@dataclass
class Forecaster:
    booster: object = None
    horizon_s: int = 30
    trained_at: float = 0.0
    samples: int = 0
    positives: int = 0
    untrained_reason: str = "no history yet"

    @property
    def is_trained(self) -> bool:
        return self.booster is not None

    def fit(self, data: ForecastData) -> None:
        n, pos = len(data.y), int(data.y.sum())
        if n < MIN_LABELLED:
            raise Untrained(f"too little history: {n} labelled samples, need {MIN_LABELLED}")
        if pos < MIN_POSITIVES:
            raise Untrained(f"only {pos} samples preceded a violation (need {MIN_POSITIVES}): nothing to learn from yet")
        weight = min(20.0, max(1.0, (n - pos) / pos))
        self.booster = _train_booster(data.X, data.y.astype(float), F.FEATURES, "binary:logistic", 150, scale_pos_weight=weight)
        self.trained_at, self.samples, self.positives, self.untrained_reason = time.time(), n, pos, ""

    def predict(self, X: np.ndarray) -> np.ndarray:
        import xgboost as xgb

        return self.booster.predict(xgb.DMatrix(X, feature_names=list(F.FEATURES)))

    def explain(self, x: np.ndarray, top: int = 5) -> list[tuple[str, float]]:
        """The features that pushed this prediction most (contributions to the log-odds)."""
        import xgboost as xgb

        contribs = self.booster.predict(xgb.DMatrix(x[None, :], feature_names=list(F.FEATURES)), pred_contribs=True)[0][:-1]
        order = np.argsort(-np.abs(contribs))[:top]
        return [(F.FEATURES[i], float(contribs[i])) for i in order]

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.booster.save_model(str(folder / "forecast.json"))
        meta = {"features": list(F.FEATURES), "horizon_s": self.horizon_s, "trained_at": self.trained_at,
                "samples": self.samples, "positives": self.positives}
        (folder / "forecast.meta.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, folder: Path, horizon_s: int) -> Forecaster:
        """The saved forecaster, or an untrained one saying why (missing, corrupt, other features or horizon)."""
        import xgboost as xgb

        path = folder / "forecast.json"
        if not path.exists():
            return cls(horizon_s=horizon_s, untrained_reason="no history yet")
        try:
            meta = json.loads((folder / "forecast.meta.json").read_text())
            if meta["features"] != list(F.FEATURES) or meta["horizon_s"] != horizon_s:
                return cls(horizon_s=horizon_s, untrained_reason=f"the saved model {path} has other features or horizon: retraining")
            booster = xgb.Booster()
            booster.load_model(str(path))
            return cls(booster, horizon_s, meta["trained_at"], meta["samples"], meta["positives"], "")
        except Exception as exc:  # noqa: BLE001 - any unreadable model means: start untrained, say so
            log.error("forecast model %s is unreadable (%s): starting untrained", path, exc)
            return cls(horizon_s=horizon_s, untrained_reason=f"the saved model {path} is unreadable ({exc}): retraining")


LATENCY_TARGET = f"TTFT: {TTFT_TARGET}, TPOT: ms; absolute error weighted by 1/value, and TTFT's p90 for routing"
"""What the saved latency boosters predict (a saved model of another target is not loaded)."""
TAIL_QUANTILE = 0.9


def _fit_relative(X: np.ndarray, ms: np.ndarray, scale: np.ndarray | float = 1.0, **params):
    """A booster predicting `ms / scale` (TPOT in ms, or TTFT as a multiple of its estimate), fit to the relative error
    of `ms` it is judged by (MAPE, the same for any positive scale): absolute error weighted by 1 / the true value (at
    least 1 ms), whose minimiser is that weighted median (below the median when the noise is skewed, as TTFT's is).
    The weights are scaled to mean 1, so min_child_weight keeps meaning rows. Chosen over squared error on log(1 + ms),
    whose held-out MAPE was higher on `cotserve bench slo-routing`'s recordings. `params` override the trees' size (`TTFT_TREES` for TTFT)."""
    weight = scale / np.maximum(ms, 1.0)
    return _train_booster(X, ms / scale, LATENCY_FEATURES, "reg:absoluteerror", params.pop("rounds", 120),
                          weight=weight / weight.mean(), **{"max_depth": 5, **params})


TTFT_TREES = {"rounds": 200, "max_depth": 8, "min_child_weight": 5, "subsample": 0.8}
"""The typical-TTFT booster's size: deeper than TPOT's, whose held-out error the larger size does not lower (`cotserve
bench slo` reports both models' held-out MAPE). Only `PredictLatency` and the evaluation use it: the gateway routes by the p90 trees, which it evaluates in Python
per candidate, and those stay small."""


def _fit_tail(X: np.ndarray, ratio: np.ndarray):
    """A booster predicting the `TAIL_QUANTILE` quantile of TTFT as a multiple of its estimate (a quantile of the ratio
    times the row's estimate is that quantile of TTFT): what routing minimises. The MAPE-fit model predicts low where
    TTFT is noisy, and a slowed worker's TTFT is noisier than the others': routed by it, a slowed worker would get
    more requests than least-loaded routing sends it (`cotserve bench slo-routing` compares the two)."""
    return _train_booster(X, ratio, LATENCY_FEATURES, "reg:quantileerror", 120, max_depth=5, quantile_alpha=TAIL_QUANTILE)


_BOOSTERS = ("ttft", "ttft_p90", "tpot")  # saved as <name>.json


@dataclass
class LatencyModel:
    ttft: object = None      # typical TTFT (fit to relative error)
    tpot: object = None
    samples: int = 0
    untrained_reason: str = "no request observations yet"
    ttft_p90: object = None  # TTFT's 90th percentile (routing)

    @property
    def is_trained(self) -> bool:
        return self.ttft is not None and self.ttft_p90 is not None

    def fit(self, X: np.ndarray, log_ttft: np.ndarray, log_tpot: np.ndarray) -> None:
        if len(X) < MIN_REQUESTS:
            raise Untrained(f"too few request observations: {len(X)}, need {MIN_REQUESTS}")
        ttft, estimate = np.expm1(log_ttft), X[:, ESTIMATE]  # the estimate is at least 1 ms
        self.ttft, self.ttft_p90 = _fit_relative(X, ttft, estimate, **TTFT_TREES), _fit_tail(X, ttft / estimate)
        ok = ~np.isnan(log_tpot)
        self.tpot = _fit_relative(X[ok], np.expm1(log_tpot[ok])) if ok.sum() >= 10 else None
        self.samples, self.untrained_reason = len(X), ""

    def predict(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(TTFT ms, TPOT ms, TTFT p90 ms) per row (TPOT 0 when no model for it)."""
        import xgboost as xgb

        d = xgb.DMatrix(X, feature_names=list(LATENCY_FEATURES))
        tpot = self.tpot.predict(d) if self.tpot is not None else np.zeros(len(X))
        estimate = X[:, ESTIMATE]
        return (np.maximum(self.ttft.predict(d), 0) * estimate, np.maximum(tpot, 0),
                np.maximum(self.ttft_p90.predict(d), 0) * estimate)

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for name in _BOOSTERS:
            if getattr(self, name) is not None:
                getattr(self, name).save_model(str(folder / f"{name}.json"))
        (folder / "latency.meta.json").write_text(json.dumps({"features": list(LATENCY_FEATURES), "samples": self.samples,
                                                              "target": LATENCY_TARGET}))

    @classmethod
    def load(cls, folder: Path) -> LatencyModel:
        import xgboost as xgb

        if not (folder / "ttft.json").exists():
            return cls()
        try:
            meta = json.loads((folder / "latency.meta.json").read_text())
            if meta["features"] != list(LATENCY_FEATURES) or meta.get("target") != LATENCY_TARGET:
                return cls(untrained_reason="the saved latency model has other features or another target: retraining")
            boosters = {}
            for name in _BOOSTERS:
                if (folder / f"{name}.json").exists():
                    boosters[name] = xgb.Booster()
                    boosters[name].load_model(str(folder / f"{name}.json"))
            return cls(samples=meta["samples"], untrained_reason="", **boosters)
        except Exception as exc:  # noqa: BLE001
            log.error("latency model in %s is unreadable (%s): starting untrained", folder, exc)
            return cls(untrained_reason=f"the saved latency model is unreadable ({exc}): retraining")


# -- offline evaluation ------------------------------------------------------------------------

@dataclass
class Evaluation:
    train_until_ms: int
    train_samples: int
    test_samples: int
    test_positives: int
    auc: float
    precision: float
    recall: float
    median_lead_s: float
    onsets: int
    baseline_auc: float
    baseline_precision: float
    baseline_recall: float
    baseline_median_lead_s: float
    baseline_threshold: float
    ttft_mape: float
    tpot_mape: float
    latency_test_requests: int
    threshold: float = 0.7
    notes: list[str] = field(default_factory=list)
    events: EventMetrics | None = None           # the forecast by episodes (see EventMetrics)
    baseline_events: EventMetrics | None = None
    ttft_mape_by_load: list[tuple[str, int, float]] = field(default_factory=list)  # (load level, requests, MAPE)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True, frozen=True)
class FoldedEvaluation:
    """The forecast judged on every part of a recording in turn (`evaluate_folds`)."""

    folds: int
    folds_trained: int
    auc: float
    baseline_auc: float
    events: EventMetrics
    baseline_events: EventMetrics


def _subset(data: ForecastData, rows: np.ndarray) -> ForecastData:
    return ForecastData(data.X[rows], data.y[rows], data.t_ms[rows], [k for k, keep in zip(data.key, rows) if keep],
                        data.baseline[rows], data.violation[rows])


def evaluate_folds(windows, folds: int = 5, horizon_s: int = 30, threshold: float = 0.7,
                   targets=DEFAULT_SLA_TARGETS) -> FoldedEvaluation:
    """Blocked cross-validation over time: the span is cut into `folds` contiguous blocks and each is forecast by a
    model trained on the rest, leaving out the rows whose label horizon or feature lookback reaches into the block
    (no peeking either way). Every violation onset of the recording is then held out once, where a single 70/30
    split holds out one or two cycles' worth. Features and labels come from the whole series, so a block's edges
    are computed as in serving. A fold whose training part has too few violations is left out (counted)."""
    everything = forecast_data(windows, horizon_s, targets)
    if not len(everything.y):
        raise Untrained("no windows to learn from")
    t0, t1 = int(everything.t_ms.min()), int(everything.t_ms.max()) + 1000
    edges = np.linspace(t0, t1, folds + 1)
    score = np.full(len(everything.y), np.nan)
    alarm = np.zeros(len(everything.y))  # the baseline above its threshold, chosen on each fold's training rows
    trained = 0
    for lo, hi in zip(edges[:-1], edges[1:]):
        test = (everything.t_ms >= lo) & (everything.t_ms < hi)
        train = (everything.t_ms + horizon_s * 1000 < lo) | (everything.t_ms - F.LOOKBACK_S * 1000 >= hi)
        fc = Forecaster(horizon_s=horizon_s)
        try:
            fc.fit(_subset(everything, train))
        except Untrained:
            continue
        trained += 1
        if test.any():
            score[test] = fc.predict(everything.X[test])
            alarm[test] = everything.baseline[test] >= best_threshold(everything.y[train], everything.baseline[train])
    held = ~np.isnan(score)
    if not held.any():
        raise Untrained(f"no fold of {folds} had enough violations to train on")
    data = _subset(everything, held)
    return FoldedEvaluation(folds, trained, roc_auc(data.y, score[held]), roc_auc(data.y, data.baseline),
                            event_metrics(data, score[held], threshold, horizon_s),
                            event_metrics(data, alarm[held], 0.5, horizon_s))


@dataclass(slots=True, frozen=True)
class HeldOutLatency:
    """The latency model's errors on the requests after a split (`held_out_latency`)."""

    requests: int = 0
    ttft_mape: float = math.nan
    tpot_mape: float = math.nan
    by_load: list[tuple[str, int, float]] = field(default_factory=list)  # TTFT MAPE by load level (`mape_by_load`)


def held_out_latency(X: np.ndarray, log_ttft: np.ndarray, log_tpot: np.ndarray, t_ms: np.ndarray,
                     split_ms: float) -> tuple[LatencyModel, HeldOutLatency]:
    """Fit a latency model on the requests (`latency_data`'s arrays) started before `split_ms` and measure it on the
    rest; raises Untrained when the part before is too small."""
    lm = LatencyModel()
    before, after = t_ms < split_ms, t_ms >= split_ms
    lm.fit(X[before], log_ttft[before], log_tpot[before])
    if not after.any():
        return lm, HeldOutLatency()
    pt, pp, _ = lm.predict(X[after])
    truth = np.expm1(log_ttft[after])
    ok = ~np.isnan(log_tpot[after])
    tpot = mape(np.expm1(log_tpot[after][ok]), pp[ok]) if lm.tpot is not None and ok.any() else math.nan
    return lm, HeldOutLatency(int(after.sum()), mape(truth, pt), tpot, mape_by_load(X[after], truth, pt))


def evaluate(windows, requests, horizon_s: int = 30, train_fraction: float = 0.7, threshold: float = 0.7,
             targets=DEFAULT_SLA_TARGETS) -> tuple[Evaluation, Forecaster, LatencyModel]:
    """Fit on the first `train_fraction` of the time span, evaluate on the rest."""
    windows, requests = list(windows), list(requests)
    if not windows:
        raise Untrained("no windows to learn from")
    t0 = min(w.start_unix_ms for w in windows)
    t1 = max(w.start_unix_ms for w in windows)
    split = int(t0 + train_fraction * (t1 - t0))
    train = forecast_data([w for w in windows if w.start_unix_ms < split], horizon_s, targets, until_ms=split)
    everything = forecast_data(windows, horizon_s, targets)
    test_rows = everything.t_ms >= split
    test = ForecastData(everything.X[test_rows], everything.y[test_rows], everything.t_ms[test_rows],
                        [k for k, keep in zip(everything.key, test_rows) if keep], everything.baseline[test_rows],
                        everything.violation[test_rows])
    fc = Forecaster(horizon_s=horizon_s)
    fc.fit(train)
    score = fc.predict(test.X) if len(test.y) else np.zeros(0)
    p, r = precision_recall(test.y, score, threshold)
    events = event_metrics(test, score, threshold, horizon_s)
    bthr = best_threshold(train.y, train.baseline)
    bp, br = precision_recall(test.y, test.baseline, bthr)
    bevents = event_metrics(test, test.baseline, bthr, horizon_s)

    latency = latency_data(windows, requests)
    lm, held = LatencyModel(), HeldOutLatency(int((latency[3] >= split).sum()))  # untrained: the count still stands
    notes = []
    try:
        lm, held = held_out_latency(*latency, split)
    except Untrained as exc:
        notes.append(f"latency model: {exc}")
    ev = Evaluation(split, len(train.y), len(test.y), int(test.y.sum()), roc_auc(test.y, score), p, r,
                    events.median_lead_s, events.onsets, roc_auc(test.y, test.baseline), bp, br, bevents.median_lead_s,
                    bthr, held.ttft_mape, held.tpot_mape, held.requests, threshold, notes, events, bevents, held.by_load)
    return ev, fc, lm
