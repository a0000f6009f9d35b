"""From metric windows to per-second series, violation labels and features.

Windows arrive per second per (model, worker, SLA class). For forecasting, a model's windows are
merged per second and class (counts and queues summed over workers, latency percentiles the
worst worker's, occupancy and utilisation averaged), giving dense arrays `[class, second]`.

- A class *violates* in a second when requests got their first token then and its TTFT p99 was
  above the class's TTFT target, or its inter-token p95 above its ITL target (the gateway's SLA
  targets: realtime 250/50 ms, interactive 1000/100 ms, batch 30000/1000 ms by default).
- The *label* of (class, second t) is whether the class violates in any second of (t, t + horizon];
  it exists once t + horizon is inside the data.
- The *features* of (class, t) look back over the last 60 s (last value, 10 s and 60 s means,
  maxima, a 10 s slope) at that class's latency relative to its target, arrivals, gateway queue and
  in-flight, and at the model as a whole: all classes' arrivals and completions, queues, the
  workers' own waiting queues, KV occupancy, utilisation, preemptions, tokens/s, prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A request's latency feature row (LATENCY_FEATURES, latency_row) lives in common.latency: the gateway builds the
# same rows to evaluate the trained trees itself.
from cotserve.common.v1 import common_pb2
from cotserve.common.latency import CLASS_INDEX
from cotserve.common.sampling import SLA_PB, SlaClass
from cotserve.common.sla import DEFAULT_SLA_TARGETS, SlaTarget

CLASS_NAMES = ("REALTIME", "INTERACTIVE", "BATCH")
PB_CLASSES = tuple(SLA_PB.values())
LOOKBACK_S = 60


@dataclass(slots=True)
class ModelSeries:
    """Dense per-second arrays of one model; per-class ones are [3, n], model-wide ones [n]."""

    t0_ms: int
    n: int
    arrivals: np.ndarray
    first_tokens: np.ndarray
    completions: np.ndarray
    ttft_p50: np.ndarray
    ttft_p99: np.ndarray
    itl_p95: np.ndarray
    queue: np.ndarray
    in_flight: np.ndarray
    prompt_sum: np.ndarray      # prompt tokens summed over completions (mean = / completions)
    worker_waiting: np.ndarray  # [n]
    kv: np.ndarray
    util: np.ndarray
    preemptions: np.ndarray
    tokens_per_s: np.ndarray
    workers: np.ndarray
    reported: np.ndarray        # [3, n] windows of that class in that second


def build_series(windows, t_end_ms: int | None = None) -> ModelSeries | None:
    """Merge one model's windows into per-second arrays (None without windows). Seconds with no
    window are zeros (an idle model reports nothing)."""
    windows = list(windows)
    if not windows:
        return None
    t0 = min(w.start_unix_ms for w in windows) // 1000 * 1000
    last = max(w.start_unix_ms for w in windows) // 1000 * 1000
    if t_end_ms is not None:
        last = max(last, t_end_ms // 1000 * 1000)
    n = (last - t0) // 1000 + 1
    z3, z1 = (lambda: np.zeros((3, n))), (lambda: np.zeros(n))
    s = ModelSeries(t0, n, z3(), z3(), z3(), z3(), z3(), z3(), z3(), z3(), z3(), z1(), z1(), z1(), z1(), z1(), z1(), z3())
    per_worker: dict[tuple[int, str], common_pb2.MetricsWindow] = {}
    for w in windows:
        c = CLASS_INDEX.get(w.sla_class)
        if c is None:
            continue
        t = (w.start_unix_ms // 1000 * 1000 - t0) // 1000
        s.reported[c, t] += 1
        s.arrivals[c, t] += w.arrivals
        s.completions[c, t] += w.completions
        s.ttft_p50[c, t] += w.ttft_p50_ms * w.first_tokens  # weighted, divided below
        s.first_tokens[c, t] += w.first_tokens
        s.ttft_p99[c, t] = max(s.ttft_p99[c, t], w.ttft_p99_ms)
        s.itl_p95[c, t] = max(s.itl_p95[c, t], w.itl_p95_ms)
        s.queue[c, t] += w.queue_depth
        s.in_flight[c, t] += w.in_flight
        s.prompt_sum[c, t] += w.mean_prompt_tokens * w.completions
        s.tokens_per_s[t] += w.output_tokens_per_s
        per_worker.setdefault((t, w.worker), w)  # worker-level fields are the same in each class's window
    with np.errstate(invalid="ignore", divide="ignore"):
        s.ttft_p50 = np.where(s.first_tokens > 0, s.ttft_p50 / np.maximum(s.first_tokens, 1), 0.0)
    for (t, _), w in per_worker.items():
        s.worker_waiting[t] += w.worker_waiting
        s.preemptions[t] += w.preemptions
        s.kv[t] += w.kv_used_fraction
        s.util[t] += w.utilization
        s.workers[t] += 1
    nz = np.maximum(s.workers, 1)
    s.kv, s.util = s.kv / nz, s.util / nz
    return s


def _target_columns(targets: dict[SlaClass, SlaTarget]) -> tuple[np.ndarray, np.ndarray]:
    """[3, 1] TTFT and ITL p95 targets, in class order."""
    return (np.array([targets[c].ttft_ms for c in SlaClass])[:, None],
            np.array([targets[c].itl_p95_ms for c in SlaClass])[:, None])


def violations(s: ModelSeries, targets: dict[SlaClass, SlaTarget] = DEFAULT_SLA_TARGETS) -> np.ndarray:
    """[3, n] booleans: the class missed its target in that second."""
    ttft_t, itl_t = _target_columns(targets)
    return (s.first_tokens > 0) & ((s.ttft_p99 > ttft_t) | (s.itl_p95 > itl_t))


def labels(viol: np.ndarray, horizon_s: int) -> tuple[np.ndarray, np.ndarray]:
    """([3, n] label, [n] valid): a violation within (t, t + horizon]; valid where t + horizon < n."""
    n = viol.shape[1]
    # future[c, t] = any(viol[c, t+1 : t+1+h]) via a reversed running window
    v = viol.astype(np.int32)
    csum = np.concatenate([np.zeros((3, 1), np.int32), np.cumsum(v, axis=1)], axis=1)
    t = np.arange(n)
    hi = np.minimum(t + 1 + horizon_s, n)
    out = (csum[:, hi] - csum[:, np.minimum(t + 1, n)]) > 0
    valid = t + horizon_s < n
    return out, valid


def _mean(x: np.ndarray, w: int) -> np.ndarray:
    """Trailing mean over the last w seconds (fewer at the start), along the last axis."""
    c = np.cumsum(np.concatenate([np.zeros(x.shape[:-1] + (1,)), x], axis=-1), axis=-1)
    n = x.shape[-1]
    t = np.arange(n)
    lo = np.maximum(0, t + 1 - w)
    return (c[..., t + 1] - c[..., lo]) / (t + 1 - lo)


def _max(x: np.ndarray, w: int) -> np.ndarray:
    pad = np.concatenate([np.zeros(x.shape[:-1] + (w - 1,)), x], axis=-1)
    return np.lib.stride_tricks.sliding_window_view(pad, w, axis=-1).max(axis=-1)


def _sum(x: np.ndarray, w: int) -> np.ndarray:
    t = np.arange(x.shape[-1])
    return _mean(x, w) * np.minimum(t + 1, w)


def _slope(x: np.ndarray) -> np.ndarray:
    """Last 10 s mean minus the 10 s before."""
    m = _mean(x, 10)
    prev = np.concatenate([np.zeros(x.shape[:-1] + (10,)), m[..., :-10]], axis=-1) if x.shape[-1] > 10 else np.zeros_like(m)
    return m - prev


FEATURES = (
    "is_realtime", "is_interactive", "is_batch",
    "ttft_p99_rel", "ttft_p99_rel_max10", "ttft_p99_rel_max60", "ttft_p50_rel_mean10", "itl_p95_rel_max10",
    "arrivals", "arrivals_mean10", "arrivals_mean60", "arrivals_slope",
    "queue", "queue_mean10", "queue_slope", "in_flight", "in_flight_mean10", "violations_60s",
    "all_arrivals_mean10", "all_arrivals_mean60", "all_arrivals_slope", "all_completions_mean10", "backlog_growth_10s",
    "all_queue", "all_queue_mean10", "all_queue_slope", "all_in_flight", "all_in_flight_mean10",
    "worker_waiting", "worker_waiting_mean10", "worker_waiting_slope",
    "kv_used", "kv_used_mean10", "kv_used_slope", "utilization_mean10", "preemptions_60s", "tokens_per_s_mean10",
    "prompt_tokens_mean10", "workers",
)


def feature_matrix(s: ModelSeries, targets: dict[SlaClass, SlaTarget] = DEFAULT_SLA_TARGETS) -> np.ndarray:
    """[3, n, len(FEATURES)]: every class's features at every second."""
    n = s.n
    ttft_t, itl_t = _target_columns(targets)
    ttft_rel, p50_rel, itl_rel = s.ttft_p99 / ttft_t, s.ttft_p50 / ttft_t, s.itl_p95 / itl_t
    viol = violations(s, targets).astype(float)
    all_arr, all_comp = s.arrivals.sum(0), s.completions.sum(0)
    all_q, all_f = s.queue.sum(0), s.in_flight.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        prompt = np.where(all_comp > 0, s.prompt_sum.sum(0) / np.maximum(all_comp, 1), 0.0)
    model_wide = [
        _mean(all_arr, 10), _mean(all_arr, 60), _slope(all_arr), _mean(all_comp, 10), _sum(all_arr - all_comp, 10),
        all_q, _mean(all_q, 10), _slope(all_q), all_f, _mean(all_f, 10),
        s.worker_waiting, _mean(s.worker_waiting, 10), _slope(s.worker_waiting),
        s.kv, _mean(s.kv, 10), _slope(s.kv), _mean(s.util, 10), _sum(s.preemptions, 60), _mean(s.tokens_per_s, 10),
        _mean(prompt, 10), s.workers,
    ]
    out = np.zeros((3, n, len(FEATURES)))
    for c in range(3):
        onehot = [np.full(n, float(c == k)) for k in range(3)]
        per_class = [
            ttft_rel[c], _max(ttft_rel[c], 10), _max(ttft_rel[c], 60), _mean(p50_rel[c], 10), _max(itl_rel[c], 10),
            s.arrivals[c], _mean(s.arrivals[c], 10), _mean(s.arrivals[c], 60), _slope(s.arrivals[c]),
            s.queue[c], _mean(s.queue[c], 10), _slope(s.queue[c]), s.in_flight[c], _mean(s.in_flight[c], 10),
            _sum(viol[c], 60),
        ]
        out[c] = np.stack(onehot + per_class + model_wide, axis=-1)
    return out


def baseline_score(s: ModelSeries) -> np.ndarray:
    """The naive baseline: requests queued now (gateway queues of every class + the workers' own)."""
    return s.queue.sum(0) + s.worker_waiting
