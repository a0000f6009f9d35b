"""Metric windows aggregated: one worker's per-class windows of one second as one worker-level window.

The gateway reports a window per worker, class and second to the SLO predictor (`slo.v1.MetricsWindow`); both
the gateway (routing by predicted latency needs the worker's state as the predictor saw it) and the predictor
(its latency features) fold a worker's classes into one window the same way.
"""

from __future__ import annotations

from cotserve.common.v1 import common_pb2


def worker_total(windows, worker: str = "", start_unix_ms: int = 0) -> common_pb2.MetricsWindow:
    """One worker's windows of one second (one per class) as a single worker-level window: counts
    and queues summed, latencies the arrival-weighted mean of the classes' p50s."""
    total = common_pb2.MetricsWindow(worker=worker, start_unix_ms=start_unix_ms)
    ttft_w = itl_w = 0.0
    for w in windows:
        total.model = total.model or w.model
        total.arrivals += w.arrivals
        total.completions += w.completions
        total.first_tokens += w.first_tokens
        total.queue_depth += w.queue_depth
        total.in_flight += w.in_flight
        total.preemptions = max(total.preemptions, w.preemptions)
        total.output_tokens_per_s += w.output_tokens_per_s
        total.worker_waiting = max(total.worker_waiting, w.worker_waiting)
        total.worker_running = max(total.worker_running, w.worker_running)
        total.worker_step_ms = max(total.worker_step_ms, w.worker_step_ms)
        total.worker_tokens_per_s = max(total.worker_tokens_per_s, w.worker_tokens_per_s)
        total.worker_max_num_seqs = max(total.worker_max_num_seqs, w.worker_max_num_seqs)
        total.kv_used_fraction = max(total.kv_used_fraction, w.kv_used_fraction)
        total.utilization = max(total.utilization, w.utilization)
        total.utilization_is_cpu = w.utilization_is_cpu
        total.memory_used_bytes = max(total.memory_used_bytes, w.memory_used_bytes)
        ttft_w += w.ttft_p50_ms * w.first_tokens
        itl_w += w.itl_p50_ms * max(w.completions, w.first_tokens)
    if total.first_tokens:
        total.ttft_p50_ms = ttft_w / total.first_tokens
    denom = sum(max(w.completions, w.first_tokens) for w in windows)
    if denom:
        total.itl_p50_ms = itl_w / denom
    return total
